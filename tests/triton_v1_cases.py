"""Cases of the ``triton`` DIFF V1 kernels against the reference backend: outputs and gradients
of q1, q2, k1, k2, v and λ. Run by ``test_triton_v1.py`` in a process with
``TRITON_INTERPRET=1`` (CPU, numpy) and, where there is a GPU, on CUDA; not collected alone."""

from __future__ import annotations

import os

import pytest
import torch

from diffattn.attention import kernels
from diffattn.attention.mask import AttentionMask
from test_fused_v1 import _assert_matches_reference, _inputs, _padding, _rel

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
D = 16  # the smallest head width tl.dot takes on a GPU

SHAPES = [
    (1, "none", 1),
    *[(7, padding, gqa) for padding in ("none", "left", "right", "holes") for gqa in (1, 2)],
    (129, "none", 1),
    (129, "left", 2),
    (129, "holes", 1),
]


def _on_device(inputs):
    return tuple(x.detach().to(DEVICE).requires_grad_() for x in inputs)


def _mask(key_padding, offset=0):
    kp = None if key_padding is None else key_padding.to(DEVICE)
    return AttentionMask(key_padding=kp, query_offset=offset)


@pytest.mark.parametrize(("n", "padding", "gqa"), SHAPES)
def test_triton_matches_reference(n, padding, gqa):
    bsz, kv_heads = (1, 1) if n > 64 else (2, 2)  # the interpreter is slow: fewer heads
    inputs = _on_device(_inputs(bsz, kv_heads * gqa, kv_heads, n, n, d=D))
    _assert_matches_reference(inputs, _mask(_padding(padding, bsz, n)), backend="triton")


@pytest.mark.parametrize("n_new", [1, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_triton_with_a_cache_offset_matches_reference(n_new, padded):
    s = 21
    key_padding = _padding("left", 2, s) if padded else None
    inputs = _on_device(_inputs(2, 4, 2, n_new, s, d=D))
    _assert_matches_reference(inputs, _mask(key_padding, s - n_new), backend="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision_is_close(dtype):
    inputs = _on_device(_inputs(2, 4, 2, 33, 33, dtype=dtype, d=D))
    mask = _mask(_padding("left", 2, 33))
    ref, _ = kernels.differential_attention(*inputs, mask, D**-0.5, "reference")
    out, _ = kernels.differential_attention(*inputs, mask, D**-0.5, "triton")
    assert out.dtype == dtype
    assert _rel(out, ref) <= 2e-2
    grads = torch.autograd.grad(out.float().sum(), inputs)
    grads_ref = torch.autograd.grad(ref.float().sum(), inputs)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == g_ref.dtype and torch.isfinite(g).all()
        assert _rel(g, g_ref) <= 5e-2
