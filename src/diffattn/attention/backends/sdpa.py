"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with native GQA.

It never builds an N×N tensor in Python for the common cases: no padding uses ``is_causal``;
contiguous padding (left or right) is turned into right padding by a per-row roll, which is
exact for real tokens. Only a mask with holes, chunked prefill (N > 1 queries against a longer
cache) or fixed-shape decoding falls back to an explicit boolean mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffattn.attention.backends.reference import differential_rows
from diffattn.attention.mask import AttentionMask, read_self_on_padding
from diffattn.attention.registry import Backend, compose_v1, compose_v2, register_backend


def padding_kind(key_padding: torch.Tensor) -> str:
    """``none``, ``right``, ``left`` or ``holes`` for a ``(B, S)`` bool padding mask."""
    kp = key_padding.to(torch.int8)
    if bool(kp.all()):
        return "none"
    steps = kp[:, 1:] - kp[:, :-1]
    if bool((steps <= 0).all()):
        return "right"
    if bool((steps >= 0).all()):
        return "left"
    return "holes"


def roll_rows(x: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Roll each batch row of ``x`` ``(B, H, N, d)`` left by ``shifts[b]`` along N."""
    n = x.shape[2]
    index = (torch.arange(n, device=x.device)[None, :] + shifts[:, None]) % n
    index = index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return torch.gather(x, 2, index)


def match_head_widths(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad q and k to V's width (or V to q's) so fused kernels accept the call.

    Exact: zero channels add nothing to QKᵀ, and the caller passes the scale explicitly.
    DIFF V1's value width is 2d; fused CPU SDPA and flash-attn need equal widths, and without
    this PyTorch falls back to its math kernel, which materialises the N×N map. The price is
    QKᵀ at width 2d (the FLOPs of App. A's split-V two-call form) with a single softmax.
    """
    dq, dv = q.shape[-1], v.shape[-1]
    if dv > dq:
        return F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq)), v
    if dq > dv:
        return q, k, F.pad(v, (0, dq - dv))
    return q, k, v


def _sdpa(q, k, v, scale, *, is_causal=False, attn_mask=None):
    dv = v.shape[-1]
    q, k, v = match_head_widths(q, k, v)
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.shape[2] == 1 and not is_causal:
        return _one_query_per_group(q, k, v, scale, attn_mask)[..., :dv]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
    return out[..., :dv]


def _one_query_per_group(q, k, v, scale, attn_mask):
    """One query token (a decode step) under GQA: the ``G = Hq / Hkv`` query heads that share a
    KV head become ``G`` query rows against it, so each KV head is read once per step instead
    of once per query head (SDPA's CPU kernels loop over query heads). Exact: every row keeps
    its own softmax, and the mask, ``(B or 1, 1, 1, S)`` here, is the same for all of them.
    This is what keeps DIFF V2 (twice the query heads, the baseline's KV heads) at the
    baseline's decode cost."""
    bsz, n_q, _, width = q.shape
    n_kv = k.shape[1]
    rows = q.reshape(bsz, n_kv, n_q // n_kv, width)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=attn_mask, scale=scale)
    return out.reshape(bsz, n_q, 1, out.shape[-1])


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """Softmax attention through PyTorch SDPA (see the module docstring for masking)."""
    n, s = q.shape[2], k.shape[2]
    dense = (
        isinstance(mask.query_offset, torch.Tensor)  # fixed-shape (compiled) decoding
        or mask.allowed is not None  # a full custom mask
        or (mask.key_padding is not None and torch.compiler.is_compiling())  # no host reads
    )
    if dense:
        return _sdpa(q, k, v, scale, attn_mask=mask.dense(n, s, q.device))
    kind = "none" if mask.key_padding is None else padding_kind(mask.key_padding)
    full_square = n == s and mask.query_offset == 0
    if kind == "none" and full_square:
        return _sdpa(q, k, v, scale, is_causal=True)
    if kind == "right" and full_square:
        # Real tokens come first, so causal attention never reads a pad; pad rows read
        # themselves, as the masking rule says.
        return read_self_on_padding(_sdpa(q, k, v, scale, is_causal=True), v, mask)
    if kind == "none" and n == 1 and mask.query_offset == s - 1:
        return _sdpa(q, k, v, scale)  # one decode step reads every cached key
    if kind == "left" and full_square:
        # Roll each row so its real tokens come first, attend causally, roll back.
        n_pad = (~mask.key_padding.bool()).sum(dim=1)
        out = _sdpa(
            roll_rows(q, n_pad), roll_rows(k, n_pad), roll_rows(v, n_pad), scale, is_causal=True
        )
        return read_self_on_padding(roll_rows(out, (n - n_pad) % n), v, mask)
    return _sdpa(q, k, v, scale, attn_mask=mask.dense(n, s, q.device))


_two_sdpa_calls = compose_v1(sdpa_attention)


def sdpa_diff_v1(q1, q2, k1, k2, v, lam, mask: AttentionMask, scale: float) -> torch.Tensor:
    """DIFF V1 Eq.1: two SDPA calls (Q and K zero-padded to V's 2d width), except for one-query
    calls (decode steps), which read V once: :func:`differential_rows`."""
    if q1.shape[2] == 1:
        return differential_rows(q1, q2, k1, k2, v, lam, mask, scale)
    return _two_sdpa_calls(q1, q2, k1, k2, v, lam, mask, scale)


register_backend(
    Backend(
        "sdpa",
        sdpa_attention,
        diff_v1=sdpa_diff_v1,
        diff_v2=compose_v2(sdpa_attention),
        hf_name="sdpa",
        description="PyTorch scaled_dot_product_attention (fused CPU/CUDA kernels, GQA)",
    )
)
