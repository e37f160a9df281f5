"""``flash``: the ``flash-attn`` package on CUDA (fp16/bf16); padding uses its var-len kernel."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from diffattn.attention.backends.sdpa import match_head_widths, padding_kind
from diffattn.attention.mask import AttentionMask, read_self_on_padding
from diffattn.attention.registry import Backend, register_backend


def flash_available() -> bool:
    """True when CUDA is present and the ``flash_attn`` package can be imported."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def _unusable(q: torch.Tensor) -> str | None:
    if not flash_available():
        return (
            "needs CUDA and the flash-attn package (pip install 'diffattn[flash]'); "
            "use backend='sdpa' or 'auto' instead"
        )
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return (
            f"runs on CUDA in fp16/bf16, got device={q.device} dtype={q.dtype}; "
            "use torch.autocast or backend='sdpa'"
        )
    return None


def _accepts(q: torch.Tensor, k: torch.Tensor, mask: AttentionMask) -> str | None:
    """Why flash-attn does not take this call (``auto`` then runs it on ``sdpa``)."""
    n, s = q.shape[2], k.shape[2]
    if mask.allowed is not None:
        return "a full 4-D mask"
    if mask.document_ids is not None:
        return "documents packed in a row"
    if isinstance(mask.query_offset, torch.Tensor):
        return "a tensor query offset (static cache): flash aligns causal masks to the end"
    if mask.key_padding is None:
        return None if mask.query_offset in (0, s - n) else "query_offset != S - N"
    if n != s and n != 1:
        return "padding with N queries against S > N keys"
    kind = padding_kind(mask.key_padding)
    return None if kind in ("none", "left", "right") else f"{kind} padding"


def _flash_call(q, k, v, mask: AttentionMask, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    bsz, _, n, _ = q.shape
    s = k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # flash wants (B, N, H, d)
    # flash-attn aligns causal masks bottom-right, which matches query_offset = S - N.
    if mask.custom:
        raise RuntimeError(
            "flash backend takes causal and padding masks only, not 4-D masks or packed documents"
        )
    if mask.key_padding is None or bool(mask.key_padding.all()):
        if mask.query_offset not in (0, s - n):
            raise RuntimeError("flash backend needs query_offset == S - N")
        out = flash_attn_func(qt, kt, vt, causal=True, softmax_scale=scale)
        return out.transpose(1, 2)
    kind = padding_kind(mask.key_padding)
    if kind not in ("left", "right") or (n != s and n != 1):
        raise RuntimeError("flash backend supports left or right padding only")
    real = mask.key_padding.bool()
    k_lens = real.sum(dim=1, dtype=torch.int32)
    q_real = real if n == s else torch.ones(bsz, 1, dtype=torch.bool, device=q.device)
    q_lens = q_real.sum(dim=1, dtype=torch.int32)
    cu_k = F.pad(torch.cumsum(k_lens, 0, dtype=torch.int32), (1, 0))
    cu_q = F.pad(torch.cumsum(q_lens, 0, dtype=torch.int32), (1, 0))
    out_packed = flash_attn_varlen_func(
        qt[q_real],
        kt[real],
        vt[real],
        cu_q,
        cu_k,
        int(q_lens.max()),
        int(k_lens.max()),
        causal=True,
        softmax_scale=scale,
    )
    out = qt.new_zeros(bsz, n, q.shape[1], v.shape[-1])
    out[q_real] = out_packed
    return read_self_on_padding(out.transpose(1, 2), v, mask)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """flash-attn with GQA; unequal query and value widths are handled by
    :func:`match_head_widths` up to flash-attn's head-width limit of 256, beyond it by
    splitting V into query-width chunks (one call each)."""
    dv = v.shape[-1]
    if dv > 256 and dv > q.shape[-1]:
        chunks = [_flash_call(q, k, part, mask, scale) for part in v.split(q.shape[-1], -1)]
        return torch.cat(chunks, dim=-1)
    return _flash_call(*match_head_widths(q, k, v), mask, scale)[..., :dv]


register_backend(
    Backend.from_softmax(
        "flash",
        flash_attention,
        unusable=_unusable,
        accepts=_accepts,
        hf_name="flash_attention_2",
        custom_masks=False,
        description="flash-attn 2 on CUDA in fp16/bf16 (var-len for padding)",
    )
)
