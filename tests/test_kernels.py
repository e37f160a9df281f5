"""The backend switch: every fast path against the explicit reference, outputs and grads."""

from __future__ import annotations

import pytest
import torch

from diffattn.attention import kernels
from diffattn.attention.kernels import AttentionMask


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """max|a − b| / max|b|, or over ``scale`` when given (the op's gradient scale: a
    one-token softmax has an exactly-zero query gradient, where rounding noise is all)."""
    a, b = a.detach(), b.detach()
    denominator = float(b.abs().max()) if scale is None else scale
    return float((a - b).abs().max()) / max(denominator, 1e-12)


def _padding(kind: str, bsz: int, n: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.ones(bsz, n, dtype=torch.bool)
    if kind == "left":
        mask[0, : min(3, n - 1)] = False
        mask[-1, :1] = False
    elif kind == "right":
        mask[0, max(1, n - 3) :] = False
    elif kind == "holes":
        mask[0, 1::3] = False
    return mask


def _real_query_rows(key_padding, n, offset):
    if key_padding is None:
        return torch.ones(1, 1, n, 1, dtype=torch.bool)
    return key_padding[:, offset : offset + n][:, None, :, None]


SHAPES = [(1, "none")] + [
    (n, padding) for n in (7, 64, 129) for padding in ("none", "left", "right", "holes")
]


@pytest.mark.parametrize(("n", "padding"), SHAPES)
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("dv_mult", [1, 2])
def test_sdpa_matches_reference(n, gqa, padding, dv_mult):
    bsz, hkv, d = 2, 2, 8
    q = torch.randn(bsz, hkv * gqa, n, d, requires_grad=True)
    k = torch.randn(bsz, hkv, n, d, requires_grad=True)
    v = torch.randn(bsz, hkv, n, d * dv_mult, requires_grad=True)
    mask = AttentionMask(key_padding=_padding(padding, bsz, n))
    real = _real_query_rows(mask.key_padding, n, 0).float()
    weight = torch.randn(bsz, hkv * gqa, n, d * dv_mult) * real

    ref, _ = kernels.reference_attention(q, k, v, mask, d**-0.5)
    grads_ref = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    fast = kernels.sdpa_attention(q, k, v, mask, d**-0.5)
    grads = torch.autograd.grad((fast * weight).sum(), (q, k, v))

    assert _rel(fast * real, ref * real) <= 1e-5
    grad_scale = max(float(g.abs().max()) for g in grads_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert torch.isfinite(g).all()
        ref_max = float(g_ref.abs().max())
        # An exactly-zero reference (one key: softmax is constant) is judged on the op's scale.
        assert _rel(g, g_ref, ref_max if ref_max > 0 else grad_scale) <= 1e-5


@pytest.mark.parametrize("n_new", [1, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_with_query_offset_matches_reference(n_new, padded):
    """Queries at the end of a longer key sequence (a cache): bottom-right causal masking."""
    bsz, h, s, d = 2, 4, 12, 8
    q = torch.randn(bsz, h, n_new, d)
    k = torch.randn(bsz, 2, s, d)
    v = torch.randn(bsz, 2, s, d)
    key_padding = _padding("left", bsz, s) if padded else None
    mask = AttentionMask(key_padding=key_padding, query_offset=s - n_new)
    ref, probs = kernels.reference_attention(q, k, v, mask, d**-0.5)
    fast = kernels.sdpa_attention(q, k, v, mask, d**-0.5)
    assert _rel(fast, ref) <= 1e-5
    # The last query reads every real key; the first new query reads none of the later ones.
    assert torch.all(probs[..., 0, s - n_new + 1 :] == 0)


def test_reference_maps_are_causal_and_skip_padding():
    mask = AttentionMask(key_padding=_padding("left", 2, 6))
    q, k, v = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    _, probs = kernels.reference_attention(q, k, v, mask, 0.5)
    assert torch.all(probs.triu(1) == 0)
    assert torch.all(probs[0, :, 3:, :3] == 0)  # real queries never read the 3 pads
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 6))


def test_differential_attention_is_eq1():
    q1, q2 = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    k1, k2 = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    v = torch.randn(1, 1, 5, 8)
    lam = torch.tensor(0.3)
    out, (a1, a2) = kernels.differential_attention(
        q1, q2, k1, k2, v, lam, AttentionMask(), 0.5, "sdpa", need_weights=True
    )
    expected = torch.matmul(a1 - lam * a2, v.expand(1, 2, 5, 8))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    fast, maps = kernels.differential_attention(
        q1, q2, k1, k2, v, lam, AttentionMask(), 0.5, "sdpa"
    )
    assert maps is None
    torch.testing.assert_close(fast, out, rtol=1e-5, atol=1e-6)


def test_auto_picks_sdpa_on_cpu_and_flash_fails_clearly():
    q = torch.randn(1, 1, 2, 4)
    assert kernels.resolve_backend("auto", q) == "sdpa"
    with pytest.raises(RuntimeError, match="flash"):
        kernels.resolve_backend("flash", q)
    with pytest.raises(ValueError, match="unknown attention backend"):
        kernels.resolve_backend("magic", q)


# DIFF V1 at native widths (Q/K at d, V at 2d): the route the sdpa backend takes on CUDA,
# forced here on the CPU, where SDPA's math kernel takes unequal widths.


def _diff_v1_inputs(bsz, heads, kv_heads, n, s, d):
    from test_fused_v1 import _inputs

    return _inputs(bsz, heads, kv_heads, n, s, d=d)


def _assert_diff_v1_matches_reference(run, inputs, mask, tol=1e-5):
    """``run(*inputs, mask, scale)`` against ``reference``: output and the grads of q1, q2,
    k1, k2, v and λ, each relative to its largest reference value (dλ and an exactly-zero
    reference, a one-key softmax, relative to the largest gradient)."""
    scale = inputs[0].shape[-1] ** -0.5
    weight = torch.randn(*inputs[0].shape[:3], inputs[4].shape[-1])
    ref, _ = kernels.differential_attention(*inputs, mask, scale, "reference")
    grads_ref = torch.autograd.grad((ref * weight).sum(), inputs)
    out = run(*inputs, mask, scale)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    assert out.shape == ref.shape and _rel(out, ref) <= tol
    grad_scale = max(float(g.abs().max()) for g in grads_ref)
    for name, g, g_ref in zip(("q1", "q2", "k1", "k2", "v", "lam"), grads, grads_ref, strict=True):
        ref_max = float(g_ref.abs().max())
        scale_of = grad_scale if name == "lam" or ref_max == 0 else ref_max
        assert torch.isfinite(g).all() and _rel(g, g_ref, scale_of) <= tol, name


NATIVE_CASES = [(n, n, padding) for n in (1, 7, 129) for padding in ("none", "left", "right")]
CACHE_CASES = [(n_new, 37, padding) for n_new in (1, 5, 20) for padding in ("none", "left")]
"""(queries, keys, padding); with more keys than queries, the queries are the last ones of a
(left-padded) cache: chunked prefill and decode."""


@pytest.mark.parametrize("gqa", [1, 2])
@pytest.mark.parametrize(
    ("n", "s", "padding", "d"),
    [(*case, d) for case in NATIVE_CASES for d in (32, 64, 128)]
    + [(*case, 32) for case in CACHE_CASES],
)
def test_native_width_diff_v1_matches_reference(n, s, padding, d, gqa):
    from diffattn.attention.backends.sdpa import native_width_diff_v1

    inputs = _diff_v1_inputs(2, 2 * gqa, 2, n, s, d)
    mask = AttentionMask(key_padding=_padding(padding, 2, s), query_offset=s - n)
    _assert_diff_v1_matches_reference(native_width_diff_v1, inputs, mask)


def test_native_width_route_passes_q_and_k_unpadded(monkeypatch):
    """Each SDPA call sees Q and K at width d and V at 2d (the padded route: 2d, 2d, 2d)."""
    from diffattn.attention.backends import sdpa

    widths = []
    inner = sdpa.F.scaled_dot_product_attention

    def spy(q, k, v, **options):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return inner(q, k, v, **options)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    inputs = _diff_v1_inputs(1, 2, 1, 7, 7, 16)
    sdpa.native_width_diff_v1(*inputs, AttentionMask(), 0.25)
    assert widths == [(16, 16, 32)] * 2
    widths.clear()
    sdpa.sdpa_diff_v1(*inputs, AttentionMask(), 0.25)
    assert widths == [(32, 32, 32)] * 2


@pytest.fixture
def fresh_cudnn_state():
    """No remembered cuDNN refusals or logged warnings of the sdpa backend, before and after."""
    from diffattn.attention import registry
    from diffattn.attention.backends import sdpa

    def clear():
        sdpa._cudnn_refused.clear()
        sdpa._cudnn_accepted.clear()
        for key in [k for k in registry._logged if k[0] == "sdpa"]:
            registry._logged.discard(key)

    clear()
    yield sdpa
    clear()


def _pretend_cuda(monkeypatch, sdpa, cudnn_reason=None, context=None):
    """The sdpa backend's view of a CUDA machine on CPU tensors: the device check says CUDA,
    cuDNN is present (or ``cudnn_reason`` says why not) and ``context`` replaces the
    restriction to cuDNN (default: the real one, which on the CPU refuses every call)."""
    monkeypatch.setattr(sdpa, "wants_native_widths", lambda q: True)
    monkeypatch.setattr(sdpa, "cudnn_unavailable", lambda q: cudnn_reason)
    if context is not None:
        monkeypatch.setattr(sdpa, "only_cudnn", context)


def _spy_native(monkeypatch, sdpa) -> list:
    calls = []
    inner = sdpa.native_width_diff_v1

    def spy(*args):
        calls.append(args[0].shape)
        return inner(*args)

    monkeypatch.setattr(sdpa, "native_width_diff_v1", spy)
    return calls


def test_sdpa_diff_v1_takes_the_native_route_on_cuda_and_the_padded_one_on_cpu(
    monkeypatch, fresh_cudnn_state, caplog
):
    import contextlib

    sdpa = fresh_cudnn_state
    calls = _spy_native(monkeypatch, sdpa)
    mask = AttentionMask(key_padding=_padding("left", 2, 9))
    inputs = _diff_v1_inputs(2, 4, 2, 9, 9, 16)
    _assert_diff_v1_matches_reference(sdpa.sdpa_diff_v1, inputs, mask)
    assert not calls  # the CPU: two zero-padded calls
    assert not sdpa.wants_native_widths(inputs[0])

    _pretend_cuda(monkeypatch, sdpa, context=contextlib.nullcontext)
    with caplog.at_level("WARNING", logger="diffattn.kernels"):
        _assert_diff_v1_matches_reference(sdpa.sdpa_diff_v1, inputs, mask)
    assert calls == [inputs[0].shape] and not caplog.records
    one_query = _diff_v1_inputs(2, 4, 2, 1, 9, 16)  # a decode step: differential_rows
    sdpa.sdpa_diff_v1(*one_query, AttentionMask(query_offset=8), 0.25)
    assert len(calls) == 1


def test_only_cudnn_never_runs_another_kernel():
    """Restricted to cuDNN, SDPA refuses what cuDNN cannot run (here: every CPU call) instead
    of serving it on another kernel, and the refusal is recognised as one."""
    from diffattn.attention.backends.sdpa import only_cudnn
    from diffattn.attention.registry import gpu_refusal

    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError) as refused, only_cudnn():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert gpu_refusal(refused.value) is not None


def test_a_cudnn_refusal_falls_back_to_the_padded_route_with_one_warning(
    monkeypatch, fresh_cudnn_state, caplog
):
    sdpa = fresh_cudnn_state
    _pretend_cuda(monkeypatch, sdpa)  # the real restriction: refused on the CPU
    calls = _spy_native(monkeypatch, sdpa)
    inputs = _diff_v1_inputs(2, 2, 1, 7, 7, 16)
    mask = AttentionMask(key_padding=_padding("right", 2, 7))
    with caplog.at_level("WARNING", logger="diffattn.kernels"):
        for _ in range(2):
            _assert_diff_v1_matches_reference(sdpa.sdpa_diff_v1, inputs, mask)
    assert len(calls) == 1  # the refusal is remembered for this kind of call
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "cuDNN" in message and "zero-padded" in message and "RuntimeError" in message


def test_an_accepted_kind_of_call_runs_without_capturing_warnings_and_still_falls_back(
    monkeypatch, fresh_cudnn_state, caplog
):
    """Once cuDNN ran a kind of call, later ones skip the process-wide warnings capture; a
    later refusal of that kind still falls back, exact, with one warning."""
    import contextlib
    import warnings

    sdpa = fresh_cudnn_state
    refuse = []

    @contextlib.contextmanager
    def cudnn_until_told():
        if refuse:
            raise RuntimeError("No available kernel. Aborting execution.")
        yield

    _pretend_cuda(monkeypatch, sdpa, context=cudnn_until_told)
    inputs = _diff_v1_inputs(1, 2, 2, 7, 7, 8)
    _assert_diff_v1_matches_reference(sdpa.sdpa_diff_v1, inputs, AttentionMask())
    assert len(sdpa._cudnn_accepted) == 1

    def no_capture(*args, **kwargs):
        raise AssertionError("warnings captured on the hot path")

    with monkeypatch.context() as m:
        m.setattr(warnings, "catch_warnings", no_capture)
        _assert_diff_v1_matches_reference(sdpa.sdpa_diff_v1, inputs, AttentionMask())

    refuse.append(True)
    with caplog.at_level("WARNING", logger="diffattn.kernels"):
        for _ in range(2):
            _assert_diff_v1_matches_reference(sdpa.sdpa_diff_v1, inputs, AttentionMask())
    assert not sdpa._cudnn_accepted and len(sdpa._cudnn_refused) == 1
    assert len(caplog.records) == 1 and "zero-padded" in caplog.records[0].getMessage()


def test_missing_cudnn_falls_back_with_one_warning_without_trying(
    monkeypatch, fresh_cudnn_state, caplog
):
    sdpa = fresh_cudnn_state
    _pretend_cuda(monkeypatch, sdpa, cudnn_reason="cuDNN attention takes fp16 and bf16 only")
    calls = _spy_native(monkeypatch, sdpa)
    inputs = _diff_v1_inputs(1, 2, 2, 7, 7, 8)
    with caplog.at_level("WARNING", logger="diffattn.kernels"):
        for _ in range(2):
            _assert_diff_v1_matches_reference(sdpa.sdpa_diff_v1, inputs, AttentionMask())
    assert not calls and len(caplog.records) == 1
    assert "fp16 and bf16 only" in caplog.records[0].getMessage()


def test_a_programming_error_on_the_cudnn_route_still_raises(monkeypatch, fresh_cudnn_state):
    sdpa = fresh_cudnn_state
    _pretend_cuda(monkeypatch, sdpa)

    def broken(*args):
        raise RuntimeError("The size of tensor a (7) must match the size of tensor b (8)")

    monkeypatch.setattr(sdpa, "native_width_diff_v1", broken)
    with pytest.raises(RuntimeError, match="must match"):
        sdpa.sdpa_diff_v1(*_diff_v1_inputs(1, 2, 2, 7, 7, 8), AttentionMask(), 0.3)
    assert not sdpa._cudnn_refused


def test_a_cudnn_refusal_names_pytorchs_reasons_for_cudnn_only():
    from diffattn.attention.backends.sdpa import _cudnn_reasons

    messages = [
        "Memory efficient kernel not used because:",
        "Mem efficient attention has been runtime disabled.",
        "Flash attention kernel not used because:",
        "Flash attention has been runtime disabled.",
        "cuDNN attention kernel not used because:",
        "cuDNN SDPA on SM 9.0/10.x does not support backward with these head dimensions.",
    ]
    assert _cudnn_reasons(messages) == [messages[-1]]
    assert _cudnn_reasons(messages[:4]) == []
