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

**A GPU refusing a kernel at run time** (Triton out of shared memory or failing to compile,
cuDNN without an execution plan or SDPA without a kernel: :func:`registry.gpu_refusal`) is
never a crash. The call runs on the next backend ``auto`` would pick for it, with one warning
on the ``diffattn.kernels`` logger naming the backend and the error, and the refusal is
remembered for that kind of call (:class:`auto.Call`), so it is not tried again. An explicitly
named backend is treated the same way: the call runs where ``auto`` would run it, since every
backend computes the same attention, so the result stays exact. Any other error, such as
mismatched shapes, propagates. Calls traced by ``torch.compile`` are not guarded (their kernels
run when the compiled graph does). A refusal raised by a kernel's *backward* surfaces from
``backward()``: the forward has already returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from diffattn.attention import auto, observe
from diffattn.attention.backends.flash import flash_attention, flash_available
from diffattn.attention.backends.reference import reference_attention
from diffattn.attention.backends.sdpa import match_head_widths, sdpa_attention
from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import (
    ENTRY_DIFF,
    ENTRY_DIFF_V2,
    ENTRY_SOFTMAX,
    Backend,
    backend_names,
    compose_v1,
    compose_v2,
    get_backend,
    gpu_refusal,
    log_once,
    register_backend,
    resolve_backend,
)

logger = logging.getLogger("diffattn.kernels")

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
    named one (custom masks and packed documents go to ``sdpa`` when it takes neither)."""
    if name == "auto":
        call = auto.Call.of(entry, tensors, mask)
        return get_backend(auto.choose(call, tensors[0], k, mask))
    chosen = get_backend(resolve_backend(name, tensors[0]))
    takes_it = chosen.custom_masks or (mask.allowed is None and chosen.document_masks)
    if mask.custom and not takes_it:
        log_once(
            chosen.name,
            "custom_masks",
            "takes no 4-D masks or packed documents; sdpa runs those calls",
        )
        return get_backend("sdpa")
    if auto.any_refused():
        call = auto.Call.of(entry, tensors, mask)
        if chosen.name in auto.refused(call):  # warned when the GPU refused it
            return get_backend(auto.choose(call, tensors[0], k, mask))
    return chosen


def _run(
    name: str,
    entry: str,
    tensors: tuple,
    k: torch.Tensor,
    mask: AttentionMask,
    kernel: Callable[[Backend], torch.Tensor],
) -> torch.Tensor:
    """``kernel(backend)`` on the backend the call runs on; a GPU's refusal moves the call
    to the next backend ``auto`` would pick (see the module docstring)."""
    chosen = _backend_for(name, entry, tensors, k, mask)
    if torch.compiler.is_compiling():
        return kernel(chosen)
    while True:
        try:
            return kernel(chosen)
        except Exception as error:
            reason = gpu_refusal(error)
            if reason is None:
                raise
            call = auto.Call.of(entry, tensors, mask)
            auto.refuse(call, chosen.name, reason)
            instead = auto.choose(call, tensors[0], k, mask)
            if instead == chosen.name:  # nothing left to run it on
                raise
            logger.warning(
                "attention backend %r was refused by the GPU for %s %s calls (%s, head width "
                "%d): %s. These calls run on %r.",
                chosen.name,
                entry,
                call.case,
                str(call.dtype).removeprefix("torch."),
                call.head_dim,
                reason,
                instead,
            )
            chosen = get_backend(instead)


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
        call = observe.ObservedCall(ENTRY_SOFTMAX, layer, mask, scale, observers)
        return observe.observed_softmax(call, q, k, v), None
    out = _run(
        backend, ENTRY_SOFTMAX, (q, k, v), k, mask, lambda b: b.softmax(q, k, v, mask, scale)
    )
    return out, None


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
        call = observe.ObservedCall(ENTRY_DIFF, layer, mask, scale, observers)
        return observe.observed_diff_v1(call, q1, q2, k1, k2, v, lam), None

    def kernel(chosen: Backend) -> torch.Tensor:
        diff_v1 = chosen.diff_v1
        if diff_v1 is None:
            log_once(chosen.name, "diff_v1", "no DIFF V1 entry point; composing two softmax calls")
            diff_v1 = compose_v1(chosen.softmax)
        return diff_v1(q1, q2, k1, k2, v, lam, mask, scale)

    return _run(backend, ENTRY_DIFF, (q1, q2, k1, k2, v, lam), k1, mask, kernel), None


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
        call = observe.ObservedCall(ENTRY_DIFF_V2, layer, mask, scale, observers)
        return observe.observed_diff_v2(call, q, k, v, lam, paired)
    tensors = (q, k, v) if lam is None else (q, k, v, lam)

    def kernel(chosen: Backend) -> torch.Tensor:
        diff_v2 = chosen.diff_v2
        if diff_v2 is None:
            log_once(chosen.name, "diff_v2", "no DIFF V2 entry point; composing it from softmax")
            diff_v2 = compose_v2(chosen.softmax)
        return diff_v2(q, k, v, lam, mask, scale, paired)

    return _run(backend, ENTRY_DIFF_V2, tensors, k, mask, kernel)
