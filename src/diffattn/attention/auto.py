"""``auto``: the backend each attention call runs on when none is named.

``auto`` is resolved per call, from the call's entry point (the one the layer's attention type
calls, ``AttentionType.entry``: ``softmax`` for the baseline and any type built on softmax
attention, ``diff_v1``, ``diff_v2``), device, dtype and shape (:class:`Call`): a training call
(a gradient is needed), a prefill (no gradient, several queries), a one-token decode step, a
padded batch, a full custom 4-D mask, a call traced by ``torch.compile``. :func:`order` lists the
candidates for a call, fastest first as measured (``docs/performance.md``, *What auto picks*,
gives each entry and the run behind it), and :func:`choose` takes the first that runs here
exactly:

* a backend that brings no kernel of its own for the call's entry point (it runs the same
  computation as ``sdpa``: :meth:`~diffattn.attention.registry.Backend.kernel_of`) is not a
  candidate of its own on the CPU, so a type whose module calls only ``softmax_attention`` runs
  on ``sdpa`` (``reference`` as the last resort) without a kernel written for it;
* a backend that cannot run on the tensors (``Backend.unusable``: no CUDA, no package, wrong
  dtype) is skipped silently;
* a backend whose fast kernel is not built here (``Backend.ready``: the compiled CPU kernel
  of ``fused`` without a compiler) is skipped with one warning on the ``diffattn.kernels``
  logger, so a slower choice is visible and never wrong;
* a backend whose kernel does not take the call (``Backend.accepts``: custom masks, holed
  padding, tensor offsets for flash-attn) is skipped silently;
* a backend the GPU refused at run time for this kind of call (:func:`refuse`: Triton out of
  shared memory, no cuDNN plan) is skipped; the refusal was warned about once.

Every distinct resolution is logged once at INFO on ``diffattn.kernels``; ``diffattn backends``
prints the table for this machine. An explicit backend name bypasses all of this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import ENTRIES as ENTRIES  # the entry points, for listings
from diffattn.attention.registry import (
    ENTRY_DIFF,
    ENTRY_SOFTMAX,
    backend_names,
    get_backend,
    log_once,
    set_auto_resolver,
)

logger = logging.getLogger("diffattn.kernels")

_announced: set[tuple] = set()


@dataclass(frozen=True)
class Call:
    """What ``auto`` looks at in one attention call."""

    entry: str
    device: str
    dtype: torch.dtype
    grad: bool
    """A gradient flows through the call (training)."""
    decode: bool
    """One query position (a decode step)."""
    padded: bool
    custom_mask: bool
    """A full 4-D mask or packed documents (``full_mask``: the first)."""
    traced: bool
    """Inside ``torch.compile`` (an eager static-cache step, with its tensor query offset, is
    a decode)."""
    head_dim: int = 0
    """The query heads' width (0: not given)."""
    cached: bool = False
    """Several queries against a longer key sequence (chunked prefill over a KV cache)."""
    full_mask: bool = False
    """A full 4-D mask (``AttentionMask.allowed``), which the compiled CPU kernel does not take
    (packed documents it does)."""

    @classmethod
    def of(cls, entry: str, tensors: tuple[torch.Tensor, ...], mask: AttentionMask) -> Call:
        q, k = tensors[0], tensors[2] if entry == ENTRY_DIFF else tensors[1]
        return cls(
            entry=entry,
            device=q.device.type,
            dtype=q.dtype,
            grad=torch.is_grad_enabled() and any(t.requires_grad for t in tensors),
            decode=q.shape[2] == 1,
            padded=mask.key_padding is not None,
            custom_mask=mask.custom,
            traced=torch.compiler.is_compiling(),
            head_dim=q.shape[-1],
            cached=1 < q.shape[2] < k.shape[2],
            full_mask=mask.allowed is not None,
        )

    @property
    def case(self) -> str:
        """``train``, ``prefill``, ``decode``, ``custom mask`` or ``traced``, with
        ``+ padding`` when the batch is padded."""
        if self.custom_mask:
            return "custom mask"
        base = (
            "traced"
            if self.traced
            else "decode"
            if self.decode
            else "train"
            if self.grad
            else ("prefill" + (" over a cache" if self.cached else ""))
        )
        return base + (" + padding" if self.padded else "")


MEASURED_CUDA_WIDTHS = (64, 128)
"""Head widths of the CUDA measurements behind :func:`order`."""


def order(call: Call) -> tuple[str, ...]:
    """Candidate backends for ``call``, fastest first (the measurements are in
    ``docs/performance.md``, *What auto picks*).

    * CPU, DIFF V1, training, prefill and decode, padded or not, packed documents or not
      (fp32 and bf16): ``fused`` (:data:`CPU_FIRST`, for the entry points it brings a kernel of
      its own for: DIFF V1's), the compiled kernel (QKᵀ at width d, V read once, no N×N
      tensor), then ``sdpa``. Full 4-D masks and traced calls: ``sdpa`` (the compiled kernel
      takes neither; the blocked torch path that would runs Python worker threads).
    * CPU, baseline and DIFF V2: ``sdpa`` (PyTorch's flash kernel for the CPU). No kernel of
      this package computes plain softmax attention; the compiled DIFF V1 kernel, doing a
      baseline head pair's FLOPs, times level with SDPA (``docs/kernels.md``), so a one-map
      copy of it has nothing measured to gain.
    * CUDA, from one H200 (torch 2.11+cu130, bf16; the attention op alone, 16K tokens per
      call, N = 4096 and 16384, each figure the baseline's time over the call's, forward /
      forward + backward):

      ======================  =========  =============  ===================================
      call                    dtype      head width     order (basis)
      ======================  =========  =============  ===================================
      training; prefill       bf16       64, 128        ``sdpa``, ``flash``: DIFF V1 on
      (no padding, no cache),                           ``sdpa`` runs two native-width
      every entry point                                 calls on cuDNN: d = 128 0.48–0.51 /
                                                        0.42–0.43, d = 64 0.54–0.63 /
                                                        0.61–0.66, against 0.38–0.48 /
                                                        0.37–0.41 and 0.49–0.62 / 0.54–0.63
                                                        zero-padded (flash-attn runs the
                                                        padded form). Baseline and DIFF
                                                        V2: PyTorch's own SDPA choice,
                                                        cuDNN, is 1.0; FA2, the kernel of
                                                        flash-attn 2, 0.50–0.51 / 0.55–0.59
                                                        (d = 128), 0.63–0.66 / 0.64 (d = 64)
      decode; padding;        any        any            ``flash``, ``sdpa``: not measured,
      chunked prefill;                                  the order from before the
      fp16; other widths                                measurement
      fp32                    fp32       any            ``flash``, ``sdpa``: flash-attn
                                                        takes no fp32, so ``sdpa``
      ======================  =========  =============  ===================================

      ``triton`` is picked only by name: its kernels have not been shown exact and fast on a
      GPU, so they cannot be the default before a GPU run does.
    * anything else: ``sdpa``. ``reference`` is the last resort when nothing else runs.
    """
    if call.device == "cuda":
        return ("sdpa", "flash") if _sdpa_measured_first(call) else ("flash", "sdpa")
    fused_kernel_takes_it = not (call.full_mask or call.traced)
    if call.device == "cpu" and fused_kernel_takes_it:
        return (*(n for n in CPU_FIRST if brings_own_kernel(n, call.entry)), "sdpa")
    return ("sdpa",)


CPU_FIRST = ("fused",)
"""Backends measured faster than ``sdpa`` on the CPU for the entry points they bring a kernel
of their own for (``fused``: DIFF V1's, ``docs/performance.md``)."""


def brings_own_kernel(name: str, entry: str) -> bool:
    """Whether backend ``name`` is registered and runs ``entry`` with a computation of its own,
    not ``sdpa``'s (:meth:`~diffattn.attention.registry.Backend.kernel_of`)."""
    if name not in backend_names():
        return False
    return get_backend(name).kernel_of(entry) != get_backend("sdpa").kernel_of(entry)


def _sdpa_measured_first(call: Call) -> bool:
    """The CUDA calls measured faster on ``sdpa`` (see :func:`order`)."""
    unmeasured_case = call.decode or call.padded or call.custom_mask or call.traced
    return (
        call.dtype == torch.bfloat16
        and call.head_dim in MEASURED_CUDA_WIDTHS
        and not (unmeasured_case or call.cached)
    )


_memo: dict[Call, str] = {}


_refused: dict[Call, dict[str, str]] = {}
"""Backends a GPU refused at run time, per kind of call, with the reason."""


def forget() -> None:
    """Drop the remembered CPU resolutions and run-time refusals (after a kernel's
    availability changed)."""
    _memo.clear()
    _refused.clear()


def refuse(call: Call, name: str, reason: str) -> None:
    """Remember that the GPU refused backend ``name`` for calls like ``call``, so that
    neither ``auto`` nor an explicit name runs such calls there again (the caller warns)."""
    _refused.setdefault(call, {})[name] = reason
    _memo.pop(call, None)


def refused(call: Call) -> dict[str, str]:
    """The backends refused for calls like ``call``, with the reasons."""
    return _refused.get(call, {})


def any_refused() -> bool:
    """Whether a GPU refused any backend in this process (explicit names then check)."""
    return bool(_refused)


def choose(call: Call, q: torch.Tensor, k: torch.Tensor, mask: AttentionMask) -> str:
    """The backend ``auto`` runs ``call`` on (see the module docstring). CPU resolutions
    depend on the call alone and are remembered (a decode step pays one dict lookup); on
    other devices flash-attn's ``accepts`` reads the mask, so every call is resolved."""
    if call.device == "cpu" and call in _memo:
        return _memo[call]
    if torch.compiler.is_compiling():
        # Traced: resolve without writing the memo, the announcements or the warnings, whose
        # module-level sets Dynamo cannot mutate inside a graph (fullgraph=True would fail).
        return _resolve(call, q, k, mask, record=False)
    chosen = _resolve(call, q, k, mask)
    if call.device == "cpu":
        _memo[call] = chosen
    return chosen


def resolve(
    q: torch.Tensor,
    call: Call | None = None,
    mask: AttentionMask | None = None,
    k: torch.Tensor | None = None,
) -> str:
    """The backend ``auto`` runs on for tensors like ``q`` (``registry.resolve_backend("auto",
    ...)``): :func:`choose` for ``call``, by default a prefill of softmax attention without
    padding, with ``k`` defaulting to ``q`` and ``mask`` to no mask."""
    mask = AttentionMask() if mask is None else mask
    if call is None:
        call = Call(ENTRY_SOFTMAX, q.device.type, q.dtype, False, False, False, False, False)
    return choose(call, q, q if k is None else k, mask)


set_auto_resolver(resolve)


def _resolve(
    call: Call, q: torch.Tensor, k: torch.Tensor, mask: AttentionMask, record: bool = True
) -> str:
    """The first candidate of :func:`order` that runs this call; ``record`` logs the skips
    and the resolution once each (off while traced)."""
    chosen = "reference"
    for name in order(call):
        if name in refused(call):
            continue
        backend = get_backend(name)
        if backend.why_unusable(q) is not None:
            continue
        not_ready = None if backend.ready is None else backend.ready(q)
        if not_ready is not None:
            if record:
                log_once(
                    "auto",
                    name,
                    f"skipping {name!r}: {not_ready}; auto runs these calls on the next choice "
                    f"({', '.join(order(call)[order(call).index(name) + 1 :]) or 'reference'})",
                )
            continue
        if backend.accepts is not None and backend.accepts(q, k, mask) is not None:
            continue
        chosen = name
        break
    key = (call, chosen)
    if record and key not in _announced:
        _announced.add(key)
        logger.info(
            "auto: %s %s on %s %s -> %s",
            call.entry,
            call.case,
            call.device,
            str(call.dtype).removeprefix("torch."),
            chosen,
        )
    return chosen
