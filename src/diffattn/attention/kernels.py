"""The entry points every attention module calls; they dispatch through the kernel registry.

* :func:`softmax_attention`: ``softmax(QKᵀ·scale + mask) V`` (baseline; V2's inner call).
* :func:`differential_attention`: DIFF V1 Eq.1.
* :func:`differential_attention_v2`: DIFF V2's attention plus its λ-weighted pair subtraction.

Each takes the backend *name* chosen at run time (``DiffTransformerLM.set_backend``) and the
layer index. A layer watched by an installed observer (:mod:`diffattn.attention.observe`, used
by ``output_attentions`` and :mod:`diffattn.probe`) runs the observed reference computation;
every other call goes to the backend's entry point, or to one composed from its ``softmax`` when
the backend has no fused kernel for it (see :mod:`diffattn.attention.registry`).

Backends, the masking rule and the GQA rule are described in :mod:`diffattn.attention.registry`,
:mod:`diffattn.attention.mask` and the modules of :mod:`diffattn.attention.backends`.
"""

from __future__ import annotations

import torch

from diffattn.attention import auto, observe
from diffattn.attention.backends.flash import flash_attention, flash_available
from diffattn.attention.backends.reference import reference_attention
from diffattn.attention.backends.sdpa import match_head_widths, sdpa_attention
from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import (
    backend_names,
    compose_v1,
    compose_v2,
    get_backend,
    log_once,
    register_backend,
    resolve_backend,
)

__all__ = [
    "AttentionMask",
    "backend_names",
    "differential_attention",
    "differential_attention_v2",
    "flash_attention",
    "flash_available",
    "match_head_widths",
    "reference_attention",
    "register_backend",
    "resolve_backend",
    "sdpa_attention",
    "softmax_attention",
]


def _backend_for(name: str, entry: str, tensors: tuple, k: torch.Tensor, mask: AttentionMask):
    """The backend a call runs on: ``auto`` resolved for this call (:mod:`.auto`), or the
    named one (custom masks go to ``sdpa`` when it takes none)."""
    if name == "auto":
        call = auto.Call.of(entry, tensors, mask)
        return get_backend(auto.choose(call, tensors[0], k, mask))
    chosen = get_backend(resolve_backend(name, tensors[0]))
    if mask.allowed is not None and not chosen.custom_masks:
        log_once(chosen.name, "custom_masks", "takes no 4-D masks; sdpa runs those calls")
        return get_backend("sdpa")
    return chosen


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    backend: str,
    need_weights: bool = False,
    layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention on ``backend``; ``need_weights`` runs ``reference`` and returns the
    maps. Returns ``(output (B, Hq, N, dv), probabilities (B, Hq, N, S) or None)``."""
    if need_weights:
        return reference_attention(q, k, v, mask, scale)
    observers = observe.observers_for(layer)
    if observers:
        call = observe.ObservedCall("softmax", layer, mask, scale, observers)
        return observe.observed_softmax(call, q, k, v), None
    return _backend_for(backend, "softmax", (q, k, v), k, mask).softmax(q, k, v, mask, scale), None


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
    layer: int | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """DIFF V1 Eq.1: ``(softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d)) V`` per head.

    Shapes: q1, q2 ``(B, H, N, d)``; k1, k2 ``(B, Hkv, S, d)``; v ``(B, Hkv, S, 2d)``; ``lam``
    a scalar tensor. Returns the output ``(B, H, N, 2d)`` and, with ``need_weights``, the maps
    ``(A1, A2)`` of the reference kernel.
    """
    if need_weights:
        o1, a1 = reference_attention(q1, k1, v, mask, scale)
        o2, a2 = reference_attention(q2, k2, v, mask, scale)
        return o1 - lam.to(o1.dtype) * o2, (a1, a2)
    observers = observe.observers_for(layer)
    if observers:
        call = observe.ObservedCall("diff_v1", layer, mask, scale, observers)
        return observe.observed_diff_v1(call, q1, q2, k1, k2, v, lam), None
    chosen = _backend_for(backend, "diff_v1", (q1, q2, k1, k2, v, lam), k1, mask)
    if chosen.diff_v1 is not None:
        return chosen.diff_v1(q1, q2, k1, k2, v, lam, mask, scale), None
    log_once(chosen.name, "diff_v1", "no DIFF V1 entry point; composing two softmax calls")
    return compose_v1(chosen.softmax)(q1, q2, k1, k2, v, lam, mask, scale), None


def differential_attention_v2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor | None,
    mask: AttentionMask,
    scale: float,
    backend: str,
    paired: bool = True,
    layer: int | None = None,
) -> torch.Tensor:
    """DIFF V2: softmax attention over the 2h query heads, then ``o1 − λ·o2`` per head pair.

    Shapes: q ``(B, 2h, N, d)``; k, v ``(B, Hkv, S, d)``; ``lam`` ``(B, h, N, 1)`` or ``None``
    (the no-λ ablation: ``o1 − o2``). Pairs are ``(2i, 2i+1)`` (``paired``, one GQA group) or
    ``(i, i+h)``. Returns ``(B, h, N, d)``.
    """
    observers = observe.observers_for(layer)
    if observers:
        call = observe.ObservedCall("diff_v2", layer, mask, scale, observers)
        return observe.observed_diff_v2(call, q, k, v, lam, paired)
    tensors = (q, k, v) if lam is None else (q, k, v, lam)
    chosen = _backend_for(backend, "diff_v2", tensors, k, mask)
    if chosen.diff_v2 is not None:
        return chosen.diff_v2(q, k, v, lam, mask, scale, paired)
    log_once(chosen.name, "diff_v2", "no DIFF V2 entry point; composing it from softmax")
    return compose_v2(chosen.softmax)(q, k, v, lam, mask, scale, paired)
