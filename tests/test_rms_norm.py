"""RMSNorm's hand-written backward (``diffattn.layers._RMSNormFunction``) against autograd
through the plain ops (``rms_norm_reference``): outputs and gradients of ``x`` and the weight,
odd shapes, with and without a weight, bf16, activation checkpointing, compile, and the memory
it holds for backward."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from diffattn.layers import RMSNorm, _RMSNormFunction, rms_norm, rms_norm_reference
from diffattn.model import DiffTransformerLM
from helpers import TINY_VOCAB, tiny_config


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _pair(shape, weighted: bool, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(dtype) if weighted else None
    grad = torch.randn(shape, generator=g).to(dtype)
    return x, w, grad


def _grads(fn, x, w, grad, eps=1e-5):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True) if w is not None else None
    y = fn(x, w, eps)
    y.backward(grad)
    return y.detach(), x.grad, (w.grad if w is not None else None)


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 7, 16), (1, 3, 129, 128), (129, 33)])
@pytest.mark.parametrize("weighted", [True, False])
def test_outputs_and_gradients_equal_autograd_fp32(shape, weighted):
    x, w, grad = _pair(shape, weighted)
    y, gx, gw = _grads(rms_norm, x, w, grad)
    y_ref, gx_ref, gw_ref = _grads(rms_norm_reference, x, w, grad)
    assert torch.equal(y, y_ref)  # the forward runs the same ops
    assert _rel(gx, gx_ref) < 1e-6
    if weighted:
        assert _rel(gw, gw_ref) < 1e-6


def test_gradients_match_float64_autograd():
    """Both fp32 forms are checked against autograd in float64 (no cast)."""
    x, w, grad = _pair((3, 9, 64), True, seed=4)

    def exact(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    _, gx64, gw64 = _grads(exact, x.double(), w.double(), grad.double())
    _, gx, gw = _grads(rms_norm, x, w, grad)
    assert _rel(gx, gx64) < 2e-6 and _rel(gw, gw64) < 2e-6


def test_bf16_matches_reference_within_bf16_rounding():
    x, w, grad = _pair((2, 33, 96), True, dtype=torch.bfloat16, seed=2)
    y, gx, gw = _grads(rms_norm, x, w, grad)
    y_ref, gx_ref, gw_ref = _grads(rms_norm_reference, x, w, grad)
    assert y.dtype == gx.dtype == gw.dtype == torch.bfloat16
    assert torch.equal(y, y_ref)
    assert _rel(gx, gx_ref) < 1e-2 and _rel(gw, gw_ref) < 1e-2


def test_only_the_needed_gradients_and_the_plain_path_without_grad():
    x, w, grad = _pair((2, 5, 32), True)
    frozen_w = w.clone()  # no grad: the weight's gradient is not computed
    xr = x.clone().requires_grad_(True)
    rms_norm(xr, frozen_w, 1e-5).backward(grad)
    _, gx_ref, _ = _grads(rms_norm_reference, x, w, grad)
    assert _rel(xr.grad, gx_ref) < 1e-6
    wr = w.clone().requires_grad_(True)  # grad for the weight only
    rms_norm(x, wr, 1e-5).backward(grad)
    _, _, gw_ref = _grads(rms_norm_reference, x, w, grad)
    assert _rel(wr.grad, gw_ref) < 1e-6
    with torch.no_grad():
        out = rms_norm(x, w, 1e-5)
    assert out.grad_fn is None and torch.equal(out, rms_norm_reference(x, w, 1e-5))


def _saved_bytes(fn, x, w) -> int:
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() != x.data_ptr() and (w is None or t.data_ptr() != w.data_ptr()):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w, 1e-5)
    return total


def test_saves_one_value_per_row_beyond_its_inputs():
    x = torch.randn(2, 129, 256, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    rows = 2 * 129
    assert _saved_bytes(rms_norm, x, w) == rows * 4  # r only
    assert _saved_bytes(rms_norm_reference, x, w) >= x.numel() * 4  # x̂ too


def test_activation_checkpointing_reads_saved_tensors_once():
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    x, _, grad = _pair((2, 7, 64), False)
    x1 = x.clone().requires_grad_(True)
    torch.utils.checkpoint.checkpoint(norm, x1, use_reentrant=False).backward(grad)
    x2 = x.clone().requires_grad_(True)
    y = rms_norm_reference(x2, norm.weight, norm.eps)
    gw = torch.autograd.grad(y, norm.weight, grad, retain_graph=True)[0]
    y.backward(grad)
    assert _rel(x1.grad, x2.grad) < 1e-6
    assert _rel(norm.weight.grad, gw + gw) < 1e-6  # two backward passes accumulated


def test_compiles_with_fullgraph():
    # earlier compiles of rms_norm in this process (other tests' models, other shapes) may have
    # used up dynamo's recompile limit for its frame; a fresh cache makes this test stand alone
    torch._dynamo.reset()
    x, w, grad = _pair((2, 7, 32), True)
    compiled = torch.compile(rms_norm, fullgraph=True, backend="aot_eager")
    _, gx, gw = _grads(compiled, x, w, grad)
    _, gx_ref, gw_ref = _grads(rms_norm_reference, x, w, grad)
    assert _rel(gx, gx_ref) < 1e-6 and _rel(gw, gw_ref) < 1e-6


def test_model_gradients_as_accurate_as_autograds(monkeypatch):
    """A whole DIFF V1 model (pre-norms and the per-head norm of Eq.3), fp32: every parameter's
    gradient with the hand-written backward is as close to a float64 run as autograd's through
    the plain ops is. (λ's gradient is a small difference of large terms, since the head norm
    cancels λ's scale up to eps: its fp32 rounding is ~1e-4 relative on either path.)"""
    import diffattn.layers as layers

    config = tiny_config("diff_v1", backend="reference")
    ids = torch.randint(0, TINY_VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))

    def grads(dtype=torch.float32):
        torch.manual_seed(0)
        model = DiffTransformerLM(config).to(dtype)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = grads()
    monkeypatch.setattr(layers, "rms_norm", layers.rms_norm_reference)
    plain = grads()

    def exact_norm(x, w, eps):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * w if w is not None else y

    monkeypatch.setattr(layers, "rms_norm", exact_norm)
    exact = grads(torch.float64)
    assert ours.keys() == plain.keys() == exact.keys()
    for name in ours:
        err_ours, err_plain = _rel(ours[name], exact[name]), _rel(plain[name], exact[name])
        assert err_ours <= 2 * err_plain + 1e-6, (name, err_ours, err_plain)
        assert _rel(ours[name], plain[name]) < (1e-3 if "lambda" in name else 1e-5), name


def test_function_is_what_runs_under_grad():
    x = torch.randn(3, 8, requires_grad=True)
    y = rms_norm(x, None, 1e-5)
    assert type(y.grad_fn).__name__ == _RMSNormFunction.__name__ + "Backward"
