"""The layouts that put each attention type on one stock paged-attention call (vLLM's), checked
without vLLM: one plain causal GQA softmax call over the layout's heads, then the combine step,
equals diffattn's own attention module, for every type, GQA and MHA, odd lengths and the
ablations; and the cache it implies is the least the model needs."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn import DiffTransformerLM
from diffattn.attention.common import project_qkv
from diffattn.attention.mask import AttentionMask
from diffattn.vllm_plugin.layout import (
    attention_layout,
    head_size_problem,
    ideal_kv_cache_bytes_per_token,
    v1_combine,
    v1_padded_queries,
    v2_combine,
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


def through_layout(attn, x, rope):
    """One layer's attention output by the vLLM layout (``DiffAttnAttention.forward``'s
    arithmetic, with :func:`stock_attention` in place of vLLM's kernel)."""
    config = attn.config
    layout = attention_layout(config)
    d = config.dim_per_head
    if config.attention == "diff_v1":
        q, k, v = project_qkv(attn, x, rope, None, 2 * d)
        queries = v1_padded_queries(token_major(q), d)
        out = stock_attention(queries, token_major(k), token_major(v), layout)
        norm = attn.head_norm
        out = v1_combine(
            out,
            attn.lambda_full(),
            d,
            None if norm is None else norm.weight,
            None if norm is None else norm.eps,
            attn.lambda_init,
        )
    else:
        q, k, v = project_qkv(attn, x, rope, None, d)
        out = stock_attention(token_major(q), token_major(k), token_major(v), layout)
        if config.attention == "diff_v2":
            out = v2_combine(out, v2_lambda(attn, x), d, config.v2_paired_heads)
    return attn.o_proj(out)


def v2_lambda(attn, x):
    if attn.lambda_proj is None:
        return None
    lam = attn.lambda_proj(x[0])
    return torch.sigmoid(lam) if attn.config.v2_lambda_sigmoid else lam


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
]


@pytest.mark.parametrize("length", [1, 7, 129])
@pytest.mark.parametrize(("attention", "overrides"), CASES)
def test_layout_equals_diffattn_attention(attention, overrides, length):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny_config(attention, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():  # λ vectors and norms away from their init values
            p.add_(0.05 * torch.randn_like(p))
        attn = model.layers[1].attn
        x = torch.randn(1, length, model.config.d_model)
        rope = model.rotary(torch.arange(length)[None])
        expected, _ = attn(x, rope, AttentionMask(query_offset=0))
        got = through_layout(attn, x, rope)
    torch.testing.assert_close(got, expected[0], rtol=TOL, atol=TOL)


def test_v1_padded_queries_put_each_map_on_its_key_half():
    q = torch.arange(2 * 2 * 2 * 3, dtype=torch.float32).view(2, 2 * 2 * 3)  # T=2, H=2, d=3
    padded = v1_padded_queries(q, 3).view(2, 4, 6)
    pairs = q.view(2, 2, 2, 3)
    assert torch.equal(padded[:, 0::2, :3], pairs[:, :, 0])
    assert torch.equal(padded[:, 1::2, 3:], pairs[:, :, 1])
    assert not padded[:, 0::2, 3:].any() and not padded[:, 1::2, :3].any()


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
@pytest.mark.parametrize("n_kv_heads", [2, 4])
def test_cache_is_the_least_the_model_needs_and_the_baselines(attention, n_kv_heads):
    config = tiny_config(attention, n_kv_heads=n_kv_heads)
    baseline = tiny_config("baseline", n_kv_heads=n_kv_heads)
    for element_bytes in (2, 4):
        stored = attention_layout(config).kv_cache_bytes_per_token(config.n_layers, element_bytes)
        assert stored == ideal_kv_cache_bytes_per_token(config, element_bytes)
        assert stored == ideal_kv_cache_bytes_per_token(baseline, element_bytes)


def test_layout_sizes_and_scale():
    v1 = attention_layout(tiny_config("diff_v1", n_heads=8, n_kv_heads=4, head_dim=16))
    assert (v1.num_heads, v1.num_kv_heads, v1.head_size) == (8, 2, 32)
    assert math.isclose(v1.scale, 16**-0.5)  # the scale of width d, not of the call's 2d
    v2 = attention_layout(tiny_config("diff_v2"))
    assert (v2.num_heads, v2.num_kv_heads, v2.head_size) == (8, 2, 16)
    tp = attention_layout(tiny_config("diff_v1", n_heads=8, n_kv_heads=4), tp_size=2)
    assert (tp.num_heads, tp.num_kv_heads) == (4, 1)


@pytest.mark.parametrize(
    ("attention", "tp_size", "message"),
    [
        ("diff_v1", 2, "must divide the 1 DIFF V1 KV groups"),
        ("baseline", 4, "must divide the 2 KV heads"),
        ("baseline", 0, "must divide"),
    ],
)
def test_tensor_parallel_sizes_that_split_a_group_are_refused(attention, tp_size, message):
    with pytest.raises(ValueError, match=message):
        attention_layout(tiny_config(attention), tp_size=tp_size)


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
    v1 = tiny_config("diff_v1")  # d = 16: the call runs at 32
    assert head_size_problem(v1, attention_layout(v1), FakeBackend) is None
    base = tiny_config("baseline")
    problem = head_size_problem(base, attention_layout(base), FakeBackend)
    assert problem == (
        "vLLM's CPU_ATTN attention backend cannot serve this baseline model: its attention "
        "heads have width head_dim = 16, and the backend supports head sizes 32, 64"
    )
