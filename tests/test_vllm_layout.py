"""The layouts that put each attention type on one stock paged-attention call (vLLM's), checked
without vLLM: the type's queries, one plain causal GQA softmax call over the layout's heads, then
the type's combine step, equal diffattn's own attention module, for every type, GQA and MHA, odd
lengths and the ablations, on tensor-parallel ranks, and for each layer of a stack of mixed
types; the cache it implies is the least the model needs; a type without a layout is refused
with its declared reason."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from diffattn import DiffTransformerLM
from diffattn.attention.baseline import Baseline, BaselineAttention
from diffattn.attention.common import project_qkv
from diffattn.attention.diff_v1 import DIFF_V1
from diffattn.attention.gda import GDA
from diffattn.attention.mask import AttentionMask
from diffattn.attention.types import (
    AttentionType,
    register_attention_type,
    unregister_attention_type,
)
from diffattn.vllm_plugin.layout import (
    attention_layout,
    attention_layouts,
    head_size_problem,
    ideal_kv_cache_bytes_per_token,
    kv_cache_bytes_per_token,
)
from helpers import tiny_config

TOL = 2e-6


def stock_attention(q, k, v, layout):
    """What a paged-attention backend computes for one sequence under ``layout``: causal
    softmax per query head, query head i reading KV head i // (num_heads / num_kv_heads).
    Token-major ``(T, H·w)``."""
    t, width = q.shape[0], layout.head_size
    q = q.view(t, layout.num_heads, width).transpose(0, 1).double()
    k = k.view(t, layout.num_kv_heads, width).transpose(0, 1).double()
    v = v.view(t, layout.num_kv_heads, width).transpose(0, 1).double()
    rep = layout.num_heads // layout.num_kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(-1, -2) * layout.scale
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1).reshape(t, -1).float()


def token_major(x: torch.Tensor) -> torch.Tensor:
    """``(1, H, T, w)`` → ``(T, H·w)``, as vLLM holds a sequence's heads."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


def rank_part(tensor: torch.Tensor, dim: int | None, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous part of ``tensor`` along ``dim`` (all of it for ``None``)."""
    return tensor if dim is None else tensor.chunk(tp_size, dim)[rank]


def through_layout(attn, x, rope, tp_size: int = 1):
    """One layer's attention output by the vLLM layout of its own type, as
    ``DiffAttnAttention.forward`` computes it on each of ``tp_size`` ranks (q, k, v heads in
    contiguous parts, as vLLM's ``QKVParallelLinear`` splits them, the type's weights cut by
    their ``split_dim``), with :func:`stock_attention` in place of vLLM's kernel; the ranks'
    outputs joined before W_O (``RowParallelLinear`` sums their products, the same thing)."""
    config, layer = attn.config, attn.layer_index
    declaration = config.type_of_layer(layer)
    layout = attention_layout(config, layer, tp_size)
    q, k, v = (token_major(t) for t in project_qkv(attn, x, rope, None, attn.head_dim))
    specs = declaration.vllm_weights(config, layer)
    outputs = []
    for rank in range(tp_size):
        q_r, k_r, v_r = (t.chunk(tp_size, -1)[rank] for t in (q, k, v))
        out = stock_attention(declaration.vllm_queries(config, q_r), k_r, v_r, layout)
        weights = {
            name: rank_part(attn.get_parameter(name), spec.split_dim, rank, tp_size)
            for name, spec in specs.items()
        }
        outputs.append(declaration.vllm_output(config, layer, out, x[0], weights))
    return attn.o_proj(torch.cat(outputs, dim=-1))


def gda_fields(ratio: int, n_heads: int, n_kv_heads: int = 2, **options) -> dict:
    """``ModelConfig`` fields of a GDA model of head width 16."""
    gda = {"ratio": ratio, **options}
    return dict(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=16, attention_options={"gda": gda})


GDA_FIELDS = [
    gda_fields(1, 4),  # DIFF V1's layer
    gda_fields(2, 6),  # 'queries': H_s = 4, H_n = 2 over one KV group (GQA)
    gda_fields(2, 12, 4),  # H_s = 8, H_n = 4 over two KV groups
    gda_fields(3, 8),  # H_s = 6, H_n = 2, one KV group
    gda_fields(3, 8, 4),  # one noise head per KV group (MHA)
    gda_fields(2, 8, 4, head_budget="outputs"),  # H_s = 4, H_n = 2, one per KV group
    gda_fields(3, 12, 2, head_budget="outputs"),  # H_s = 6, H_n = 2
    gda_fields(2, 8, 4, n_noise_heads=4),  # H_s = 8, H_n = 4 given outright
    {**gda_fields(3, 8, 4), "head_norm_learnable": False, "lambda_init": 0.5},
    {**gda_fields(2, 6), "head_norm": False, "rope_style": "interleaved"},
]
"""GDA models: ratios 1-3, both ``head_budget`` values, one or more KV groups, the ablations."""

CASES = [
    ("baseline", {}),
    ("baseline", {"n_kv_heads": 4}),
    ("diff_v1", {}),
    ("diff_v1", {"n_kv_heads": 4}),
    ("diff_v1", {"n_heads": 8, "n_kv_heads": 4, "head_dim": 16}),
    ("diff_v1", {"head_norm_learnable": False, "lambda_init": 0.5}),
    ("diff_v1", {"head_norm": False, "rope_style": "interleaved"}),
    ("diff_v2", {}),
    ("diff_v2", {"n_kv_heads": 4}),
    ("diff_v2", {"v2_paired_heads": False, "v2_lambda_sigmoid": False}),
    ("diff_v2", {"v2_use_lambda": False}),
    *(("gda", fields) for fields in GDA_FIELDS),
]


def perturbed(config) -> DiffTransformerLM:
    """A model of ``config`` with every weight moved off its init (λ vectors, norms)."""
    torch.manual_seed(0)
    model = DiffTransformerLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def layer_output(model, layer: int, length: int, tp_size: int = 1):
    """``(through the layout, diffattn's own)`` output of layer ``layer``'s attention."""
    with torch.no_grad():
        attn = model.layers[layer].attn
        x = torch.randn(1, length, model.config.d_model)
        rope = model.rotary(torch.arange(length)[None])
        expected, _ = attn(x, rope, AttentionMask(query_offset=0))
        return through_layout(attn, x, rope, tp_size), expected[0]


@pytest.mark.parametrize("length", [1, 7, 129])
@pytest.mark.parametrize(("attention", "overrides"), CASES)
def test_layout_equals_diffattn_attention(attention, overrides, length):
    model = perturbed(tiny_config(attention, **overrides))
    got, expected = layer_output(model, 1, length)
    torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    ("attention", "overrides"),
    [
        ("baseline", {}),
        ("diff_v1", {}),
        ("diff_v1", {"head_norm_learnable": False}),
        ("diff_v2", {}),
        ("diff_v2", {"v2_use_lambda": False}),
    ],
)
def test_tensor_parallel_ranks_together_equal_the_layer(attention, overrides):
    """Two ranks, each with its part of the heads and of the type's weights (W_λ's rows for
    DIFF V2, whole λ vectors and norm weight for DIFF V1), give the layer's output."""
    model = perturbed(tiny_config(attention, n_kv_heads=4, **overrides))
    got, expected = layer_output(model, 1, 9, tp_size=2)
    torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    "fields",
    [
        gda_fields(2, 12, 4),
        gda_fields(3, 8, 4),
        gda_fields(2, 8, 4, head_budget="outputs"),
        {**gda_fields(3, 16, 8), "head_norm_learnable": False},
    ],
)
def test_gda_tensor_parallel_ranks_hold_whole_kv_groups(fields):
    """Two ranks, each with whole KV groups: their ``(r + 1)``-head query groups (contiguous
    ``q_proj`` rows), their signal heads' W_O columns, λ and the norm weight whole; together
    they give the GDA layer's output."""
    config = tiny_config("gda", **fields)
    layout = attention_layout(config, 0, tp_size=2)
    heads = GDA.heads(config)
    assert (layout.num_heads, layout.num_kv_heads) == (heads.n_signal, heads.n_groups // 2)
    got, expected = layer_output(perturbed(config), 1, 9, tp_size=2)
    torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)


MIXED = "diff_v1,baseline,diff_v2,diff_v1"


@pytest.mark.parametrize(
    ("layer_types", "expected_calls"),
    [
        (MIXED, [(4, 1, 32), (4, 2, 16), (8, 2, 16), (4, 1, 32)]),
        # GDA 3:1: three signal heads share one noise head, W_O over 3·2d
        ("gda,baseline,diff_v1", [(6, 1, 32), (4, 2, 16), (4, 1, 32)]),
    ],
)
def test_each_layer_of_a_mixed_stack_is_served_by_its_own_type(layer_types, expected_calls):
    """A stack of mixed types: each layer gets its own call (its heads and width), and the
    model whose attention runs through the layouts gives diffattn's logits."""
    config = tiny_config(n_layers=len(expected_calls), layer_types=layer_types)
    layouts = attention_layouts(config)
    calls = [(layout.num_heads, layout.num_kv_heads, layout.head_size) for layout in layouts]
    assert calls == expected_calls
    model = perturbed(config)
    for layer in range(config.n_layers):
        got, expected = layer_output(model, layer, 7)
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
    ids = torch.randint(0, config.vocab_size, (1, 11))
    with torch.no_grad():
        expected = model(ids).logits
        for block in model.layers:

            def served(x, rope, mask, need_weights=False, cache=None, attn=block.attn):
                return through_layout(attn, x, rope)[None], None

            block.attn.forward = served
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gda_queries_pair_each_signal_head_with_its_noise_head():
    """D2: q_proj's groups of r + 1 heads (r signal, then their noise head) become DIFF V1's
    pairs ``(Q1_i, Q2_{i // r})``, each padded to 2d."""
    config = tiny_config("gda", **gda_fields(3, 8, 4))  # groups [s0 s1 s2 n0] [s3 s4 s5 n1]
    q = torch.randn(5, 8 * 16)
    padded = GDA.vllm_queries(config, q).view(5, 12, 32)
    heads = q.view(5, 8, 16)
    for i in range(6):
        group, t = divmod(i, 3)
        assert torch.equal(padded[:, 2 * i, :16], heads[:, 4 * group + t])
        assert torch.equal(padded[:, 2 * i + 1, 16:], heads[:, 4 * group + 3])
    assert not padded[:, 0::2, 16:].any() and not padded[:, 1::2, :16].any()


def test_v1_padded_queries_put_each_map_on_its_key_half():
    q = torch.arange(2 * 2 * 2 * 3, dtype=torch.float32).view(2, 2 * 2 * 3)  # T=2, H=2, d=3
    padded = DIFF_V1.vllm_queries(SimpleNamespace(dim_per_head=3), q).view(2, 4, 6)
    pairs = q.view(2, 2, 2, 3)
    assert torch.equal(padded[:, 0::2, :3], pairs[:, :, 0])
    assert torch.equal(padded[:, 1::2, 3:], pairs[:, :, 1])
    assert not padded[:, 0::2, 3:].any() and not padded[:, 1::2, :3].any()


@pytest.mark.parametrize("layer_types", ["baseline", "diff_v1", "diff_v2", "diff_v1,baseline"])
@pytest.mark.parametrize("n_kv_heads", [2, 4])
def test_cache_is_the_least_the_model_needs_and_the_baselines(layer_types, n_kv_heads):
    config = tiny_config(layer_types=layer_types, n_kv_heads=n_kv_heads)
    baseline = tiny_config("baseline", n_kv_heads=n_kv_heads)
    for element_bytes in (2, 4):
        stored = kv_cache_bytes_per_token(config, element_bytes)
        assert stored == ideal_kv_cache_bytes_per_token(config, element_bytes)
        assert stored == ideal_kv_cache_bytes_per_token(baseline, element_bytes)


@pytest.mark.parametrize("fields", GDA_FIELDS[:7])
def test_gda_cache_is_diff_v1s(fields):
    """GDA's cache is DIFF V1's (K1, K2 at d and V at 2d per KV group), whatever its ratio:
    the least it needs, and the baseline's of the same ``n_kv_heads``."""
    config = tiny_config(layer_types="gda,diff_v2", **fields)
    baseline = tiny_config("baseline", **{**fields, "attention_options": {}})
    stored = kv_cache_bytes_per_token(config, 2)
    assert stored == ideal_kv_cache_bytes_per_token(config, 2)
    assert stored == ideal_kv_cache_bytes_per_token(baseline, 2)


def test_layout_sizes_and_scale():
    v1 = attention_layout(tiny_config("diff_v1", n_heads=8, n_kv_heads=4, head_dim=16), 0)
    assert (v1.num_heads, v1.num_kv_heads, v1.head_size) == (8, 2, 32)
    assert math.isclose(v1.scale, 16**-0.5)  # the scale of width d, not of the call's 2d
    v2 = attention_layout(tiny_config("diff_v2"), 1)
    assert (v2.num_heads, v2.num_kv_heads, v2.head_size) == (8, 2, 16)
    tp = attention_layout(tiny_config("diff_v1", n_heads=8, n_kv_heads=4), 0, tp_size=2)
    assert (tp.num_heads, tp.num_kv_heads) == (4, 1)


@pytest.mark.parametrize(
    ("attention", "overrides", "tp_size", "message"),
    [
        ("diff_v1", {}, 2, "must divide the 1 DIFF V1 KV groups"),
        ("baseline", {}, 4, "must divide the 2 KV heads"),
        ("baseline", {}, 0, "must divide"),
        ("diff_v2", {"v2_paired_heads": False}, 2, "unpaired DIFF V2 ablation"),
    ],
)
def test_tensor_parallel_sizes_that_split_a_group_are_refused(
    attention, overrides, tp_size, message
):
    with pytest.raises(ValueError, match=message):
        attention_layout(tiny_config(attention, **overrides), 0, tp_size=tp_size)


def test_a_mixed_stack_is_refused_by_the_layer_that_splits():
    config = tiny_config(layer_types="baseline,diff_v1", n_kv_heads=2)
    attention_layout(config, 0, tp_size=2)
    with pytest.raises(ValueError, match="must divide the 1 DIFF V1 KV groups"):
        attention_layouts(config, tp_size=2)


class Unserved(Baseline):
    """The baseline's computation under another name, with no ``vllm_reason`` of its own:
    not inherited, so vLLM refuses it."""

    name = "unserved_toy"
    module = BaselineAttention


@pytest.fixture
def unserved():
    register_attention_type(Unserved())
    yield "unserved_toy"
    unregister_attention_type("unserved_toy")


def test_a_type_without_a_vllm_layout_is_refused_with_its_reason(unserved):
    from diffattn.vllm_plugin import unservable_reason

    assert Unserved.vllm_reason == AttentionType.vllm_reason is not None
    config = tiny_config(layer_types=f"baseline,{unserved}")
    reason = (
        f"vLLM cannot serve attention type {unserved!r}: no vLLM attention layout is declared "
        "for this type"
    )
    assert unservable_reason(config) == reason  # before vLLM is imported: it is not needed
    attention_layout(config, 0)
    with pytest.raises(ValueError) as error:
        attention_layout(config, 1)
    assert str(error.value) == reason


class FakeBackend:
    @staticmethod
    def get_name():
        return "CPU_ATTN"

    @staticmethod
    def get_supported_head_sizes():
        return [32, 64]

    @classmethod
    def supports_head_size(cls, size):
        return size in cls.get_supported_head_sizes()


def test_head_size_problem_names_the_width_the_call_runs_at():
    mixed = tiny_config(layer_types="diff_v1,baseline")  # d = 16: DIFF V1's call runs at 32
    layouts = attention_layouts(mixed)
    assert head_size_problem(mixed, 0, layouts[0], FakeBackend) is None
    problem = head_size_problem(mixed, 1, layouts[1], FakeBackend)
    assert problem == (
        "vLLM's CPU_ATTN attention backend cannot serve the baseline attention of this model: "
        "its attention heads have width head_dim = 16, and the backend supports head sizes "
        "32, 64"
    )
