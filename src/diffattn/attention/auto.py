"""``auto``: the backend each attention call runs on when none is named.

``auto`` is resolved per call, from the call's entry point (``softmax`` for the baseline,
``diff_v1``, ``diff_v2``), device, dtype and shape (:class:`Call`): a training call (a gradient
is needed), a prefill (no gradient, several queries), a one-token decode step, a padded batch,
a full custom 4-D mask, a call traced by ``torch.compile``. :func:`order` lists the
candidates for a call, fastest first as measured (``docs/performance.md``, *What auto picks*,
gives each entry and the run behind it), and :func:`choose` takes the first that runs here
exactly:

* a backend that cannot run on the tensors (``Backend.unusable``: no CUDA, no package, wrong
  dtype) is skipped silently;
* a backend whose fast kernel is not built here (``Backend.ready``: the compiled CPU kernel
  of ``fused`` without a compiler) is skipped with one warning on the ``diffattn.kernels``
  logger, so a slower choice is visible and never wrong;
* a backend whose kernel does not take the call (``Backend.accepts``: custom masks, holed
  padding, tensor offsets for flash-attn) is skipped silently.

Every distinct resolution is logged once at INFO on ``diffattn.kernels``; ``diffattn backends``
prints the table for this machine. An explicit backend name bypasses all of this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import get_backend, log_once

logger = logging.getLogger("diffattn.kernels")

ENTRIES = ("softmax", "diff_v1", "diff_v2")
"""The attention entry points (``softmax`` runs the baseline)."""
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
    traced: bool
    """Inside ``torch.compile`` (an eager static-cache step, with its tensor query offset, is
    a decode)."""

    @classmethod
    def of(cls, entry: str, tensors: tuple[torch.Tensor, ...], mask: AttentionMask) -> Call:
        q = tensors[0]
        return cls(
            entry=entry,
            device=q.device.type,
            dtype=q.dtype,
            grad=torch.is_grad_enabled() and any(t.requires_grad for t in tensors),
            decode=q.shape[2] == 1,
            padded=mask.key_padding is not None,
            custom_mask=mask.allowed is not None,
            traced=torch.compiler.is_compiling(),
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
            else ("prefill")
        )
        return base + (" + padding" if self.padded else "")


def order(call: Call) -> tuple[str, ...]:
    """Candidate backends for ``call``, fastest first (the measurements are in
    ``docs/performance.md``).

    * CPU, DIFF V1, training, prefill and decode, padded or not (fp32 and bf16): ``fused``,
      the compiled kernel (QKᵀ at width d, V read once, no N×N tensor), then ``sdpa``.
      Custom masks and traced calls: ``sdpa`` (the compiled kernel takes neither; the
      blocked torch path that would runs Python worker threads).
    * CPU, baseline and DIFF V2: ``sdpa`` (PyTorch's flash kernel for the CPU). No kernel of
      this package computes plain softmax attention; the compiled DIFF V1 kernel, doing a
      baseline head pair's FLOPs, times level with SDPA (``docs/kernels.md``), so a one-map
      copy of it has nothing measured to gain.
    * CUDA, every entry point: ``flash`` (flash-attn, fp16/bf16, causal and left/right
      padding), then ``sdpa``. ``triton`` is picked only by name: its kernels have been
      checked under Triton's CPU interpreter, never run or timed on a GPU, so they cannot be
      the default before a GPU run shows them exact and faster than flash-attn's two calls.
    * anything else: ``sdpa``. ``reference`` is the last resort when nothing else runs.
    """
    if call.device == "cuda":
        return ("flash", "sdpa")
    fused_kernel_takes_it = not (call.custom_mask or call.traced)
    if call.device == "cpu" and call.entry == "diff_v1" and fused_kernel_takes_it:
        return ("fused", "sdpa")
    return ("sdpa",)


_memo: dict[Call, str] = {}


def forget() -> None:
    """Drop the remembered CPU resolutions (after a kernel's availability changed)."""
    _memo.clear()


def choose(call: Call, q: torch.Tensor, k: torch.Tensor, mask: AttentionMask) -> str:
    """The backend ``auto`` runs ``call`` on (see the module docstring). CPU resolutions
    depend on the call alone and are remembered (a decode step pays one dict lookup); on
    other devices flash-attn's ``accepts`` reads the mask, so every call is resolved."""
    if call.device == "cpu" and call in _memo:
        return _memo[call]
    chosen = _resolve(call, q, k, mask)
    if call.device == "cpu":
        _memo[call] = chosen
    return chosen


def _resolve(call: Call, q: torch.Tensor, k: torch.Tensor, mask: AttentionMask) -> str:
    chosen = "reference"
    for name in order(call):
        backend = get_backend(name)
        if backend.why_unusable(q) is not None:
            continue
        not_ready = None if backend.ready is None else backend.ready(q)
        if not_ready is not None:
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
    if key not in _announced:
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
