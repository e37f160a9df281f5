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
