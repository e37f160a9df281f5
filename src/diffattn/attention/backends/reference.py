"""``reference``: explicit ``softmax(QKᵀ/√d + mask) V`` in fp32. Slow, obviously right, and the
kernel behind every map the model hands out (``output_attentions``, the capture probe)."""

from __future__ import annotations

import torch

from diffattn.attention.mask import AttentionMask, expand_kv
from diffattn.attention.registry import Backend, register_backend


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit softmax attention; returns ``(output, probabilities)``.

    Shapes: q ``(B, Hq, N, d)``, k ``(B, Hkv, S, d)``, v ``(B, Hkv, S, dv)``; the maps have
    shape ``(B, Hq, N, S)`` and are fp32.
    """
    k = expand_kv(k, q.shape[1])
    v = expand_kv(v, q.shape[1])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    allowed = mask.dense(q.shape[2], k.shape[2], q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float()).to(q.dtype)
    return out, probs


def differential_rows(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    mask: AttentionMask,
    scale: float,
) -> torch.Tensor:
    """DIFF V1 Eq.1 as ``(P1 − λ·P2) V`` with explicit fp32 maps ``(B, H, N, S)``: each map's
    QKᵀ at width d and one product with V for both maps (V read once).

    Shapes as :func:`diffattn.attention.kernels.differential_attention`; GQA by grouping the
    query heads of a KV group, so K and V are never repeated. Plain autograd ops, traceable
    with a tensor ``query_offset``; the kernel of one-token decode steps, where the maps are
    ``(B, H, 1, S)``.
    """
    bsz, h, n, d = q1.shape
    n_kv, s = k1.shape[1], k1.shape[2]
    rep = h // n_kv
    allowed = mask.dense(n, s, q1.device)[:, :, None]  # (B|1, 1, 1, N, S)

    def probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        # the group's query heads as rows of one (rep·N) × S product per KV head: a plain
        # batched matmul against K's transposed view (a broadcast matmul would copy K)
        rows = q.float().reshape(bsz, n_kv, rep * n, d) * scale
        scores = torch.matmul(rows, k.float().transpose(-1, -2))
        scores = scores.view(bsz, n_kv, rep, n, s).masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, dim=-1)

    p = probs(q1, k1) - lam.float() * probs(q2, k2)
    out = torch.matmul(p.view(bsz, n_kv, rep * n, s), v.float())
    return out.view(bsz, h, n, v.shape[-1]).to(q1.dtype)


def _softmax(q, k, v, mask, scale):
    return reference_attention(q, k, v, mask, scale)[0]


register_backend(
    Backend.from_softmax(
        "reference",
        _softmax,
        hf_name="eager",
        description="explicit fp32 softmax(QKᵀ/√d)V; builds the N×N map; for checks and maps",
    )
)
