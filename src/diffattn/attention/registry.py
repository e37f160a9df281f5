"""The kernel registry: a backend name maps to its attention entry points.

Every attention call of diffattn goes through one of three entry points, and a backend supplies
its own implementation of each (after Hugging Face's ``AttentionInterface``):

``softmax(q, k, v, mask, scale) -> out``
    ``softmax(QKᵀ·scale + mask) V``. q ``(B, Hq, N, d)``, k ``(B, Hkv, S, d)``, v
    ``(B, Hkv, S, dv)``, out ``(B, Hq, N, dv)``; query head ``m`` reads KV head
    ``m // (Hq / Hkv)``. Required.
``diff_v1(q1, q2, k1, k2, v, lam, mask, scale) -> out``
    DIFF V1 Eq.1 per differential head, ``(softmax(Q1K1ᵀ) − λ softmax(Q2K2ᵀ)) V`` with a 0-d
    λ. q1, q2 ``(B, H, N, d)``; k1, k2 ``(B, Hkv, S, d)``; v ``(B, Hkv, S, 2d)``. Optional.
``diff_v2(q, k, v, lam, mask, scale, paired) -> out``
    DIFF V2: one softmax attention over the 2h query heads, then
    ``o_{2i} − λ_i·o_{2i+1}`` (``paired``) or ``o_i − λ_i·o_{i+h}``; λ ``(B, h, N, 1)`` or
    ``None`` (no λ). Optional.

The built-in backends declare their differential entry points with :func:`compose_v1` and
:func:`compose_v2`, exact compositions from their ``softmax`` (two calls for V1, one call and a
subtraction for V2). A registered backend that leaves an entry point out gets the same
composition, with a warning logged once on the ``diffattn.kernels`` logger, so a missing fused
kernel is visible and never wrong.

Adding a kernel: one file in :mod:`diffattn.attention.backends` that calls
:func:`register_backend` at import (the package's modules are imported on first lookup), plus its
parity tests against ``reference``.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("diffattn.kernels")

SoftmaxFn = Callable[..., torch.Tensor]

ENTRY_SOFTMAX = "softmax"
"""The softmax-attention entry point (:class:`Backend.softmax`)."""
ENTRY_DIFF = "diff_v1"
"""DIFF V1's entry point, Eq.1 per differential head (:class:`Backend.diff_v1`)."""
ENTRY_DIFF_V2 = "diff_v2"
"""DIFF V2's entry point, one softmax call and ``o1 − λ·o2`` per pair (:class:`Backend.diff_v2`)."""
ENTRIES = (ENTRY_SOFTMAX, ENTRY_DIFF, ENTRY_DIFF_V2)
"""Every entry point, in the order listings show them. An attention type names the one its
module calls (``AttentionType.entry``); these names are the entry points', not the types'."""


@dataclass(frozen=True)
class Backend:
    """One attention backend.

    Attributes:
        name: the name users pass (``model.set_backend(name)``).
        softmax: the softmax-attention entry point (see the module docstring).
        diff_v1, diff_v2: fused differential entry points, or ``None`` to compose them.
        unusable: ``unusable(q)`` returns why the backend cannot run on tensors like ``q``
            (device, dtype, missing package), or ``None`` when it can.
        hf_name: the Hugging Face ``attn_implementation`` this backend answers to, if any.
        custom_masks: see the field.
        description: one line for listings and docs.
        ready: ``ready(q)`` returns why the backend's fast kernel is not built here (so
            ``auto`` passes it over, with one warning), or ``None``.
        accepts: ``accepts(q, k, mask)`` returns why the backend's kernel does not take such a
            call (so ``auto`` passes it over), or ``None``.
    """

    name: str
    softmax: SoftmaxFn
    diff_v1: SoftmaxFn | None = None
    diff_v2: SoftmaxFn | None = None
    unusable: Callable[[torch.Tensor], str | None] | None = None
    hf_name: str | None = None
    description: str = ""
    custom_masks: bool = True
    """Whether the kernels take a full 4-D mask (``AttentionMask.allowed``) and documents packed
    in a row (``AttentionMask.document_ids``), through ``AttentionMask.dense``; calls with
    either go to ``sdpa`` otherwise."""
    document_masks: bool = False
    """Whether the kernels take packed documents (``AttentionMask.document_ids``) though not
    full 4-D masks; ``custom_masks`` implies it."""
    ready: Callable[[torch.Tensor], str | None] | None = None
    accepts: Callable[[torch.Tensor, torch.Tensor, object], str | None] | None = None

    @classmethod
    def from_softmax(cls, name: str, softmax: SoftmaxFn, **fields) -> Backend:
        """A backend whose differential entry points are composed from ``softmax``."""
        return cls(name, softmax, compose_v1(softmax), compose_v2(softmax), **fields)

    def why_unusable(self, q: torch.Tensor) -> str | None:
        return None if self.unusable is None else self.unusable(q)

    def entry_point(self, entry: str) -> SoftmaxFn:
        """The function this backend runs ``entry`` (one of :data:`ENTRIES`) with: its own, or
        the composition from its ``softmax`` where it declares none."""
        if entry == ENTRY_SOFTMAX:
            return self.softmax
        if entry == ENTRY_DIFF:
            return self.diff_v1 or compose_v1(self.softmax)
        if entry == ENTRY_DIFF_V2:
            return self.diff_v2 or compose_v2(self.softmax)
        raise ValueError(f"unknown attention entry point {entry!r}; choose one of {ENTRIES}")

    def kernel_of(self, entry: str) -> object:
        """What computes ``entry`` on this backend, as a value two backends share exactly when
        they run the same computation: the function it declares, or for a composition
        (:func:`compose_v1`, :func:`compose_v2`, or an entry point left out) the entry point
        and the ``softmax`` it is composed from. ``fused`` and ``triton`` run the baseline on
        ``sdpa``'s softmax, so for ``softmax`` they bring no kernel of their own."""
        function = self.entry_point(entry)
        source = getattr(function, "composed_from", None)
        return function if source is None else (entry, source)


_BACKENDS: dict[str, Backend] = {}
_logged: set[tuple[str, str]] = set()
_discovered = False


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to the registry; re-registering a name needs ``replace=True``."""
    if backend.name == "auto":
        raise ValueError("'auto' is reserved: it picks the fastest usable backend")
    if backend.name in _BACKENDS and not replace:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    from diffattn.attention import backends

    for info in pkgutil.iter_modules(backends.__path__):
        importlib.import_module(f"{backends.__name__}.{info.name}")


def backend_names() -> tuple[str, ...]:
    """Every registered backend name, plus ``auto``."""
    _discover()
    return (*_BACKENDS, "auto")


def check_backend_name(name: str) -> str:
    """``name`` if it is ``auto`` or registered, else ``ValueError`` listing the choices."""
    _discover()
    if name != "auto" and name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(backend_names())}"
        )
    return name


def get_backend(name: str) -> Backend:
    """The registered backend called ``name`` (not ``auto``: see :func:`resolve_backend`)."""
    check_backend_name(name)
    if name == "auto":
        raise ValueError("'auto' is resolved per call; use resolve_backend(name, q)")
    return _BACKENDS[name]


def backend_for_hf(attn_implementation: str) -> str | None:
    """The diffattn backend answering to a Hugging Face ``attn_implementation`` name."""
    _discover()
    if attn_implementation in _BACKENDS:
        return attn_implementation
    for backend in _BACKENDS.values():
        if backend.hf_name == attn_implementation:
            return backend.name
    return None


AutoResolver = Callable[..., str]
"""``resolver(q, call=None, mask=None, k=None) -> backend name``: how ``auto`` is resolved."""
_auto_resolver: AutoResolver | None = None


def set_auto_resolver(resolver: AutoResolver) -> None:
    """Make :func:`resolve_backend` resolve ``auto`` with ``resolver``. The registry sits below
    the ``auto`` policy, so :mod:`diffattn.attention.auto` installs its ``resolve`` when it is
    imported (importing the registry imports it, through the package ``diffattn.attention``)."""
    global _auto_resolver
    _auto_resolver = resolver


def resolve_backend(name: str, q: torch.Tensor, call=None, mask=None, k=None) -> str:
    """A concrete backend for tensors like ``q``. ``auto`` is resolved for ``call`` (an
    :class:`diffattn.attention.auto.Call`; default: a prefill of softmax attention without
    padding) by :func:`diffattn.attention.auto.resolve`; a named backend that cannot run on
    ``q`` raises ``RuntimeError`` saying why."""
    check_backend_name(name)
    if name == "auto":
        if _auto_resolver is None:
            raise RuntimeError("no resolver for backend 'auto': import diffattn.attention.auto")
        return _auto_resolver(q, call=call, mask=mask, k=k)
    reason = _BACKENDS[name].why_unusable(q)
    if reason is not None:
        raise RuntimeError(f"backend={name!r} {reason}")
    return name


REFUSAL_ERRORS = ("OutOfResources", "CompilationError", "PTXASError")
"""Exception classes (by name, so Triton need not be imported) by which a GPU refuses a
kernel: Triton's shared-memory and register limits and its compilation failures."""
REFUSAL_MESSAGES = (
    "no available kernel",  # SDPA found no kernel for the call among those allowed
    "no viable backend",  # the same, on the CPU
    "no valid execution plan",  # cuDNN built no plan for the shape
    "cudnn_status_not_supported",
    "only supports ampere gpus or newer",  # flash-attn on an older GPU
    "no kernel image is available",  # a kernel not built for this GPU's architecture
)
"""Phrases of ``RuntimeError`` messages by which PyTorch says a GPU kernel refused a call."""


def gpu_refusal(error: BaseException) -> str | None:
    """A one-line account of ``error`` if it is a GPU refusing a kernel for a call (see
    :data:`REFUSAL_ERRORS`, :data:`REFUSAL_MESSAGES`), else ``None``: a programming error,
    such as mismatched shapes, is not a refusal and must propagate."""
    names = {cls.__name__ for cls in type(error).__mro__}
    text = str(error)
    refused = bool(names & set(REFUSAL_ERRORS)) or (
        isinstance(error, RuntimeError) and any(m in text.lower() for m in REFUSAL_MESSAGES)
    )
    if not refused:
        return None
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first_line[:300]}"


def log_once(backend: str, entry_point: str, message: str) -> None:
    """Warn about a fallback once per (backend, entry point)."""
    if (backend, entry_point) not in _logged:
        _logged.add((backend, entry_point))
        logger.warning("attention backend %r: %s", backend, message)


def pair_heads(t: torch.Tensor, paired: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DIFF V2's head pairs along dim 1: ``(2i, 2i+1)`` when ``paired``, else ``(i, i+h)``."""
    if paired:
        return t[:, 0::2], t[:, 1::2]
    h = t.shape[1] // 2
    return t[:, :h], t[:, h:]


def compose_v1(softmax: SoftmaxFn) -> SoftmaxFn:
    """DIFF V1 Eq.1 from two ``softmax`` calls, each against the full 2d-wide V (App. A's
    FlashDiffAttn_1 form)."""

    def diff_v1(q1, q2, k1, k2, v, lam, mask, scale):
        o1 = softmax(q1, k1, v, mask, scale)
        o2 = softmax(q2, k2, v, mask, scale)
        return o1 - lam.to(o1.dtype) * o2

    diff_v1.composed_from = softmax  # what Backend.kernel_of reports
    return diff_v1


def compose_v2(softmax: SoftmaxFn) -> SoftmaxFn:
    """DIFF V2 from one ``softmax`` call over the 2h query heads and ``o1 − λ·o2`` per pair."""

    def diff_v2(q, k, v, lam, mask, scale, paired):
        o1, o2 = pair_heads(softmax(q, k, v, mask, scale), paired)
        return o1 - o2 if lam is None else o1 - lam.to(o2.dtype) * o2

    diff_v2.composed_from = softmax  # what Backend.kernel_of reports
    return diff_v2
