"""The capture probe: one way to look inside any supported model during a forward pass.

::

    from diffattn.probe import Probe, captures as C

    spans = C.SpanMass(spans=[(100, 120)])
    stats = C.LogitStats(top_k=100)
    with Probe(model, [spans, stats, C.TokenLoss()]) as probe:
        model(input_ids)
    spans.result(), stats.result(), probe.results()

A :class:`Probe` takes :class:`Capture` objects. Each says which layers' attention it needs;
only those layers run the observed (blocked reference) attention of
:mod:`diffattn.attention.observe`; the others keep their backend. Captures that need no
attention internals (hidden states, head outputs, λ, per-token loss) use module hooks and
change nothing about how the model runs. Captures accumulate over every forward inside the
``with`` block, so a token budget can be streamed through in batches.

Supported models (see :mod:`diffattn.probe.models`): diffattn's ``DiffTransformerLM`` and
``DiffAttnForCausalLM``; Hugging Face Llama, Qwen2, Mistral and DiffLlama; any of these with
Dex applied (its pre-hook on ``o_proj`` sits between the ``"output"`` and ``"dex_output"``
head-output stages).

Outputs: unchanged for layers no capture watches. Watched layers compute attention in fp32 with
the reference kernel's operations, equal to the fused backends up to rounding. The only
captures that change outputs on purpose are :class:`~diffattn.probe.captures.LogitTransform`
(transforms logits before the softmax) and
:class:`~diffattn.probe.captures.HeadGates` (identity gates for head importance).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from diffattn.attention.observe import AttentionEvent, AttentionObserver, observing
from diffattn.probe.models import LayerView, ModelView, view


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Put ``model`` in eval mode inside the block and restore its mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class Capture:
    """Base class of what a probe can capture. Subclasses override what they need.

    Args:
        layers: layer indices to capture (``None``: all).
        heads: head indices to keep (``None``: all).
        query_positions: absolute query positions whose rows to keep (``None``: all rows).
    """

    name = "capture"

    def __init__(
        self,
        layers: Iterable[int] | None = None,
        heads: Iterable[int] | None = None,
        query_positions: Iterable[int] | None = None,
    ) -> None:
        self.layers = None if layers is None else {int(i) for i in layers}
        self.heads = None if heads is None else sorted({int(h) for h in heads})
        self.query_positions = (
            None if query_positions is None else sorted({int(p) for p in query_positions})
        )
        self.probe: Probe | None = None

    # --- what to watch ---------------------------------------------------------------------
    def wants_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def needs_attention(self, layer: int) -> bool:
        """Whether this capture needs the attention internals of ``layer``."""
        return False

    # --- callbacks ---------------------------------------------------------------------------
    def install(self, probe: Probe) -> list[Any]:
        """Register module hooks; return their handles (removed when the probe closes)."""
        return []

    def on_attention(self, event: AttentionEvent) -> None:
        """One block of query rows of an observed attention call."""

    def transform_logits(self, layer: int, logits: torch.Tensor, allowed: torch.Tensor):
        """Return transformed logits, or ``None`` to leave them alone."""
        return None

    def result(self) -> Any:
        raise NotImplementedError

    # --- helpers for subclasses ------------------------------------------------------------
    def select(self, event: AttentionEvent, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor`` ``(B, H, R, …)`` of ``event`` restricted to the chosen heads and query
        rows; ``None`` when no chosen row lies in this block."""
        if self.heads is not None:
            tensor = tensor[:, self.heads]
        rows = self.rows_in(event)
        if rows is None:
            return tensor
        if rows.numel() == 0:
            return None
        return tensor.index_select(2, rows.to(tensor.device))

    def rows_in(self, event: AttentionEvent) -> torch.Tensor | None:
        """Indices of the chosen query rows within the block (``None``: every row)."""
        if self.query_positions is None:
            return None
        positions = event.positions.tolist()
        index = {p: i for i, p in enumerate(positions)}
        return torch.tensor(
            [index[p] for p in self.query_positions if p in index], dtype=torch.long
        )

    def real_rows(self, event: AttentionEvent) -> torch.Tensor:
        """``(B, R)`` bool: query rows of the block that are real tokens (not padding)."""
        return self.probe.real_queries(event)


class _Observer(AttentionObserver):
    """The probe's face towards the kernel seam."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.block_rows = probe.block_rows

    def observes(self, layer: int) -> bool:
        return any(c.needs_attention(layer) for c in self.probe.captures)

    def transform_logits(self, layer, logits, allowed):
        for capture in self.probe.captures:
            changed = capture.transform_logits(layer, logits, allowed)
            if changed is not None:
                logits = changed
        return logits

    def on_attention(self, event: AttentionEvent) -> None:
        for capture in self.probe.captures:
            if capture.needs_attention(event.layer):
                capture.on_attention(event)


class Probe:
    """Observe a model's forward passes with ``captures`` (a context manager).

    Args:
        model: a supported model (see the module docstring).
        captures: :class:`Capture` objects.
        block_rows: query rows per block of observed attention: peak extra memory per watched
            layer is about ``block_rows × keys × heads × 4 bytes`` per map.
    """

    def __init__(self, model: nn.Module, captures: Sequence[Capture], block_rows: int = 128):
        self.model = model
        self.view: ModelView = view(model)
        self.captures = list(captures)
        self.block_rows = int(block_rows)
        n = len(self.view.layers)
        for capture in self.captures:
            if not isinstance(capture, Capture):
                raise ValueError(f"not a probe capture: {capture!r}")
            bad = sorted(i for i in (capture.layers or ()) if not 0 <= i < n)
            if bad:
                raise ValueError(
                    f"{type(capture).__name__}: layer(s) {bad} do not exist; the model has "
                    f"{n} layers (0-{n - 1})"
                )
            capture.probe = self
        self.inputs: dict[str, torch.Tensor | None] = {}
        self._stack: contextlib.ExitStack | None = None

    @property
    def layers(self) -> list[LayerView]:
        return self.view.layers

    def __enter__(self) -> Probe:
        stack = contextlib.ExitStack()
        handles = [self.view.top.register_forward_pre_hook(self._record_inputs, with_kwargs=True)]
        for capture in self.captures:
            handles.extend(capture.install(self))
        stack.callback(lambda: [h.remove() for h in handles])
        observer = _Observer(self)
        if self.view.family == "diffattn":
            stack.enter_context(observing(observer))
        elif any(c.needs_attention(i) for c in self.captures for i in range(len(self.layers))):
            from diffattn.probe.hf import watching

            stack.enter_context(watching(self.model, observer))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def _record_inputs(self, module, args, kwargs):
        names = ("input_ids", "attention_mask", "labels")
        for i, name in enumerate(names):
            value = kwargs.get(name, args[i] if i < len(args) else None)
            self.inputs[name] = value if isinstance(value, torch.Tensor) else None

    def real_queries(self, event: AttentionEvent) -> torch.Tensor:
        """``(B, R)`` bool of the event's query rows that are real tokens."""
        mask = self.inputs.get("attention_mask")
        bsz = event.applied.shape[0]
        if mask is None or mask.dim() != 2:
            return torch.ones(bsz, event.n_rows, dtype=torch.bool, device=event.applied.device)
        return mask.bool()[:, event.positions.to(mask.device)].to(event.applied.device)

    def results(self) -> dict[str, Any]:
        """Every capture's result, by capture name (numbered when names repeat)."""
        out: dict[str, Any] = {}
        for capture in self.captures:
            key, n = capture.name, 2
            while key in out:
                key, n = f"{capture.name}_{n}", n + 1
            out[key] = capture.result()
        return out
