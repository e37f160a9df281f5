"""Decode steps: SDPA's one-query GQA path against the reference kernel, and the static-cache
decode step compiled with ``torch.compile(fullgraph=True)`` against eager."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from diffattn.attention.backends.reference import reference_attention
from diffattn.attention.backends.sdpa import sdpa_attention
from diffattn.attention.mask import AttentionMask
from diffattn.cache import StaticCache
from diffattn.generation import decode_step
from helpers import tiny_diffattn

TYPES = ["baseline", "diff_v1", "diff_v2"]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("keys", [1, 7, 129])
@pytest.mark.parametrize(("n_q", "n_kv"), [(4, 2), (8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("width", [(16, 16), (16, 32)])
@pytest.mark.parametrize("masking", ["offset", "tensor_offset", "padding"])
def test_one_query_sdpa_matches_reference_with_gradients(keys, n_q, n_kv, width, masking):
    """A decode step (one query against S cached keys) under GQA: SDPA folds each group's query
    heads into rows of one call; outputs and gradients equal the reference in fp32. Value
    width 2d is DIFF V1's (Q and K zero-padded)."""
    torch.manual_seed(keys * 100 + n_q)
    d, dv = width
    q = torch.randn(2, n_q, 1, d, requires_grad=True)
    k = torch.randn(2, n_kv, keys, d, requires_grad=True)
    v = torch.randn(2, n_kv, keys, dv, requires_grad=True)
    if masking == "offset":
        mask = AttentionMask(query_offset=keys - 1)
    elif masking == "tensor_offset":  # the static cache: a device-side slot, keys past it unused
        mask = AttentionMask(query_offset=torch.tensor(max(keys - 3, 0)))
    else:
        padding = torch.ones(2, keys, dtype=torch.bool)
        padding[1, : keys // 2] = False
        mask = AttentionMask(key_padding=padding, query_offset=keys - 1)
    got = sdpa_attention(q, k, v, mask, d**-0.5)
    want = reference_attention(q, k, v, mask, d**-0.5)[0]
    assert got.shape == (2, n_q, 1, dv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(want)
    grads = torch.autograd.grad((got * upstream).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((want * upstream).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):  # (one key: K gets a zero gradient)
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def _decode_twice(attention, backend, compile_backend, steps=3):
    """Decode ``steps`` tokens after a left-padded prompt, compiled (fullgraph) and eager, into
    two static caches; returns the worst relative logit difference and the compiled step."""
    torch._dynamo.reset()
    model = tiny_diffattn(attention, backend=backend, max_seq_len=32)
    bsz, prompt = 2, 5
    length = prompt + steps
    ids = torch.randint(0, model.config.vocab_size, (bsz, length))
    mask = torch.ones(bsz, length, dtype=torch.long)
    mask[1, :2] = 0
    caches = [StaticCache(model.config, bsz, length) for _ in range(2)]
    step = torch.compile(decode_step, fullgraph=True, backend=compile_backend)
    worst = 0.0
    with torch.no_grad():
        for cache in caches:
            decode_step(model, cache, ids[:, :prompt], mask, torch.arange(prompt))
        for slot in range(prompt, length):
            args = (ids[:, slot : slot + 1], mask, torch.tensor([slot]))
            got = step(model, caches[0], *args)
            want = decode_step(model, caches[1], *args)
            worst = max(worst, _rel(got, want))
    assert torch.equal(caches[0].keys[0], caches[1].keys[0])
    return worst


@pytest.mark.parametrize("attention", TYPES)
def test_static_decode_step_is_one_graph(attention):
    """On the default CPU backend (sdpa; the reference kernels are checked in
    test_generation.py): ``fullgraph=True`` raises on any graph break, and Dynamo's graph, run
    eagerly, equals eager."""
    assert _decode_twice(attention, "sdpa", "eager") <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("attention", TYPES)
def test_static_decode_step_compiles_with_inductor(attention):
    """The real compiler on CPU (tens of seconds per type): same logits up to rounding."""
    assert _decode_twice(attention, "sdpa", "inductor") <= 1e-4
