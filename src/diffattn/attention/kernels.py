"""The one backend switch: every softmax-attention call in diffattn goes through here.

Backends (``ModelConfig.backend``):

``reference``
    Explicit ``softmax(QKᵀ/√d + mask) V`` in fp32 with the probability maps returned, so the
    attention modules can hand out A1, A2, λ and the differential map. Slow, obviously right.
``sdpa``
    ``torch.nn.functional.scaled_dot_product_attention`` with native GQA. It never builds an
    N×N tensor in Python for the common cases: no padding uses ``is_causal``; contiguous
    padding (left or right) is turned into right padding by a per-row roll, which is exact for
    real tokens. Only a mask with holes, or chunked prefill (N > 1 queries against a longer
    cache), falls back to an explicit boolean mask.
``flash``
    The ``flash-attn`` package on CUDA (fp16/bf16); padding uses its var-len kernel. A clear
    ``RuntimeError`` is raised when it is unavailable.
``auto``
    ``flash`` when usable for the inputs, else ``sdpa``.

Masking rule, identical on every backend: query ``i`` (at absolute position ``i + offset`` in
the key sequence) may read key ``j`` iff ``j <= i + offset`` and (key ``j`` is a real token or
``j == i + offset``). The second clause keeps fully padded query rows finite; real tokens never
read padding, so their outputs equal those of the unpadded sequence.

GQA rule: query head ``m`` reads key/value head ``m // (Hq / Hkv)``.

Future fused kernels (a single-pass DIFF V1 kernel, decode kernels) plug in here and nowhere
else: :func:`softmax_attention` and :func:`differential_attention` are the entry points that the
attention modules call.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionMask",
    "differential_attention",
    "flash_available",
    "reference_attention",
    "resolve_backend",
    "softmax_attention",
]


@dataclass
class AttentionMask:
    """Which keys each query may read.

    Attributes:
        key_padding: ``(B, S)`` bool, ``True`` for real tokens; ``None`` if nothing is padded.
        query_offset: absolute position of the first query in the key sequence (``S - N`` when
            the keys include a cache; 0 for a plain forward).
    """

    key_padding: torch.Tensor | None = None
    query_offset: int = 0

    def dense(self, n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
        """Boolean ``(B or 1, 1, N, S)`` tensor of allowed (query, key) pairs."""
        q_pos = torch.arange(n_queries, device=device)[:, None] + self.query_offset
        k_pos = torch.arange(n_keys, device=device)[None, :]
        causal = k_pos <= q_pos
        if self.key_padding is None:
            return causal[None, None]
        real = self.key_padding[:, None, None, :].to(device=device, dtype=torch.bool)
        diagonal = (k_pos == q_pos)[None, None]
        return causal[None, None] & (real | diagonal)


def flash_available() -> bool:
    """True when CUDA is present and the ``flash_attn`` package can be imported."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """Turn ``auto`` into a concrete backend for tensors like ``q``; check ``flash``."""
    if backend == "auto":
        usable = flash_available() and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        return "flash" if usable else "sdpa"
    if backend == "flash":
        if not flash_available():
            raise RuntimeError(
                "backend='flash' needs CUDA and the flash-attn package "
                "(pip install 'diffattn[flash]'); use backend='sdpa' or 'auto' instead"
            )
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(
                f"backend='flash' runs on CUDA in fp16/bf16, got device={q.device} "
                f"dtype={q.dtype}; use torch.autocast or backend='sdpa'"
            )
        return "flash"
    if backend in ("reference", "sdpa"):
        return backend
    raise ValueError(f"unknown attention backend {backend!r}")


# --------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------
def _expand_kv(x: torch.Tensor, n_query_heads: int) -> torch.Tensor:
    """Repeat KV heads so query head m reads KV head m // (Hq / Hkv)."""
    rep = n_query_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit softmax attention; returns ``(output, probabilities)``.

    Shapes: q ``(B, Hq, N, d)``, k ``(B, Hkv, S, d)``, v ``(B, Hkv, S, dv)``; the maps have
    shape ``(B, Hq, N, S)`` and are fp32.
    """
    k = _expand_kv(k, q.shape[1])
    v = _expand_kv(v, q.shape[1])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    allowed = mask.dense(q.shape[2], k.shape[2], q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float()).to(q.dtype)
    return out, probs


# --------------------------------------------------------------------------------------
# sdpa
# --------------------------------------------------------------------------------------
def _padding_kind(key_padding: torch.Tensor) -> str:
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


def _roll_rows(x: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
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
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
    return out[..., :dv]


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """Softmax attention through PyTorch SDPA (see the module docstring for masking)."""
    n, s = q.shape[2], k.shape[2]
    if isinstance(mask.query_offset, torch.Tensor):
        # Fixed-shape decoding (a compiled static-cache step): one dense mask, no host reads.
        return _sdpa(q, k, v, scale, attn_mask=mask.dense(n, s, q.device))
    kind = "none" if mask.key_padding is None else _padding_kind(mask.key_padding)
    full_square = n == s and mask.query_offset == 0
    if kind in ("none", "right") and full_square:
        # Right padding: real tokens come first, so causal attention never reads a pad.
        return _sdpa(q, k, v, scale, is_causal=True)
    if kind == "none" and n == 1 and mask.query_offset == s - 1:
        return _sdpa(q, k, v, scale)  # one decode step reads every cached key
    if kind == "left" and full_square:
        # Roll each row so its real tokens come first, attend causally, roll back.
        n_pad = (~mask.key_padding.bool()).sum(dim=1)
        out = _sdpa(
            _roll_rows(q, n_pad), _roll_rows(k, n_pad), _roll_rows(v, n_pad), scale, is_causal=True
        )
        return _roll_rows(out, (n - n_pad) % n)
    return _sdpa(q, k, v, scale, attn_mask=mask.dense(n, s, q.device))


# --------------------------------------------------------------------------------------
# flash-attn
# --------------------------------------------------------------------------------------
def _flash_call(q, k, v, mask: AttentionMask, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    bsz, _, n, _ = q.shape
    s = k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # flash wants (B, N, H, d)
    # flash-attn aligns causal masks bottom-right, which matches query_offset = S - N.
    if mask.key_padding is None or bool(mask.key_padding.all()):
        if mask.query_offset not in (0, s - n):
            raise RuntimeError("flash backend needs query_offset == S - N")
        out = flash_attn_func(qt, kt, vt, causal=True, softmax_scale=scale)
        return out.transpose(1, 2)
    kind = _padding_kind(mask.key_padding)
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
    return out.transpose(1, 2)


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


# --------------------------------------------------------------------------------------
# entry points used by the attention modules
# --------------------------------------------------------------------------------------
def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    backend: str,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention on the chosen backend; ``need_weights`` forces ``reference``.

    Returns ``(output (B, Hq, N, dv), probabilities (B, Hq, N, S) or None)``.
    """
    if need_weights:
        return reference_attention(q, k, v, mask, scale)
    chosen = resolve_backend(backend, q)
    if chosen == "reference":
        return reference_attention(q, k, v, mask, scale)[0], None
    if chosen == "flash":
        return flash_attention(q, k, v, mask, scale), None
    return sdpa_attention(q, k, v, mask, scale), None


def differential_attention(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    backend: str,
    need_weights: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """DIFF V1 Eq.1: ``(softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d)) V`` per head.

    Shapes: q1, q2 ``(B, H, N, d)``; k1, k2 ``(B, Hkv, S, d)``; v ``(B, Hkv, S, 2d)``; ``lam``
    a scalar tensor. Each softmax map is taken once against the full 2d-wide V (App. A's
    FlashDiffAttn_1 form); fused kernels see Q and K zero-padded to 2d (see
    :func:`match_head_widths`). Returns the output ``(B, H, N, 2d)`` and, with
    ``need_weights``, the maps ``(A1, A2)``.
    """
    o1, a1 = softmax_attention(q1, k1, v, mask, scale, backend, need_weights)
    o2, a2 = softmax_attention(q2, k2, v, mask, scale, backend, need_weights)
    out = o1 - lam.to(o1.dtype) * o2
    return out, ((a1, a2) if need_weights else None)
