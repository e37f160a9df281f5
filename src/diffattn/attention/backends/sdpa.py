"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with native GQA.

It never builds an N×N tensor in Python for the common cases: no padding uses ``is_causal``;
contiguous padding (left or right) is turned into right padding by a per-row roll, which is
exact for real tokens. Only a mask with holes, chunked prefill (N > 1 queries against a longer
cache) or fixed-shape decoding falls back to an explicit boolean mask.

DIFF V1 (Eq.1, value width 2d) takes one of three routes (:func:`sdpa_diff_v1`):

* one query (a decode step): :func:`differential_rows`, V read once for both maps;
* CUDA, eager: :func:`native_width_diff_v1` restricted to cuDNN attention, two SDPA calls with
  Q/K at width d and V at 2d (the FLOPs of App. A's FlashDiffAttn_1, without padding). PyTorch
  would otherwise serve these shapes on its memory-efficient kernel, which measured 0.07–0.2 of
  the baseline's attention on an H200 against cuDNN's 0.42–0.66 (``docs/performance.md``);
* everything else, and CUDA calls cuDNN refuses: two calls with Q and K zero-padded to 2d
  (:func:`match_head_widths`), which fused kernels take everywhere. The CPU keeps this route:
  its flash kernel needs equal widths, and the math kernel that takes unequal ones builds the
  N×N map.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffattn.attention.backends.reference import differential_rows
from diffattn.attention.mask import AttentionMask, read_self_on_padding
from diffattn.attention.registry import (
    Backend,
    compose_v1,
    compose_v2,
    gpu_refusal,
    log_once,
    register_backend,
)


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


def heads_differ(query_heads, key_heads) -> bool:
    """Whether SDPA must group query heads over fewer KV heads (``enable_gqa``), as a Python
    bool even when a head count is symbolic (an export with dynamic shapes, where a static
    cache's buffers come in as inputs): then ``True`` unless the two are known equal, which is
    exact either way (grouping over equal counts repeats each KV head once)."""
    if isinstance(query_heads, int) and isinstance(key_heads, int):
        return query_heads != key_heads
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return not statically_known_true(query_heads == key_heads)


def _sdpa_call(q, k, v, scale, *, is_causal=False, attn_mask=None, pad_widths=True):
    dv = v.shape[-1]
    if pad_widths:
        q, k, v = match_head_widths(q, k, v)
    gqa = heads_differ(q.shape[1], k.shape[1])
    if gqa and isinstance(q.shape[2], int) and q.shape[2] == 1 and not is_causal:
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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    *,
    pad_widths: bool = True,
) -> torch.Tensor:
    """Softmax attention through PyTorch SDPA (see the module docstring for masking).

    ``pad_widths``: zero-pad Q and K to V's width when it differs (:func:`match_head_widths`);
    ``False`` passes the tensors at their own widths (:func:`native_width_diff_v1`)."""
    n, s = q.shape[2], k.shape[2]
    _sdpa = functools.partial(_sdpa_call, pad_widths=pad_widths)
    dense = (
        isinstance(mask.query_offset, torch.Tensor)  # fixed-shape (compiled) decoding
        or mask.custom  # a full custom mask, or documents packed in a row
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


_two_padded_calls = compose_v1(sdpa_attention)


def native_width_diff_v1(q1, q2, k1, k2, v, lam, mask: AttentionMask, scale: float) -> torch.Tensor:
    """DIFF V1 Eq.1 as two SDPA calls at the tensors' own widths: ``softmax(Q1K1ᵀ)·V −
    λ·softmax(Q2K2ᵀ)·V`` with Q/K at d and V at 2d (App. A's FlashDiffAttn_1 form, no zero
    padding: 12·M·d forward FLOPs per differential head against the padded form's 16·M·d).

    Runs on whatever kernel SDPA picks for unequal widths: cuDNN when :func:`sdpa_diff_v1`
    restricts it so on CUDA, the math kernel on the CPU (where it is tested against
    ``reference``). Shapes and masking as :func:`sdpa_attention`."""
    o1 = sdpa_attention(q1, k1, v, mask, scale, pad_widths=False)
    o2 = sdpa_attention(q2, k2, v, mask, scale, pad_widths=False)
    return o1 - lam.to(o1.dtype) * o2


def wants_native_widths(q: torch.Tensor) -> bool:
    """Whether DIFF V1 tries the native-width cuDNN route: eager CUDA calls. The CPU keeps
    the padded route (measured best there); calls traced by ``torch.compile`` keep it too
    (the native route was measured eager only, and its fallback catches run-time errors)."""
    return q.is_cuda and not torch.compiler.is_compiling()


def cudnn_unavailable(q: torch.Tensor) -> str | None:
    """Why cuDNN attention cannot take calls like ``q`` here, known before trying one."""
    if not torch.backends.cudnn.is_available():
        return "this PyTorch has no cuDNN"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN attention is switched off (torch.backends.cuda.enable_cudnn_sdp)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return (
            f"cuDNN attention takes fp16 and bf16 only, got {str(q.dtype).removeprefix('torch.')}"
        )
    return None


def only_cudnn():
    """A context in which SDPA runs on cuDNN or raises (never on another kernel)."""
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


_cudnn_refused: dict[tuple, str] = {}
"""Kinds of DIFF V1 call cuDNN refused at run time, with the reason: not tried again."""
_cudnn_accepted: set[tuple] = set()
"""Kinds of DIFF V1 call cuDNN ran: later ones run without capturing warnings (the capture,
``warnings.catch_warnings``, is process-wide and costs every call)."""


def _call_kind(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, mask: AttentionMask):
    """What cuDNN's acceptance depends on: dtype, widths, training, GQA, masking."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q1, k1, v))
    masked = mask.key_padding is not None or mask.custom
    return (
        str(q1.dtype).removeprefix("torch."),
        q1.shape[-1],
        v.shape[-1],
        "training" if grad else "inference",
        "GQA" if q1.shape[1] != k1.shape[1] else "MHA",
        "padded" if masked else "unpadded",
        "with a cache" if q1.shape[2] != k1.shape[2] else "square",
    )


def _cudnn_reasons(messages: list[str]) -> list[str]:
    """PyTorch's reasons for not running cuDNN attention, from the warnings it gives when no
    allowed kernel takes a call: those after its "cuDNN attention kernel not used because"."""
    heads = [i for i, m in enumerate(messages) if "cudnn" in m.lower() and "not used" in m]
    return messages[heads[-1] + 1 :] if heads else []


def _on_cudnn(q1, q2, k1, k2, v, lam, mask: AttentionMask, scale: float) -> torch.Tensor | None:
    """:func:`native_width_diff_v1` on cuDNN, or ``None`` (one warning per kind of call)
    where cuDNN is missing or refuses the call; other errors propagate."""
    kind = _call_kind(q1, k1, v, mask)
    if kind in _cudnn_accepted:  # the hot path: no process-wide warnings capture
        try:
            with only_cudnn():
                return native_width_diff_v1(q1, q2, k1, k2, v, lam, mask, scale)
        except RuntimeError as error:
            if gpu_refusal(error) is None:
                raise
            _cudnn_accepted.discard(kind)  # asked again below, its reasons captured
    if kind in _cudnn_refused:
        return None
    reason = cudnn_unavailable(q1)
    if reason is None:
        try:
            with warnings.catch_warnings(record=True) as caught, only_cudnn():
                warnings.simplefilter("always")
                out = native_width_diff_v1(q1, q2, k1, k2, v, lam, mask, scale)
        except RuntimeError as error:
            reason = gpu_refusal(error)
            if reason is None:
                raise
            reason = "; ".join([reason, *_cudnn_reasons([str(w.message) for w in caught])])
        else:
            for w in caught:  # nothing expected on success; never swallowed
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            _cudnn_accepted.add(kind)
            return out
    _cudnn_refused[kind] = reason
    log_once(
        "sdpa",
        f"diff_v1 cuDNN {kind}",
        f"cuDNN attention does not take DIFF V1's native-width calls "
        f"({', '.join(map(str, kind))}): {reason}. These calls run as two SDPA calls with Q "
        "and K zero-padded to V's width.",
    )
    return None


def sdpa_diff_v1(q1, q2, k1, k2, v, lam, mask: AttentionMask, scale: float) -> torch.Tensor:
    """DIFF V1 Eq.1 on SDPA, by the route the module docstring gives for the call: one query
    :func:`differential_rows`; CUDA :func:`native_width_diff_v1` on cuDNN; else (and where
    cuDNN refuses) two calls with Q and K zero-padded to V's 2d width."""
    if q1.shape[2] == 1:
        return differential_rows(q1, q2, k1, k2, v, lam, mask, scale)
    if wants_native_widths(q1):
        out = _on_cudnn(q1, q2, k1, k2, v, lam, mask, scale)
        if out is not None:
            return out
    return _two_padded_calls(q1, q2, k1, k2, v, lam, mask, scale)


def diff_v1_route(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> str:
    """Which route :func:`sdpa_diff_v1` takes for such a call, as far as is known before
    running it (for ``diffattn backends``)."""
    if q1.shape[2] == 1:
        return "differential_rows (one query, V read once)"
    if not wants_native_widths(q1):
        return "two calls, Q/K zero-padded to V's width"
    refused = _cudnn_refused.get(_call_kind(q1, k1, v, mask))
    reason = cudnn_unavailable(q1) if refused is None else refused
    if reason is not None:
        return f"two calls, Q/K zero-padded to V's width ({reason})"
    return "two calls at native widths on cuDNN (zero-padded if cuDNN refuses)"


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
