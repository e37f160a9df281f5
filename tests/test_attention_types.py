"""The attention-type registry: declarations, options, per-layer types, entry points."""

from __future__ import annotations

import json

import pytest
import torch

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.attention.baseline import Baseline, BaselineAttention
from diffattn.attention.types import (
    AttentionType,
    TypeOption,
    attention_type,
    attention_type_names,
    positive_int,
    register_attention_type,
    unregister_attention_type,
)
from diffattn.cache import DynamicCache, StaticCache, cache_bytes_per_token
from diffattn.flops import flops_per_token

SMALL = dict(vocab_size=61, d_model=32, n_layers=4, n_heads=4, max_seq_len=64)


class ScaledAttention(BaselineAttention):
    """Softmax attention whose output is multiplied by a fixed ``scale`` option."""

    def attend(self, x, q, k, v, mask, need_weights):
        out, maps = super().attend(x, q, k, v, mask, need_weights)
        return out * self.config.options_of("scaled")["scale"], maps


class Scaled(Baseline):
    name = "scaled"
    title = "Scaled softmax"
    colour = None
    module = ScaledAttention
    options = (
        TypeOption("scale", 1.0, "multiplies the attention output", float),
        TypeOption("copies", 1, "unused count, to test int options", int, positive_int),
    )


@pytest.fixture
def scaled():
    declaration = register_attention_type(Scaled())
    yield declaration
    unregister_attention_type("scaled")


def test_the_papers_types_are_registered_first():
    assert attention_type_names()[:3] == ("baseline", "diff_v1", "diff_v2")
    assert attention_type("diff_v1").title == "DIFF V1"
    with pytest.raises(ValueError, match="unknown attention type 'nope'; choose one of baseline"):
        attention_type("nope")


def test_registration_refuses_a_taken_name_and_a_declaration_without_module():
    with pytest.raises(ValueError, match="'baseline' is already registered"):
        register_attention_type(Baseline())
    with pytest.raises(ValueError, match="declares no module"):
        register_attention_type(type("NoModule", (AttentionType,), {"name": "no_module"})())
    with pytest.raises(TypeError, match="takes an AttentionType instance"):
        register_attention_type("baseline")
    with pytest.raises(ValueError, match="built-in"):
        unregister_attention_type("diff_v1")


def test_a_registered_type_builds_trains_and_keeps_its_options(scaled):
    config = ModelConfig(**SMALL, attention="scaled", attention_options={"scaled": {"scale": 0.5}})
    assert config.options_of("scaled") == {"scale": 0.5, "copies": 1}
    torch.manual_seed(0)
    model = DiffTransformerLM(config)
    plain = DiffTransformerLM(config.replace(attention="baseline", attention_options={}))
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 61, (2, 9))
    assert not torch.allclose(model(ids).logits, plain(ids).logits)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    stored = json.loads(json.dumps(config.to_dict()))
    assert stored["attention_options"] == {"scaled": {"scale": 0.5}}
    assert ModelConfig.from_dict(stored) == config


@pytest.mark.parametrize(
    ("options", "field", "why"),
    [
        ({"scaled": {"size": 2}}, "attention_options.scaled.size", "unknown option of scaled"),
        ({"scaled": {"copies": 0}}, "attention_options.scaled.copies", "positive integer"),
        ({"scaled": {"copies": 1.5}}, "attention_options.scaled.copies", "must be a int"),
        ({"scaled": {"scale": True}}, "attention_options.scaled.scale", "must be a float"),
        ({"diff_v1": {}}, "attention_options", "no layer of this model uses"),
        ({"scaled": 3}, "attention_options.scaled", "must be a mapping"),
    ],
)
def test_bad_options_name_the_option(scaled, options, field, why):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}: .*{why}"):
        ModelConfig(**SMALL, attention="scaled", attention_options=options)


def test_option_text_parses_to_its_kind():
    ratio = TypeOption("ratio", 3, "signal heads per noise head", int, positive_int)
    assert ratio.parse("4") == 4
    with pytest.raises(ValueError, match="option 'ratio': expected a int, got 'x'"):
        ratio.parse("x")
    flag = TypeOption("on", True, "a switch", bool)
    assert (flag.parse("false"), flag.parse("Yes")) == (False, True)


def test_a_single_type_config_dict_is_what_it_always_was():
    data = ModelConfig(**SMALL, attention="diff_v1").to_dict()
    assert "layer_types" not in data and "attention_options" not in data


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("diff_v1*3,baseline", ("diff_v1", "diff_v1", "diff_v1", "baseline")),
        ("diff_v1,baseline", ("diff_v1", "baseline", "diff_v1", "baseline")),
        (
            ["baseline", "diff_v2", "diff_v2", "baseline"],
            ("baseline", "diff_v2", "diff_v2", "baseline"),
        ),
    ],
)
def test_layer_types_expand_to_one_name_per_layer(given, expected):
    config = ModelConfig(**SMALL, layer_types=given)
    assert config.layer_types == expected
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert [config.type_of_layer(i).name for i in range(4)] == list(expected)


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("diff_v1*3", "has 3 layers, which do not divide n_layers=4"),
        ("diff_v1*x", "cannot read the pattern"),
        (["baseline"] * 3, "names 3 layers, but n_layers=4"),
        ("baseline,nope", "unknown attention type 'nope'"),
        (7, "must be a list of type names or a pattern"),
    ],
)
def test_bad_layer_types_name_the_field(given, why):
    with pytest.raises(ValueError, match=rf"ModelConfig\.layer_types: .*{why}"):
        ModelConfig(**SMALL, layer_types=given)


def test_each_layer_of_a_mixed_stack_checks_its_own_heads():
    with pytest.raises(ValueError, match="diff_v1 pairs key heads"):
        ModelConfig(**{**SMALL, "n_kv_heads": 1}, layer_types="baseline,diff_v1")
    with pytest.raises(ValueError, match="does not support a stack of mixed attention types"):
        _ = ModelConfig(**SMALL, layer_types="baseline,diff_v1").n_query_heads


def mixed_config(**changes):
    return ModelConfig(
        **{**SMALL, "n_kv_heads": 2, **changes}, layer_types="diff_v1,baseline,diff_v2,diff_v1"
    )


def test_a_mixed_stack_builds_each_layer_from_its_type():
    config = mixed_config()
    torch.manual_seed(0)
    model = DiffTransformerLM(config)
    kinds = [type(block.attn).__name__ for block in model.layers]
    assert kinds == ["DiffAttentionV1", "BaselineAttention", "DiffAttentionV2", "DiffAttentionV1"]
    # λ_init follows the depth of the whole stack (DIFF V1 Eq.2)
    assert model.layers[3].attn.lambda_init == pytest.approx(0.8 - 0.6 * 2.718281828 ** (-0.9))
    n_params = sum(p.numel() for p in model.parameters())
    one_type = {
        name: sum(
            p.numel()
            for p in DiffTransformerLM(
                config.replace(layer_types=None, attention=name)
            ).parameters()
        )
        for name in ("baseline", "diff_v1", "diff_v2")
    }
    per_layer = {name: (n - one_type["baseline"]) / 4 for name, n in one_type.items()}
    expected = one_type["baseline"] + 2 * per_layer["diff_v1"] + per_layer["diff_v2"]
    assert n_params == expected


def test_a_mixed_stack_gives_the_same_tokens_with_and_without_a_cache():
    config = mixed_config()
    torch.manual_seed(1)
    model = DiffTransformerLM(config).eval()
    ids = torch.randint(0, 61, (2, 7))
    full = model(ids).logits
    for cache in (DynamicCache(), StaticCache(config, 2, 16)):
        steps = [model(ids[:, :4], past_key_values=cache).logits]
        for t in range(4, 7):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    static = StaticCache(config, batch_size=2, max_len=16)
    assert [tuple(v.shape) for v in static.values] == [
        (2, 1, 16, 16),
        (2, 2, 16, 8),
        (2, 2, 16, 8),
        (2, 1, 16, 16),
    ]


def test_flops_and_cache_of_a_mixed_stack_are_the_sum_of_its_layers():
    config = mixed_config()
    singles = {
        name: config.replace(layer_types=None, attention=name)
        for name in ("baseline", "diff_v1", "diff_v2")
    }
    per_layer = {name: flops_per_token(c, 32).forward / 4 for name, c in singles.items()}
    lm_head = 2.0 * config.d_model * config.vocab_size
    expected = (
        2 * per_layer["diff_v1"] + per_layer["baseline"] + per_layer["diff_v2"]
    ) - lm_head * 0
    got = flops_per_token(config, 32).forward
    # each single-type count carries the LM head once; take it out of the per-layer share
    expected = (
        sum(flops_per_token(singles[name], 32).forward - lm_head for name in config.layer_types) / 4
        + lm_head
    )
    assert got == pytest.approx(expected, rel=1e-12)
    assert cache_bytes_per_token(config) == cache_bytes_per_token(singles["baseline"])


def test_entry_points_register_types_from_other_packages(monkeypatch):
    from importlib import metadata

    import diffattn.attention.types as types

    class Entry:
        name = "from_entry"

        def load(self):
            return type("FromEntry", (Baseline,), {"name": "from_entry", "title": "From entry"})

    class Broken:
        name = "broken"

        def load(self):
            raise ImportError("no module named broken_pkg")

    real = metadata.entry_points

    def entry_points(group=None, **kwargs):
        if group == types.ENTRY_POINT_GROUP:
            return [Entry(), Broken()]
        return real(group=group, **kwargs)

    monkeypatch.setattr(types.metadata, "entry_points", entry_points)
    monkeypatch.setattr(types, "_discovered", False)
    try:
        assert attention_type("from_entry").title == "From entry"
        with pytest.raises(ValueError, match="its entry point failed to load: ImportError"):
            attention_type("broken")
    finally:
        unregister_attention_type("from_entry")
        types._entry_point_errors.pop("broken", None)


def test_generate_runs_a_type_that_cannot_decode_from_a_cache_without_one():
    """DINT declares ``decodes_from_cache = False``: every step runs the whole sequence, and
    the tokens are the greedy ones of full forwards (left padding included)."""
    from diffattn.generation import generate

    torch.manual_seed(0)
    model = DiffTransformerLM(ModelConfig(**SMALL, attention="dint")).eval()
    ids, mask = (
        torch.tensor([[1, 2, 3, 4], [0, 0, 5, 6]]),
        torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]),
    )
    out = generate(model, ids, attention_mask=mask, max_new_tokens=5, temperature=0)
    seq, real = ids, mask
    for _ in range(5):
        token = model(seq, attention_mask=real).logits[:, -1].argmax(-1, keepdim=True)
        seq, real = torch.cat([seq, token], 1), torch.cat([real, torch.ones_like(token)], 1)
    assert torch.equal(out.sequences, seq)
    with pytest.raises(ValueError, match="'dint' cannot decode from a KV cache, so neither"):
        generate(model, ids, max_new_tokens=2, cache="static")
