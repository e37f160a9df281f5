"""The capture probe, ``auto`` and the λ records ask each layer's attention type: a type
registered here (a softmax type of its own name) and mixed stacks (``layer_types``)."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn import DiffTransformerLM
from diffattn.attention import auto
from diffattn.attention.baseline import Baseline
from diffattn.attention.registry import (
    ENTRIES,
    ENTRY_DIFF,
    ENTRY_DIFF_V2,
    ENTRY_SOFTMAX,
    Backend,
    compose_v1,
    get_backend,
)
from diffattn.attention.types import (
    attention_type,
    register_attention_type,
    unregister_attention_type,
)
from diffattn.probe import AttentionEntropy, AttentionMaps, HeadGates, HeadOutputs, Lambda, Probe
from helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = "toy_softmax"
IDS = torch.tensor([[3, 17, 5, 99, 42, 8, 61, 7, 12]])


class ToySoftmax(Baseline):
    """A type of its own name whose module is the baseline's (it calls softmax_attention)."""

    name = TOY
    title = "Toy softmax"
    colour = None


@pytest.fixture
def toy():
    declaration = register_attention_type(ToySoftmax())
    yield declaration
    unregister_attention_type(TOY)


def _model(seed: int = 0, **fields) -> DiffTransformerLM:
    torch.manual_seed(seed)
    return DiffTransformerLM(tiny_config(**fields)).eval()


def _reference_maps(model: DiffTransformerLM) -> dict[int, dict[str, torch.Tensor]]:
    """Each layer's maps as the probe reports them for one forward of ``IDS``."""
    got = {}
    with Probe(model, [maps := AttentionMaps(what=("probs",))]), torch.no_grad():
        model(IDS)
    for layer, calls in maps.result().items():
        got[layer] = calls[0]
    return got


def test_a_registered_type_is_watched_as_its_declaration_says(toy):
    model = _model(attention=TOY, backend="sdpa")
    config = model.config
    maps = AttentionMaps(what=("probs", "applied", "lam"))
    lam = Lambda()
    with Probe(model, [maps, lam]) as probe, torch.no_grad():
        out = model(IDS).logits
        for view in probe.layers:
            assert view.declaration is toy and view.type_name == TOY
            assert view.kind == ENTRY_SOFTMAX and not view.differential
            assert (view.out_heads, view.out_head_dim) == (config.n_heads, config.dim_per_head)
            assert view.scalar_lambda is None and view.token_lambda is None
    result = maps.result()
    assert sorted(result) == list(range(config.n_layers))  # maps of every layer
    for calls in result.values():
        (call,) = calls
        assert set(call) == {"probs.a", "applied"}  # one softmax map, no λ
        a = call["probs.a"]
        assert a.shape == (1, config.n_heads, IDS.shape[1], IDS.shape[1])
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), rtol=0, atol=1e-6)
        assert torch.equal(call["applied"], a)
    assert lam.result() == {}
    # the probe changes nothing: the same model unwatched gives the same logits
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, out, rtol=1e-5, atol=1e-5)


def test_a_registered_type_equals_the_baseline_it_subclasses(toy):
    """Same module, same initialisation: the toy's maps are the baseline's, bit for bit."""
    ours = _reference_maps(_model(attention=TOY, backend="reference"))
    base = _reference_maps(_model(attention="baseline", backend="reference"))
    assert sorted(ours) == sorted(base)
    for layer in ours:
        assert torch.equal(ours[layer]["probs.a"], base[layer]["probs.a"])


def test_auto_resolves_a_registered_softmax_type_on_the_cpu(toy):
    from diffattn.bench.backends import auto_choice

    assert toy.entry == ENTRY_SOFTMAX
    for case in ("train", "prefill", "decode", "prefill + padding", "custom mask", "traced"):
        assert auto_choice(toy.entry, case, "cpu", torch.float32, 16) == "sdpa", case
    model = _model(attention=TOY, backend="auto", max_seq_len=64)
    reference = _model(attention=TOY, backend="reference", max_seq_len=64)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, reference(IDS).logits, rtol=1e-5, atol=1e-5)
    # a training step runs on auto as well
    model.train()
    model(IDS, labels=IDS).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_entry_points_are_declared_once_and_named_by_the_types():
    assert ENTRIES == (ENTRY_SOFTMAX, ENTRY_DIFF, ENTRY_DIFF_V2)
    assert tuple(attention_type(n).entry for n in ("baseline", "diff_v1", "diff_v2")) == ENTRIES
    assert auto.ENTRIES is ENTRIES


def test_auto_lists_a_backend_only_for_the_entry_points_it_has_a_kernel_of_its_own_for():
    """``fused`` brings DIFF V1's compiled kernel and runs the others as sdpa does, so on the
    CPU it is a candidate for DIFF V1 calls only."""
    fused, sdpa = get_backend("fused"), get_backend("sdpa")
    assert fused.kernel_of(ENTRY_DIFF) != sdpa.kernel_of(ENTRY_DIFF)
    assert fused.kernel_of(ENTRY_SOFTMAX) == sdpa.kernel_of(ENTRY_SOFTMAX)
    assert fused.kernel_of(ENTRY_DIFF_V2) == sdpa.kernel_of(ENTRY_DIFF_V2)
    call = auto.Call(ENTRY_SOFTMAX, "cpu", torch.float32, True, False, False, False, False)
    assert auto.order(call) == ("sdpa",)
    assert auto.order(auto.Call(ENTRY_DIFF_V2, *tuple(call.__dict__.values())[1:])) == ("sdpa",)
    assert auto.order(auto.Call(ENTRY_DIFF, *tuple(call.__dict__.values())[1:])) == (
        "fused",
        "sdpa",
    )
    # a backend that leaves an entry point out runs it composed from its softmax
    lone = Backend("lone", get_backend("reference").softmax)
    assert lone.kernel_of(ENTRY_DIFF) == (ENTRY_DIFF, lone.softmax)
    assert compose_v1(lone.softmax).composed_from is lone.softmax
    with pytest.raises(ValueError, match="unknown attention entry point 'gda'"):
        lone.entry_point("gda")


def test_a_mixed_stack_is_captured_layer_by_layer():
    model = _model(layer_types="diff_v1,baseline,diff_v2", n_layers=3, backend="reference")
    config = model.config
    maps = AttentionMaps(what=("probs", "applied", "lam"))
    lam, outputs, gates = Lambda(), HeadOutputs(), HeadGates()
    entropy = {m: AttentionEntropy(map=m) for m in ("applied", "a1", "a2")}
    with Probe(model, [maps, lam, outputs, gates, *entropy.values()]) as probe:
        loss = model(IDS, labels=IDS).loss
        kinds = [(v.type_name, v.kind, v.differential, v.lambda_key) for v in probe.layers]
    assert kinds == [
        ("diff_v1", ENTRY_DIFF, True, "lambda"),
        ("baseline", ENTRY_SOFTMAX, False, None),
        ("diff_v2", ENTRY_DIFF_V2, True, "lambda_mean"),
    ]
    (v1,), (base,), (v2,) = (maps.result()[i] for i in range(3))
    n, h, d = IDS.shape[1], config.n_heads, config.dim_per_head
    assert set(v1) == {"probs.a1", "probs.a2", "applied", "lam"} and v1["lam"].dim() == 0
    assert set(base) == {"probs.a", "applied"}  # maps for every layer, no λ
    assert set(v2) == {"probs.a1", "probs.a2", "applied", "lam"}
    assert v1["applied"].shape == (1, h // 2, n, n) and base["applied"].shape == (1, h, n, n)
    torch.testing.assert_close(
        v1["applied"], v1["probs.a1"] - v1["lam"] * v1["probs.a2"], rtol=0, atol=1e-7
    )
    # head outputs and gates split each layer as its own type does
    shapes = [outputs.result()[i][0]["output"].shape[1:] for i in range(3)]
    assert shapes == [(h // 2, n, 2 * d), (h, n, d), (h, n, d)]
    assert [tuple(g.shape) for g in gates.ordered()] == [(1, h // 2), (1, h), (1, h)]
    loss.backward()
    assert all(g.grad is not None for g in gates.ordered())
    # λ: one list per key, one entry per layer, NaN where the layer's type has no such λ
    result = lam.result()
    assert set(result) == {"lambda", "lambda_mean"}
    want_v1 = float(model.layers[0].attn.lambda_full().detach())
    assert result["lambda"][0] == pytest.approx(want_v1, abs=1e-7)
    assert math.isnan(result["lambda"][1]) and math.isnan(result["lambda"][2])
    assert math.isnan(result["lambda_mean"][0]) and math.isnan(result["lambda_mean"][1])
    assert 0.0 < result["lambda_mean"][2] < 1.0
    # A1 and A2 entropies: none at the softmax layer; the applied map's at every layer
    applied = entropy["applied"].result()  # layers × the most heads of a layer
    assert applied.shape == (3, h) and torch.isnan(applied[0, h // 2 :]).all()
    assert not torch.isnan(applied[0, : h // 2]).any() and not torch.isnan(applied[1:]).any()
    for name in ("a1", "a2"):
        per_layer = entropy[name].result()
        assert torch.isnan(per_layer[1]).all() and not torch.isnan(per_layer[0, : h // 2]).any()


@pytest.mark.parametrize("layer_types", ["baseline,diff_v1", f"{TOY},diff_v2"])
def test_a_mixed_stacks_maps_equal_output_attentions(toy, layer_types):
    """Each layer of a mixed stack is observed as its own type computes it: the maps, λ and
    the applied map equal those ``output_attentions`` returns (the reference kernel)."""
    model = _model(layer_types=layer_types, backend="sdpa")
    full = model(IDS, output_attentions=True)
    maps = AttentionMaps(what=("applied", "probs", "lam"))
    with Probe(model, [maps], block_rows=4), torch.no_grad():
        model(IDS)
    got = maps.result()
    assert sorted(got) == [0, 1]
    for layer, reference in enumerate(full.attention_maps):
        call = got[layer][0]
        torch.testing.assert_close(call["applied"], reference.diff, rtol=0, atol=1e-6)
        assert (reference.a1 is not None) == ("probs.a1" in call) == ("lam" in call)
        if reference.a1 is not None:
            torch.testing.assert_close(call["probs.a1"], reference.a1, rtol=0, atol=1e-6)
            torch.testing.assert_close(call["probs.a2"], reference.a2, rtol=0, atol=1e-6)
