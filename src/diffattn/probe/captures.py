"""What a :class:`~diffattn.probe.Probe` can capture. Each class is one kind of observation.

Attention internals (need the layer to run observed attention):

* :class:`AttentionMaps`: pre-softmax logits, the softmax maps (A, or A1 and A2), λ and the
  applied map (A, or A1 − λA2), for chosen layers, heads and query rows.
* :class:`SpanMass`: attention mass each query puts on chosen key spans (DIFF Table 3).
* :class:`LogitStats`: streamed top-k, quantiles and moments of |logits| (DIFF Table 5).
* :class:`AttentionEntropy`: mean row entropy per head (Dex §3.2 head selection, App. B).
* :class:`LogitTransform`: change logits before the softmax (DIFF Fig 8 quantization).

Module hooks (the model runs as it would):

* :class:`HiddenStates` and :class:`HiddenStats`: each layer's output, kept or streamed.
* :class:`HeadOutputs`: what ``o_proj`` reads, per head; before and after Dex.
* :class:`HeadGates`: identity gates on head outputs, for gradient head importance.
* :class:`Lambda`: each layer's λ as its type declares it: DIFF V1's λ, DIFF V2's mean token λ.
* :class:`TokenLoss`: next-token NLL of every position.

Results accumulate over all forwards inside the probe; per-forward results are lists with one
entry per forward pass, tensors ``(B, H, rows, …)`` with rows concatenated in query order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from diffattn.attention.observe import AttentionEvent
from diffattn.probe.core import Capture, Probe
from diffattn.probe.reducers import RunningStats

IGNORE_INDEX = -100


class _PerForward:
    """Per layer, a list with one dict of row-concatenated tensors per forward pass."""

    def __init__(self) -> None:
        self.calls: dict[int, list[dict[str, list[torch.Tensor]]]] = {}

    def add(self, event: AttentionEvent, parts: dict[str, torch.Tensor]) -> None:
        """Add one block's tensors; a block starting at row 0 opens a new forward."""
        calls = self.calls.setdefault(event.layer, [])
        if event.row_start == 0 or not calls:
            calls.append({})
        for key, value in parts.items():
            calls[-1].setdefault(key, []).append(value)

    def result(self, dim: int = 2) -> dict[int, list[dict[str, torch.Tensor]]]:
        return {
            layer: [
                {k: (torch.cat(v, dim) if v[0].dim() > dim else v[0]) for k, v in call.items() if v}
                for call in calls
            ]
            for layer, calls in sorted(self.calls.items())
        }


class AttentionMaps(Capture):
    """Keep attention tensors of the chosen layers, heads and query rows.

    Args:
        what: any of ``"logits"`` (pre-softmax, scaled, ``-inf`` where masked; both maps for
            DIFF), ``"probs"`` (A, or A1 and A2), ``"applied"`` (A or A1 − λA2) and ``"lam"``.
            Keys of the result: ``logits.a``/``logits.a1``/``logits.a2``, ``probs.…``,
            ``applied``, ``lam``. Also ``"values"``: V of the call ``(B, H_kv, S, dv)``, as
            the attention received it (what effective-attention estimates need).
        keep_graph: keep the autograd graph (for gradient attribution); default detaches.
    """

    name = "attention_maps"
    WHAT = ("logits", "probs", "applied", "lam", "values")

    def __init__(self, what: Sequence[str] = ("applied",), keep_graph: bool = False, **kw):
        super().__init__(**kw)
        unknown = sorted(set(what) - set(self.WHAT))
        if unknown:
            raise ValueError(f"AttentionMaps: unknown item(s) {unknown}; choose from {self.WHAT}")
        self.what, self.keep_graph = tuple(what), keep_graph
        self.store = _PerForward()

    def needs_attention(self, layer: int) -> bool:
        return self.wants_layer(layer)

    def on_attention(self, event: AttentionEvent) -> None:
        parts: dict[str, torch.Tensor] = {}
        for item in self.what:
            if item == "applied":
                parts["applied"] = event.applied
            elif item == "lam" and event.lam is not None:
                parts["lam"] = event.lam
            elif item == "values" and event.row_start == 0:
                parts["values"] = event.values
            elif item in ("logits", "probs"):
                for name, tensor in getattr(event, item).items():
                    parts[f"{item}.{name}"] = tensor
        kept = {}
        for key, tensor in parts.items():
            if tensor.dim() == 4 and key != "values":
                tensor = self.select(event, tensor)
            if tensor is not None:
                kept[key] = tensor if self.keep_graph else tensor.detach()
        self.store.add(event, kept)

    def result(self) -> dict[int, list[dict[str, torch.Tensor]]]:
        return self.store.result()


class SpanMass(Capture):
    """Attention mass on key spans: ``Σ_{j ∈ span} M[i, j]`` per query row and head.

    Args:
        spans: ``(start, end)`` key position ranges, end exclusive.
        maps: which maps to sum: ``"applied"`` (default) and/or ``"a"``, ``"a1"``, ``"a2"``.
        absolute: sum ``|M|`` instead of ``M`` (the differential map has negative entries).

    Result: per layer, per forward, ``{map: (B, H, rows, n_spans)}``.
    """

    name = "span_mass"

    def __init__(
        self,
        spans: Sequence[tuple[int, int]],
        maps: Sequence[str] = ("applied",),
        absolute: bool = False,
        **kw,
    ):
        super().__init__(**kw)
        self.spans = [(int(a), int(b)) for a, b in spans]
        if not self.spans or any(not 0 <= a < b for a, b in self.spans):
            raise ValueError(
                f"SpanMass: spans must be (start, end) with 0 <= start < end, got {spans}"
            )
        self.maps, self.absolute = tuple(maps), absolute
        self.store = _PerForward()

    def needs_attention(self, layer: int) -> bool:
        return self.wants_layer(layer)

    def _key_weights(self, n_keys: int, device) -> torch.Tensor:
        weights = torch.zeros(n_keys, len(self.spans), device=device)
        for i, (a, b) in enumerate(self.spans):
            weights[a:b, i] = 1.0
        return weights

    def on_attention(self, event: AttentionEvent) -> None:
        weights = self._key_weights(event.applied.shape[-1], event.applied.device)
        parts = {}
        for name in self.maps:
            tensor = event.applied if name == "applied" else event.probs.get(name)
            if tensor is None:
                continue
            tensor = self.select(event, tensor.detach())
            if tensor is None:
                continue
            if self.absolute:
                tensor = tensor.abs()
            parts[name] = tensor.float() @ weights
        self.store.add(event, parts)

    def result(self) -> dict[int, list[dict[str, torch.Tensor]]]:
        return self.store.result()


def _summaries(per_layer: dict[int, RunningStats], top_k: int) -> dict[str, Any]:
    """``{"all": pooled summary, "layers": {layer: summary}}`` of per-layer statistics."""
    pooled = RunningStats.merged(list(per_layer.values()), top_k)
    return {
        "all": pooled.summary(),
        "layers": {layer: stats.summary() for layer, stats in sorted(per_layer.items())},
    }


def _valid_logits(capture: Capture, event: AttentionEvent) -> torch.Tensor:
    """``(B, 1, R, S)`` bool: allowed entries of real query rows."""
    return event.allowed & capture.real_rows(event)[:, None, :, None]


class LogitStats(Capture):
    """Streamed statistics of |attention logits| (both maps pooled for DIFF), per layer and
    over all layers: top-k, median, mean, std, max (DIFF Table 5). Only entries a real query
    may attend count; nothing of size N×N is kept."""

    name = "logit_stats"

    def __init__(self, top_k: int = 100, **kw):
        super().__init__(**kw)
        self.top_k = top_k
        self.per_layer: dict[int, RunningStats] = {}

    def needs_attention(self, layer: int) -> bool:
        return self.wants_layer(layer)

    def on_attention(self, event: AttentionEvent) -> None:
        valid = _valid_logits(self, event)
        stats = self.per_layer.setdefault(event.layer, RunningStats(top_k=self.top_k))
        for logits in event.logits.values():
            logits = logits.detach()
            if self.heads is not None:
                logits = logits[:, self.heads]
            stats.update(logits, valid)

    def result(self) -> dict[str, Any]:
        return _summaries(self.per_layer, self.top_k)


class AttentionEntropy(Capture):
    """Mean Shannon entropy (nats) of each head's attention rows over real query tokens.

    For softmax attention the rows of A; for DIFF the rows of |A1 − λA2| renormalised to sum
    to one (``map="applied"``), or of A1 or A2 (``map="a1"``/``"a2"``).
    Result: ``(n_layers, n_heads)`` fp32 (NaN for layers not watched, and for ``a1``/``a2`` at
    the softmax layers of a mixed stack, which have one map; ``n_heads`` is the most heads of a
    layer, NaN beyond a layer's own).
    """

    name = "attention_entropy"

    def __init__(self, map: str = "applied", **kw):
        super().__init__(**kw)
        self.map = map
        self.sums: dict[int, torch.Tensor] = {}
        self.rows = 0
        self._rows: dict[int, int] = {}

    def needs_attention(self, layer: int) -> bool:
        return self.wants_layer(layer)

    def on_attention(self, event: AttentionEvent) -> None:
        if self.map != "applied" and self.map not in event.probs:
            return  # a layer without this map (A1, A2 of a softmax layer in a mixed stack)
        probs = event.applied if self.map == "applied" else event.probs[self.map]
        probs = probs.detach().double()
        if "a" not in event.probs or self.map != "applied":
            probs = probs.abs()
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)
        entropy = -torch.special.xlogy(probs, probs).sum(-1)  # (B, H, R)
        real = self.real_rows(event)[:, None, :]
        entropy = torch.where(real, entropy, 0.0)
        total = self.sums.get(event.layer)
        step = entropy.sum((0, 2)).cpu()
        self.sums[event.layer] = step if total is None else total + step
        self._rows[event.layer] = self._rows.get(event.layer, 0) + int(real.sum())

    def result(self) -> torch.Tensor:
        n_layers = len(self.probe.layers)
        heads = max(t.numel() for t in self.sums.values()) if self.sums else 0
        out = torch.full((n_layers, heads), math.nan, dtype=torch.float64)
        for layer, total in self.sums.items():  # a layer with fewer heads (mixed stack): NaN
            out[layer, : total.numel()] = total / max(self._rows[layer], 1)
        return out.float()


class LogitTransform(Capture):
    """Apply ``fn(logits, allowed, layer) -> logits`` to the scaled pre-softmax logits
    ``(B, H, R, S)`` of the chosen layers. The one capture meant to change outputs."""

    name = "logit_transform"

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], **kw):
        super().__init__(**kw)
        self.fn = fn
        self.calls = 0

    def needs_attention(self, layer: int) -> bool:
        return self.wants_layer(layer)

    def transform_logits(self, layer, logits, allowed):
        if not self.wants_layer(layer):
            return None
        self.calls += 1
        return self.fn(logits, allowed, layer)

    def result(self) -> dict[str, int]:
        return {"blocks_transformed": self.calls}


# ----------------------------------------------------------------------------------------------
# module-hook captures
# ----------------------------------------------------------------------------------------------
def _output_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple | list) else output


class HiddenStates(Capture):
    """Each chosen layer's output ``(B, N, d_model)``, one per forward (detached unless
    ``keep_graph``)."""

    name = "hidden_states"

    def __init__(self, keep_graph: bool = False, **kw):
        super().__init__(**kw)
        self.keep_graph = keep_graph
        self.states: dict[int, list[torch.Tensor]] = {}

    def install(self, probe: Probe) -> list[Any]:
        return [
            view.block.register_forward_hook(self._hook(view.index))
            for view in probe.layers
            if self.wants_layer(view.index)
        ]

    def _hook(self, layer: int):
        def hook(module, args, output):
            h = _output_tensor(output)
            self.states.setdefault(layer, []).append(h if self.keep_graph else h.detach())

        return hook

    def result(self) -> dict[int, list[torch.Tensor]]:
        return dict(sorted(self.states.items()))


class HiddenStats(HiddenStates):
    """Streamed statistics of |hidden state| entries of each layer's output over real tokens
    (DIFF Table 5): top-k, median, mean, std, max per layer and pooled."""

    name = "hidden_stats"

    def __init__(self, top_k: int = 100, **kw):
        super().__init__(**kw)
        self.top_k = top_k
        self.per_layer: dict[int, RunningStats] = {}

    def _hook(self, layer: int):
        def hook(module, args, output):
            h = _output_tensor(output).detach()
            mask = self.probe.inputs.get("attention_mask")
            valid = None
            if mask is not None and mask.dim() == 2:
                valid = mask[:, -h.shape[1] :].bool().to(h.device)[..., None]
            stats = self.per_layer.setdefault(layer, RunningStats(top_k=self.top_k))
            stats.update(h, valid)

        return hook

    def result(self) -> dict[str, Any]:
        return _summaries(self.per_layer, self.top_k)


class HeadOutputs(Capture):
    """What ``o_proj`` reads, split into heads: ``(B, H, N, w)`` per layer and forward.

    Args:
        stages: ``"output"``: the attention output O; ``"dex_output"``: after every other
            pre-hook on ``o_proj`` (Dex's O' = O − λ f_D(O)). Without Dex they are equal.
    """

    name = "head_outputs"

    def __init__(self, stages: Sequence[str] = ("output",), keep_graph: bool = False, **kw):
        super().__init__(**kw)
        unknown = sorted(set(stages) - {"output", "dex_output"})
        if unknown:
            raise ValueError(f"HeadOutputs: unknown stage(s) {unknown}; use output, dex_output")
        self.stages, self.keep_graph = tuple(stages), keep_graph
        self.store: dict[int, list[dict[str, torch.Tensor]]] = {}

    def install(self, probe: Probe) -> list[Any]:
        handles = []
        for view in probe.layers:
            if not self.wants_layer(view.index):
                continue
            for stage in self.stages:
                hook = self._hook(view, stage)
                handles.append(
                    view.o_proj.register_forward_pre_hook(
                        hook, prepend=(stage == "output"), with_kwargs=True
                    )
                )
        return handles

    def _hook(self, view, stage: str):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["input"]
            heads = x.reshape(*x.shape[:-1], view.out_heads, view.out_head_dim).transpose(1, 2)
            if self.heads is not None:
                heads = heads[:, self.heads]
            calls = self.store.setdefault(view.index, [])
            if stage == self.stages[0] or not calls:
                calls.append({})
            calls[-1][stage] = heads if self.keep_graph else heads.detach()

        return hook

    def result(self) -> dict[int, list[dict[str, torch.Tensor]]]:
        return dict(sorted(self.store.items()))


class HeadGates(Capture):
    """Multiply each head's slice of the ``o_proj`` input by a gate ξ = 1 with
    ``requires_grad`` (one gate per sequence and head), so ``∂L/∂ξ`` gives the head
    importance of Michel et al. (2019). ``gates`` holds, per layer, the ``(B, H)`` gates of the
    latest forward."""

    name = "head_gates"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gates: dict[int, torch.Tensor] = {}

    def install(self, probe: Probe) -> list[Any]:
        return [
            view.o_proj.register_forward_pre_hook(self._hook(view), with_kwargs=True)
            for view in probe.layers
            if self.wants_layer(view.index)
        ]

    def _hook(self, view):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["input"]
            gate = torch.ones(x.shape[0], view.out_heads, device=x.device, requires_grad=True)
            self.gates[view.index] = gate
            shaped = x.reshape(*x.shape[:-1], view.out_heads, view.out_head_dim)
            scale = gate.to(x.dtype).view(x.shape[0], *([1] * (x.dim() - 2)), view.out_heads, 1)
            gated = (shaped * scale).reshape(x.shape)
            if args:
                return (gated, *args[1:]), kwargs
            return args, {**kwargs, "input": gated}

        return hook

    def ordered(self) -> list[torch.Tensor]:
        return [self.gates[i] for i in sorted(self.gates)]

    def result(self) -> dict[int, torch.Tensor]:
        return dict(sorted(self.gates.items()))


class Lambda(Capture):
    """λ per layer, where each layer's attention type reads it (:class:`LayerView`
    ``scalar_lambda``/``token_lambda``, from ``AttentionType.scalar_lambda``/``token_lambda``):
    DIFF V1's (and DiffLlama's) scalar λ of Eq.2, read from the parameters; DIFF V2's token-wise
    λ = sigmoid(xW_λ), summed while :attr:`enabled` and averaged.

    Result: per λ key of the layers (``AttentionType.lambda_key``): ``{"lambda": [...]}`` for
    V1/DiffLlama, ``{"lambda_mean": [...]}`` for V2 (NaN for a layer that saw no token), ``{}``
    for softmax models, one entry per layer. In a mixed stack (``ModelConfig.layer_types``) each
    key's list still has one entry per layer, NaN at the layers whose type has no such λ.
    """

    name = "lambda"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.enabled = True
        self.sums: dict[int, torch.Tensor | float] = {}
        self.counts: dict[int, int] = {}

    def install(self, probe: Probe) -> list[Any]:
        handles = []
        for view in probe.layers:
            if view.token_lambda is not None and self.wants_layer(view.index):
                module, to_lambda = view.token_lambda
                handles.append(module.register_forward_hook(self._hook(view.index, to_lambda)))
        return handles

    def _hook(self, index: int, to_lambda: Callable[[torch.Tensor], torch.Tensor]):
        def hook(module, args, output):
            if not self.enabled:
                return
            lam = to_lambda(output.detach().float())
            self.sums[index] = self.sums.get(index, 0.0) + lam.sum()
            self.counts[index] = self.counts.get(index, 0) + lam.numel()

        return hook

    def token_layers(self) -> list[int]:
        """The layers with a λ per token (DIFF V2's), in order."""
        return [v.index for v in self.probe.layers if v.token_lambda is not None]

    def scalar_layers(self) -> list[int]:
        """The layers with one λ each (DIFF V1's, DiffLlama's), in order."""
        return [v.index for v in self.probe.layers if v.scalar_lambda is not None]

    def reset(self) -> None:
        self.sums, self.counts = {}, {}

    @torch.no_grad()
    def scalar_lambdas(self) -> list[torch.Tensor]:
        """The one λ of each layer that has one (fp32, 0-d), Eq.2 for DIFF V1 / DiffLlama."""
        return [v.scalar_lambda() for v in self.probe.layers if v.scalar_lambda is not None]

    def per_layer(self, key: str, values: dict[int, float]) -> list[float]:
        """``values`` (by layer) of the layers whose λ is recorded under ``key``, one entry
        per layer of those; a stack in which other layers have no such λ gets NaN there."""
        keyed = [v.index for v in self.probe.layers if v.lambda_key == key]
        if len(keyed) < len(self.probe.layers):
            keyed = [v.index for v in self.probe.layers]
        return [values.get(i, math.nan) for i in keyed]

    def result(self) -> dict[str, list[float]]:
        values: dict[str, dict[int, float]] = {}
        scalars = iter(self.scalar_lambdas())
        for view in self.probe.layers:
            if view.scalar_lambda is not None:
                values.setdefault(view.lambda_key, {})[view.index] = float(next(scalars))
            elif view.token_lambda is not None:
                i = view.index
                mean = float(self.sums[i]) / self.counts[i] if self.counts.get(i) else math.nan
                values.setdefault(view.lambda_key, {})[i] = mean
        return {key: self.per_layer(key, found) for key, found in values.items()}


class TokenLoss(Capture):
    """Next-token NLL at every position: ``nll[b, t]`` is the loss of predicting token t + 1
    from the prefix up to t (targets from ``labels`` when given, else ``input_ids``); NaN where
    the target is ignored (-100) or padding.

    Result: ``{"nll": [(B, N − 1) per forward], "mean": float, "count": int}``.
    """

    name = "token_loss"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.nll: list[torch.Tensor] = []

    def install(self, probe: Probe) -> list[Any]:
        return [probe.view.top.register_forward_hook(self._hook)]

    def _hook(self, module, args, output):
        logits = getattr(output, "logits", None)
        if logits is None:
            logits = _output_tensor(output)
        inputs = self.probe.inputs
        targets = inputs.get("labels")
        if targets is None:
            targets = inputs.get("input_ids")
        if targets is None or targets.shape != logits.shape[:2]:
            raise ValueError("TokenLoss needs input_ids (or labels) covering every logit row")
        self.nll.append(token_nll(logits.detach(), targets, inputs.get("attention_mask")))

    def result(self) -> dict[str, Any]:
        if not self.nll:
            return {"nll": [], "mean": math.nan, "count": 0}
        values = torch.cat([n.reshape(-1) for n in self.nll])
        valid = values[~torch.isnan(values)]
        return {
            "nll": list(self.nll),
            "mean": float(valid.double().mean()) if valid.numel() else math.nan,
            "count": int(valid.numel()),
        }


def token_nll(
    logits: torch.Tensor, targets: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, N − 1)`` fp32 NLL of ``targets[:, 1:]`` under ``logits[:, :-1]``; NaN where the
    target is -100 or where the target or its predicting token is padding."""
    targets = targets[:, 1:].clone()
    if attention_mask is not None:
        mask = attention_mask[:, -logits.shape[1] :].to(targets.device)
        targets[(mask[:, 1:] == 0) | (mask[:, :-1] == 0)] = IGNORE_INDEX
    nll = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return nll.masked_fill(targets == IGNORE_INDEX, math.nan)


def layers_of(capture_layers: Iterable[int] | None, n_layers: int) -> list[int]:
    """The layer indices a capture watches, in order."""
    return list(range(n_layers)) if capture_layers is None else sorted(capture_layers)
