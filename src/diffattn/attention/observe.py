"""The observation seam: where a forward pass can be watched from inside attention.

An :class:`AttentionObserver` installed with :func:`observing` sees every attention call of the
layers it :meth:`~AttentionObserver.observes`. Those calls run :func:`observed_attention`, a
reference computation blocked over query rows, instead of the selected backend: for each block of
``block_rows`` queries it builds the scaled logits ``QKᵀ/√d``, lets the observer transform them
(before the mask and the softmax, for DIFF Fig 8's quantization), takes the softmax, and hands
the observer an :class:`AttentionEvent` with the logits, the softmax maps, λ and the map that is
applied to V. Nothing of size N×N outlives a block unless the observer keeps it, so reductions
(span sums, top-k, histograms) over 4K-token sequences need ``block_rows × N`` memory per head.

Layers that no observer asks for keep their backend. Observed layers produce the reference
kernel's outputs (fp32 softmax; equal to the fused backends up to rounding), with gradients.

Map names in events: ``"a"`` for softmax attention (baseline, Hugging Face models); ``"a1"`` and
``"a2"`` for the two maps of DIFF V1 (Eq.1) and of each DIFF V2 query-head pair. ``applied`` is
the map that multiplies V: ``A``, or ``A1 − λ·A2``.

This module is the core half of :mod:`diffattn.probe`, which builds captures on top of it;
``output_attentions`` uses :class:`MapRecorder`.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from diffattn.attention.mask import AttentionMask, expand_kv
from diffattn.attention.registry import pair_heads

# Installed observers, innermost last. A plain list (not a ContextVar) so that torch.compile
# traces the empty check without a graph break.
_ACTIVE: list[AttentionObserver] = []


@dataclass
class AttentionEvent:
    """One block of query rows of one attention call.

    Attributes:
        layer: 0-based layer index.
        kind: ``"softmax"``, ``"diff_v1"`` or ``"diff_v2"``.
        row_start: index of the block's first query row within the call.
        query_offset: absolute position of the call's first query in the key sequence (the
            cache length before this call); query row ``r`` is at ``query_offset + r``.
        n_queries: number of query rows of the whole call.
        logits: map name → ``(B, H, R, S)`` fp32 scaled logits after any transform, with
            ``-inf`` where the mask forbids a key.
        probs: map name → ``(B, H, R, S)`` fp32 softmax maps.
        applied: ``(B, H_out, R, S)``: the map that multiplies V.
        lam: λ: 0-d (DIFF V1), ``(B, H_out, R, 1)`` (DIFF V2), else ``None``.
        allowed: ``(B or 1, 1, R, S)`` bool, the mask of this block.
        values: V ``(B, H_kv, S, dv)`` as the call received it (not expanded to query heads).
        source: ``"diffattn"`` or the Hugging Face model type.
    """

    layer: int
    kind: str
    row_start: int
    query_offset: int
    n_queries: int
    logits: dict[str, torch.Tensor]
    probs: dict[str, torch.Tensor]
    applied: torch.Tensor
    lam: torch.Tensor | None
    allowed: torch.Tensor
    values: torch.Tensor
    source: str = "diffattn"

    @property
    def n_rows(self) -> int:
        return self.applied.shape[2]

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions ``(R,)`` of this block's query rows in the key sequence."""
        start = int(self.query_offset) + self.row_start
        return torch.arange(start, start + self.n_rows, device=self.applied.device)


class AttentionObserver:
    """Base class: override what you need. Observers never change outputs unless they
    transform logits."""

    #: query rows per block; lower it to save memory, raise it for speed.
    block_rows: int = 512
    #: compute the output from the applied map (``(A1 − λA2) V``), so that gradients reach the
    #: map an observer hands out (gradient attribution); equal to ``o1 − λ o2`` up to rounding.
    output_from_applied: bool = False

    def observes(self, layer: int) -> bool:
        """Whether attention of ``layer`` should run observed."""
        return True

    def transform_logits(
        self, layer: int, logits: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Change the scaled logits ``(B, H, R, S)`` before the mask and softmax (default:
        none). ``allowed`` marks the entries the mask keeps."""
        return logits

    def on_attention(self, event: AttentionEvent) -> None:
        """Receive one block of one attention call."""


@contextlib.contextmanager
def observing(observer: AttentionObserver) -> Iterator[AttentionObserver]:
    """Install ``observer`` for the forwards run inside this block (nestable)."""
    _ACTIVE.append(observer)
    try:
        yield observer
    finally:
        _ACTIVE.remove(observer)


def observers_for(layer: int | None) -> tuple[AttentionObserver, ...]:
    """The installed observers that watch ``layer`` (none when ``layer`` is ``None``)."""
    if not _ACTIVE or layer is None:
        return ()
    return tuple(o for o in _ACTIVE if o.observes(layer))


# --------------------------------------------------------------------------------------------
# the observed (blocked reference) computation
# --------------------------------------------------------------------------------------------
@dataclass
class _Block:
    logits: torch.Tensor
    probs: torch.Tensor
    out: torch.Tensor
    allowed: torch.Tensor


def _attend_block(q, k, v, mask, scale, row_start, layer, observers, allowed=None) -> _Block:
    """One block of explicit attention, the same ops as the ``reference`` backend."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if allowed is None:
        allowed = mask.dense(q.shape[2], k.shape[2], q.device, row_start)
    for observer in observers:
        scores = observer.transform_logits(layer, scores, allowed)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float()).to(q.dtype)
    return _Block(scores, probs, out, allowed)


@dataclass
class ObservedCall:
    """What :func:`observed_attention` needs besides the tensors."""

    kind: str
    layer: int
    mask: AttentionMask
    scale: float
    observers: tuple[AttentionObserver, ...]
    source: str = "diffattn"
    dense_mask: Callable[[int, int], torch.Tensor] | None = field(default=None, repr=False)
    """For foreign masks: ``dense_mask(row_start, rows)`` → allowed ``(B|1, 1, R, S)``."""


def _from_applied(call: ObservedCall) -> bool:
    return any(o.output_from_applied for o in call.observers)


def _rows(n: int, observers) -> list[tuple[int, int]]:
    size = max(1, min(o.block_rows for o in observers))
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def _emit(call: ObservedCall, start: int, n: int, logits, probs, applied, lam, allowed, values):
    offset = call.mask.query_offset
    event = AttentionEvent(
        layer=call.layer,
        kind=call.kind,
        row_start=start,
        query_offset=int(offset) if not isinstance(offset, torch.Tensor) else int(offset.item()),
        n_queries=n,
        logits=logits,
        probs=probs,
        applied=applied,
        lam=lam,
        allowed=allowed,
        values=values,
        source=call.source,
    )
    for observer in call.observers:
        observer.on_attention(event)
    release_freed_memory()


def _trim_function():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _trim_function() if sys.platform.startswith("linux") else None


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Each observed block allocates and frees tensors of tens of MB. glibc raises its mmap
    threshold after such frees and then serves them from the heap, which it does not shrink, so
    without this the resident size climbs block after block (to 1.6 GB instead of 0.5 GB for a
    4-layer model at 4,096 tokens) although the live memory stays one block's worth.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _blocks(call: ObservedCall, q, k, v) -> Iterator[tuple[int, _Block]]:
    """``(row_start, block)`` over the query rows of one softmax-attention call."""
    k_all, v_all = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    for start, end in _rows(q.shape[2], call.observers):
        allowed = call.dense_mask(start, end - start) if call.dense_mask else None
        args = (call.mask, call.scale, start, call.layer, call.observers, allowed)
        yield start, _attend_block(q[:, :, start:end], k_all, v_all, *args)


def observed_softmax(call: ObservedCall, q, k, v) -> torch.Tensor:
    """Softmax attention, observed; q ``(B, Hq, N, d)``, k/v with ``Hkv`` heads."""
    outs = []
    for start, b in _blocks(call, q, k, v):
        probs = {"a": b.probs}
        _emit(call, start, q.shape[2], {"a": b.logits}, probs, b.probs, None, b.allowed, v)
        outs.append(b.out)
    return torch.cat(outs, dim=2)


def observed_diff_v1(call: ObservedCall, q1, q2, k1, k2, v, lam) -> torch.Tensor:
    """DIFF V1 Eq.1, observed: ``(A1 − λ A2) V`` with A1, A2 from (Q1, K1) and (Q2, K2)."""
    n, heads = q1.shape[2], q1.shape[1]
    # V is expanded once per map, as two reference calls would: gradients then accumulate in
    # the same order as on the reference backend.
    k1, k2 = expand_kv(k1, heads), expand_kv(k2, heads)
    v1, v2 = expand_kv(v, heads), expand_kv(v, heads)
    outs = []
    for start, end in _rows(n, call.observers):
        args = (call.mask, call.scale, start, call.layer, call.observers)
        b1 = _attend_block(q1[:, :, start:end], k1, v1, *args)
        b2 = _attend_block(q2[:, :, start:end], k2, v2, *args)
        applied = b1.probs - lam * b2.probs
        if _from_applied(call):
            outs.append(torch.matmul(applied, v1.float()).to(b1.out.dtype))
        else:
            outs.append(b1.out - lam.to(b1.out.dtype) * b2.out)
        _emit(
            call,
            start,
            n,
            {"a1": b1.logits, "a2": b2.logits},
            {"a1": b1.probs, "a2": b2.probs},
            applied,
            lam,
            b1.allowed,
            v,
        )
    return torch.cat(outs, dim=2)


def observed_diff_v2(call: ObservedCall, q, k, v, lam, paired: bool) -> torch.Tensor:
    """DIFF V2, observed: one softmax attention over 2h query heads, then
    ``o1 − λ·o2`` per pair; the applied map is ``A1 − λ·A2`` (λ = 1 without λ)."""
    outs = []
    for start, b in _blocks(call, q, k, v):
        o1, o2 = pair_heads(b.out, paired)
        lam_rows = None if lam is None else lam[:, :, start : start + b.out.shape[2]]
        a1, a2 = pair_heads(b.probs, paired)
        l1, l2 = pair_heads(b.logits, paired)
        lam_map = torch.ones_like(a1[..., :1]) if lam_rows is None else lam_rows.float()
        applied = a1 - lam_map * a2
        if paired and _from_applied(call):  # a pair shares its K/V group, so one V serves
            v_pairs = expand_kv(v, q.shape[1])[:, 0::2]
            outs.append(torch.matmul(applied, v_pairs.float()).to(o1.dtype))
        else:
            outs.append(o1 - o2 if lam_rows is None else o1 - lam_rows.to(o2.dtype) * o2)
        logits, probs = {"a1": l1, "a2": l2}, {"a1": a1, "a2": a2}
        _emit(call, start, q.shape[2], logits, probs, applied, lam_map, b.allowed, v)
    return torch.cat(outs, dim=2)


# --------------------------------------------------------------------------------------------
# output_attentions
# --------------------------------------------------------------------------------------------
class MapRecorder(AttentionObserver):
    """Keeps the full maps of the layers it watches (what ``output_attentions`` returns).

    The maps keep their autograd graph and the layer's output is computed from the applied map,
    so gradients reach the returned maps (gradient attribution).
    """

    output_from_applied = True

    def __init__(self, layers: set[int] | None = None, block_rows: int = 1 << 30) -> None:
        self.layers = layers
        self.block_rows = block_rows
        self.events: dict[int, list[AttentionEvent]] = {}

    def observes(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def on_attention(self, event: AttentionEvent) -> None:
        self.events.setdefault(event.layer, []).append(event)

    def take(self, layer: int) -> list[AttentionEvent]:
        """The events of ``layer`` since the last call, oldest first."""
        return self.events.pop(layer, [])
