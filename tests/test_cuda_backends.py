"""Every registered backend against attention computed in float64: outputs and gradients of the
three entry points (``softmax``: the baseline, ``diff_v1``: DIFF V1 Eq.1, ``diff_v2``: DIFF V2's
attention and pair subtraction) over odd lengths, left and right padding, GQA and cache offsets.

The CUDA cases (marked ``gpu``) are the parity suite of the GPU check: every backend usable on
CUDA (``sdpa``, ``auto``, ``fused``, ``flash`` and ``triton`` where installed, ``reference``) at
head widths 64 and 128, fp32 and bf16, N = 1, 7, 129 and 4097. The same test function runs a
small CPU subset in the default suite, so the test logic itself is checked without a GPU.

The float64 oracle is written out here (explicit maps, the masking rule of
:meth:`AttentionMask.dense`), independent of every backend, ``reference`` included. A backend
the GPU refuses at run time for a case still has to give the right result (the call runs on
``auto``'s next choice); the case is then reported as skipped with the refusal.
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

from diffattn.attention import auto, kernels
from diffattn.attention.backends import sdpa
from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import backend_names, get_backend
from test_kernels import _padding

ENTRIES = ("softmax", "diff_v1", "diff_v2")
CUDA_BACKENDS = ("sdpa", "auto", "fused", "flash", "triton", "reference")
CPU_BACKENDS = ("sdpa", "auto", "fused", "reference")
KV_HEADS = 2
LAMBDA = 0.37
TOLERANCE = {
    ("cpu", torch.float32): (1e-5, 1e-5, 1e-5),
    ("cuda", torch.float32): (1e-4, 1e-4, 1e-4),  # fp32 sums in a different order over 4097 keys
    ("cpu", torch.bfloat16): (2e-2, 5e-2, 0.1),
    ("cuda", torch.bfloat16): (2e-2, 5e-2, 0.1),
}
"""(output, gradient, λ's gradient) tolerance: max |error| over the largest reference value, per
tensor; λ's gradient over the op's gradient scale, as a sum over every output whose terms
cancel. In bf16, over 200 random draws of the CPU case (N = 7, left padding, GQA) DIFF V1's
reached 0.084 on ``sdpa`` and 0.080 on ``reference`` (median 0.003), 0.048 on ``fused``."""

CUDA_SHAPES = [
    *[(1, 1, "none", gqa) for gqa in (1, 2)],
    *[(n, n, pad, gqa) for n in (7, 129) for pad in ("none", "left", "right") for gqa in (1, 2)],
    (4097, 4097, "none", 2),
    (4097, 4097, "left", 1),
    *[(n_new, 40, pad, gqa) for n_new, gqa in ((1, 2), (5, 1)) for pad in ("none", "left")],
]
"""(queries N, keys S, padding, query heads per KV head); S > N puts the queries at the end of
a cache: decode (N = 1) and chunked prefill."""
CPU_SHAPES = [(1, 1, "none", 1), (7, 7, "left", 2), (5, 20, "right", 2)]


def _cases():
    """The CUDA grid, then the CPU subset; the backend varies fastest, so that consecutive
    cases share one float64 oracle (:func:`_expected`)."""
    gpu = pytest.mark.gpu
    for entry in ENTRIES:
        for dtype in (torch.float32, torch.bfloat16):
            for d in (64, 128):
                for shape in CUDA_SHAPES:
                    for backend in CUDA_BACKENDS:
                        yield _param("cuda", entry, backend, dtype, d, *shape, marks=gpu)
    for entry in ENTRIES:
        cpu_cases = [(torch.float32, shape) for shape in CPU_SHAPES]
        for dtype, shape in [*cpu_cases, (torch.bfloat16, CPU_SHAPES[1])]:
            for backend in CPU_BACKENDS:
                yield _param("cpu", entry, backend, dtype, 64, *shape)


def _param(device, entry, backend, dtype, d, n, s, padding, gqa, marks=()):
    """A case with a readable id: ``cuda-diff_v1-sdpa-bf16-d128-N129-S129-left-gqa2``."""
    dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    name = f"{device}-{entry}-{backend}-{dtype_name}-d{d}-N{n}-S{s}-{padding}-gqa{gqa}"
    values = (device, entry, backend, dtype, d, n, s, padding, gqa)
    return pytest.param(*values, marks=marks, id=name)


def _shapes(entry: str, bsz: int, n: int, s: int, d: int, gqa: int) -> list[tuple[int, ...]]:
    """The input shapes of ``entry``, λ last where it has one."""
    heads = KV_HEADS * gqa
    q, kv = (bsz, heads, n, d), (bsz, KV_HEADS, s, d)
    if entry == "softmax":
        return [q, kv, kv]
    if entry == "diff_v1":  # q1, q2, k1, k2, V of width 2d, a 0-d λ
        return [q, q, kv, kv, (bsz, KV_HEADS, s, 2 * d), ()]
    return [(bsz, 2 * heads, n, d), kv, kv, (bsz, heads, n, 1)]  # DIFF V2: 2h query heads


def _inputs(entry, device, dtype, bsz, n, s, d, gqa) -> list[torch.Tensor]:
    """Leaves on ``device``: random in ``dtype`` (DIFF V1's λ in fp32, as the model keeps
    it), seeded by the case."""
    case = repr((entry, bsz, n, s, d, gqa)).encode()
    generator = torch.Generator().manual_seed(zlib.crc32(case))  # hash() of a str varies by run
    tensors = []
    for shape in _shapes(entry, bsz, n, s, d, gqa):
        if shape == ():
            x = torch.tensor(LAMBDA)
        elif len(shape) == 4 and shape[-1] == 1:  # DIFF V2's λ per token, in (0, 1)
            x = torch.rand(shape, generator=generator, dtype=torch.float64).to(dtype)
        else:
            x = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
        tensors.append(x.to(device).requires_grad_())
    return tensors


def _softmax64(q, k, v, mask: AttentionMask, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = mask.dense(q.shape[2], k.shape[2], q.device)
    return torch.matmul(scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _oracle(entry: str, tensors, mask: AttentionMask, scale: float) -> torch.Tensor:
    """The entry point's attention in float64, written out."""
    if entry == "softmax":
        return _softmax64(*tensors, mask, scale)
    if entry == "diff_v1":
        q1, q2, k1, k2, v, lam = tensors
        return _softmax64(q1, k1, v, mask, scale) - lam * _softmax64(q2, k2, v, mask, scale)
    q, k, v, lam = tensors
    out = _softmax64(q, k, v, mask, scale)
    return out[:, 0::2] - lam * out[:, 1::2]  # pairs (2i, 2i + 1)


def _under_test(entry: str, tensors, mask: AttentionMask, scale: float, backend: str):
    if entry == "softmax":
        return kernels.softmax_attention(*tensors, mask, scale, backend)[0]
    if entry == "diff_v1":
        return kernels.differential_attention(*tensors, mask, scale, backend)[0]
    return kernels.differential_attention_v2(*tensors, mask, scale, backend, paired=True)


def _case_mask(device, bsz, n, s, padding) -> AttentionMask:
    key_padding = _padding(padding, bsz, s)
    if key_padding is not None:
        key_padding = key_padding.to(device)
    return AttentionMask(key_padding=key_padding, query_offset=s - n)


@functools.lru_cache(maxsize=4)
def _expected(device, entry, dtype, d, n, s, padding, gqa):
    """The oracle's output and gradients for a case (shared by the backends)."""
    bsz = 1 if n > 1000 else 2
    tensors = _inputs(entry, device, dtype, bsz, n, s, d, gqa)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    mask = _case_mask(device, bsz, n, s, padding)
    out = _oracle(entry, exact, mask, d**-0.5)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(n), dtype=out.dtype)
    weight = weight.to(device)
    grads = torch.autograd.grad((out * weight).sum(), exact)
    return tensors, mask, weight, out.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    return float((a.detach().double() - b).abs().max()) / max(scale, 1e-300)


@pytest.mark.parametrize(
    ("device", "entry", "backend", "dtype", "d", "n", "s", "padding", "gqa"), list(_cases())
)
def test_backend_matches_float64_attention(device, entry, backend, dtype, d, n, s, padding, gqa):
    if backend not in backend_names():
        pytest.skip(f"backend {backend!r} is not registered here")
    if backend != "auto":
        why = get_backend(backend).why_unusable(torch.empty(0, device=device, dtype=dtype))
        if why is not None:
            pytest.skip(f"{backend}: {why}")
    tensors, mask, weight, expected, grads_expected = _expected(
        device, entry, dtype, d, n, s, padding, gqa
    )
    tensors = [t.detach().requires_grad_() for t in tensors]
    out = _under_test(entry, tensors, mask, d**-0.5, backend)
    grads = torch.autograd.grad((out.double() * weight).sum(), tensors)

    out_tol, grad_tol, lambda_tol = TOLERANCE[(device, dtype)]
    assert out.dtype == dtype and out.shape == expected.shape
    assert _rel(out, expected, float(expected.abs().max())) <= out_tol
    grad_scale = max(float(g.abs().max()) for g in grads_expected)
    for i, (g, g_exact) in enumerate(zip(grads, grads_expected, strict=True)):
        assert g.dtype == tensors[i].dtype and torch.isfinite(g).all(), i
        # λ's gradient (a sum over every output that can cancel) and an exactly-zero one (one
        # key: the softmax is constant) are judged on the op's gradient scale.
        own = float(g_exact.abs().max())
        is_lambda = entry != "softmax" and i == len(tensors) - 1
        tol = lambda_tol if is_lambda else grad_tol
        assert _rel(g, g_exact, grad_scale if is_lambda or own == 0 else own) <= tol, i
    with torch.enable_grad():
        call = auto.Call.of(entry, tuple(tensors), mask)
    refused = auto.refused(call).get(backend)
    if refused is not None:
        pytest.skip(f"exact, but {backend!r} was refused by the GPU: {refused}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("training", [False, True])
def test_sdpa_runs_diff_v1_at_native_widths_on_cudnn(d, training):
    """Reports whether cuDNN takes DIFF V1's native-width calls on this GPU and torch (the
    route the H200 measurement chose); where it refuses, the calls run zero-padded."""
    tensors = [t.cuda() for t in _inputs("diff_v1", "cpu", torch.bfloat16, 2, 256, 256, d, 2)]
    with torch.set_grad_enabled(training):
        route = sdpa.diff_v1_route(tensors[0], tensors[2], tensors[4], AttentionMask())
        out = sdpa.sdpa_diff_v1(*tensors, AttentionMask(), d**-0.5)
        if training:
            out.float().sum().backward()
    torch.cuda.synchronize()
    refused = sdpa._cudnn_refused.get(
        sdpa._call_kind(tensors[0], tensors[2], tensors[4], AttentionMask())
    )
    if refused is not None:
        pytest.skip(f"cuDNN refused the native-width route here: {refused}")
    assert "native widths on cuDNN" in route
