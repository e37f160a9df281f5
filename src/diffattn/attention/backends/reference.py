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
