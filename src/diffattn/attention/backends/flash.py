"""``flash``: the ``flash-attn`` package on CUDA (fp16/bf16); padding and documents packed in a
row use its var-len kernel (each document one sequence of ``cu_seqlens``)."""

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
        return None if n == s and mask.query_offset == 0 else "documents after cached tokens"
    if isinstance(mask.query_offset, torch.Tensor):
        return "a tensor query offset (static cache): flash aligns causal masks to the end"
    if mask.key_padding is None:
        return None if mask.query_offset in (0, s - n) else "query_offset != S - N"
    if n != s and n != 1:
        return "padding with N queries against S > N keys"
    kind = padding_kind(mask.key_padding)
    return None if kind in ("none", "left", "right") else f"{kind} padding"


def _flash_call(q, k, v, mask: AttentionMask, scale: float) -> torch.Tensor:
    bsz, _, n, _ = q.shape
    s = k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # flash wants (B, N, H, d)
    # flash-attn aligns causal masks bottom-right, which matches query_offset = S - N.
    if mask.allowed is not None:
        raise RuntimeError("flash backend takes causal, padding and document masks, not 4-D masks")
    if mask.document_ids is not None:
        return _flash_documents(qt, kt, vt, v, mask, scale)
    if mask.key_padding is None or bool(mask.key_padding.all()):
        if mask.query_offset not in (0, s - n):
            raise RuntimeError("flash backend needs query_offset == S - N")
        from flash_attn import flash_attn_func

        out = flash_attn_func(qt, kt, vt, causal=True, softmax_scale=scale)
        return out.transpose(1, 2)
    kind = padding_kind(mask.key_padding)
    if kind not in ("left", "right") or (n != s and n != 1):
        raise RuntimeError("flash backend supports left or right padding only")
    from flash_attn import flash_attn_varlen_func

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


def document_sequences(document_ids: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, longest)`` of the real tokens of a ``(B, N)`` batch read row by row, one
    sequence per run of equal document id (a row's end also ends a sequence): the var-len
    kernel's view of documents packed in rows."""
    ids = document_ids.to(real.device)[real]
    rows = torch.arange(len(real), device=real.device)[:, None].expand_as(real)[real]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = (ids[1:] != ids[:-1]) | (rows[1:] != rows[:-1])
    first = torch.nonzero(starts).flatten()
    total = torch.tensor([len(ids)], device=ids.device)
    bounds = torch.cat([first, total]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max()) if len(ids) else 0


def _flash_documents(qt, kt, vt, v, mask: AttentionMask, scale: float) -> torch.Tensor:
    """Documents packed in rows: every real token of the batch in one var-len call, each
    document its own causal sequence (padding rows read themselves, as the mask rule says)."""
    from flash_attn import flash_attn_varlen_func

    bsz, n = qt.shape[:2]
    if kt.shape[1] != n or mask.query_offset != 0:
        raise RuntimeError("flash backend takes packed documents without cached tokens only")
    real = (
        torch.ones(bsz, n, dtype=torch.bool, device=qt.device)
        if mask.key_padding is None
        else mask.key_padding.to(device=qt.device, dtype=torch.bool)
    )
    cu, longest = document_sequences(mask.document_ids, real)
    packed = flash_attn_varlen_func(
        qt[real], kt[real], vt[real], cu, cu, longest, longest, causal=True, softmax_scale=scale
    )
    out = qt.new_zeros(bsz, n, qt.shape[2], vt.shape[-1])
    out[real] = packed
    out = out.transpose(1, 2)
    return out if mask.key_padding is None else read_self_on_padding(out, v, mask)


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
        document_masks=True,
        description="flash-attn 2 on CUDA in fp16/bf16 (var-len for padding and documents)",
    )
)
