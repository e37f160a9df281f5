"""Head selection for Dex (paper §3.2): which heads of each layer get the differential map.

Two data-driven scores per head, measured on calibration token batches:

* ``importance``: the gradient-based head importance of Michel et al. (2019), ref. [59] of the
  Dex paper. A gate ξ_h = 1 multiplies head h's slice of the ``o_proj`` input and
  I_h = E_x |∂L(x)/∂ξ_h|, the mean over calibration sequences of the absolute derivative of
  that sequence's next-token loss. Each sequence gets its own gates, so one backward pass
  yields the per-sequence derivatives. Dex adapts the *least* important heads (``order="low"``).
* ``entropy``: the mean Shannon entropy (nats) of each head's attention rows,
  −Σ_j A_ij log A_ij, over real query tokens. Dex adapts the *highest*-entropy heads
  (``order="high"``, the paper's best setting, Tab. 4; ``"low"`` is its ablation).

Both take the top k per layer, by default half of the heads (§4.1, App. B.4). ``"all"``
selects every head, and an explicit ``{layer: [heads]}`` mapping any subset.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.dex.sites import AttentionSite, find_attention
from diffattn.probe import AttentionEntropy, Probe, eval_mode
from diffattn.probe.analysis import head_importance as probe_head_importance

METHODS = ("importance", "entropy", "all", "explicit")
DEFAULT_ORDER = {"importance": "low", "entropy": "high"}
DEFAULT_METHOD = "entropy"
"""The head selection used unless one is named: the highest-entropy heads, the best of Dex's
ablation (Table 4)."""


@dataclass
class HeadSelection:
    """Selected heads per layer, with the scores they were chosen by.

    Attributes:
        heads: layer index → sorted tuple of selected head indices (layers without a selected
            head are absent).
        n_heads: number of heads of each layer (index = layer).
        method: ``"importance"``, ``"entropy"``, ``"all"`` or ``"explicit"``.
        order: ``"high"`` or ``"low"`` for scored selections, else ``None``.
        k: heads per layer for scored selections, else ``None``.
        scores: per layer, one score per head (scored selections), else ``None``.
    """

    heads: dict[int, tuple[int, ...]]
    n_heads: list[int]
    method: str = "explicit"
    order: str | None = None
    k: int | None = None
    scores: list[list[float]] | None = field(default=None, repr=False)

    @property
    def n_layers(self) -> int:
        return len(self.n_heads)

    @property
    def num_selected(self) -> int:
        return sum(len(h) for h in self.heads.values())

    def format_table(self) -> str:
        """A per-layer table: selected heads and, when scored, every head's score
        (``*`` marks a selected head)."""
        title = f"Dex head selection: {self.method}"
        if self.order is not None:
            title += f", {self.order} first, k={self.k}"
        lines = [title, f"{'layer':>5}  {'selected':<24}  scores"]
        for layer, n in enumerate(self.n_heads):
            chosen = self.heads.get(layer, ())
            text = ",".join(map(str, chosen)) if chosen else "-"
            cells = ""
            if self.scores is not None:
                cells = " ".join(
                    f"{h}:{s:.4g}{'*' if h in chosen else ''}"
                    for h, s in enumerate(self.scores[layer])
                )
            lines.append(f"{layer:>5}  {f'{text} ({len(chosen)}/{n})':<24}  {cells}".rstrip())
        lines.append(f"total: {self.num_selected} of {sum(self.n_heads)} heads")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "heads": {str(layer): list(h) for layer, h in sorted(self.heads.items())},
            "n_heads": list(self.n_heads),
            "method": self.method,
            "order": self.order,
            "k": self.k,
            "scores": self.scores,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeadSelection:
        try:
            n_heads = [int(n) for n in data["n_heads"]]
            heads = {int(layer): tuple(int(h) for h in hs) for layer, hs in data["heads"].items()}
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a Dex head selection: {error}") from None
        selection = cls(
            heads=heads,
            n_heads=n_heads,
            method=data.get("method", "explicit"),
            order=data.get("order"),
            k=data.get("k"),
            scores=data.get("scores"),
        )
        _validate_mapping(selection.heads, selection.n_heads)
        return selection

    def save(self, path: str | Path) -> Path:
        """Write the selection as JSON."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> HeadSelection:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _validate_mapping(heads: Mapping[Any, Any], n_heads: list[int]) -> dict[int, tuple[int, ...]]:
    """Check an explicit ``{layer: [heads]}``; one clear ``ValueError`` per bad entry."""
    n_layers = len(n_heads)
    out: dict[int, tuple[int, ...]] = {}
    for layer, chosen in heads.items():
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer keys must be integers, got {layer!r}")
        if not 0 <= layer < n_layers:
            raise ValueError(
                f"layer {layer} does not exist: the model has {n_layers} attention layers "
                f"(0-{n_layers - 1})"
            )
        if isinstance(chosen, str | bytes) or not isinstance(chosen, Iterable):
            raise ValueError(f"layer {layer}: expected a list of head indices, got {chosen!r}")
        chosen = list(chosen)
        n = n_heads[layer]
        if len(chosen) > n:
            raise ValueError(
                f"layer {layer}: {len(chosen)} heads selected but the layer has {n} heads"
            )
        for h in chosen:
            if isinstance(h, bool) or not isinstance(h, int):
                raise ValueError(f"layer {layer}: head indices must be integers, got {h!r}")
            if not 0 <= h < n:
                raise ValueError(
                    f"layer {layer}: head {h} is out of range; the layer has {n} heads (0-{n - 1})"
                )
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"layer {layer}: a head is selected twice in {chosen}")
        if chosen:
            out[layer] = tuple(sorted(chosen))
    if not out:
        raise ValueError("no heads selected: every layer's list is empty")
    return out


def resolve_heads(sites: list[AttentionSite], heads: Any) -> HeadSelection:
    """Turn ``"all"``, a :class:`HeadSelection` or a ``{layer: [heads]}`` mapping into a
    validated :class:`HeadSelection` for these attention layers."""
    n_heads = [s.n_heads for s in sites]
    if isinstance(heads, str):
        if heads != "all":
            raise ValueError(
                f"heads must be 'all', a HeadSelection (see select_heads) or a "
                f"{{layer: [heads]}} mapping, got {heads!r}"
            )
        return HeadSelection({i: tuple(range(n)) for i, n in enumerate(n_heads)}, n_heads, "all")
    if isinstance(heads, HeadSelection):
        if list(heads.n_heads) != n_heads:
            raise ValueError(
                f"the head selection was made for layers with {heads.n_heads} heads, "
                f"but this model's attention layers have {n_heads} heads"
            )
        _validate_mapping(heads.heads, n_heads)
        return heads
    if isinstance(heads, Mapping):
        return HeadSelection(_validate_mapping(heads, n_heads), n_heads, "explicit")
    raise ValueError(
        f"heads must be 'all', a HeadSelection or a {{layer: [heads]}} mapping, "
        f"got {type(heads).__name__}"
    )


# --- calibration batches ---------------------------------------------------------------------
def _batches(batches: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(input_ids, attention_mask) pairs from a tensor, a dict or an iterable of either."""
    if isinstance(batches, torch.Tensor | Mapping):
        batches = [batches]
    out = []
    for batch in batches:
        if isinstance(batch, Mapping):
            ids, mask = batch["input_ids"], batch.get("attention_mask")
        else:
            ids, mask = batch, None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError("calibration batches must be (batch, seq_len) token id tensors")
        out.append((ids, mask))
    if not out:
        raise ValueError("no calibration batches given")
    return out


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def head_importance(model: nn.Module, batches: Any) -> torch.Tensor:
    """Michel et al. (2019) importance, ``(n_layers, n_heads)``: E_x |∂L(x)/∂ξ_h| (fp32).

    ``batches``: a ``(B, N)`` tensor, a ``{"input_ids", "attention_mask"}`` dict, or an
    iterable of either. The gates ξ come from the capture probe's
    :class:`~diffattn.probe.HeadGates`. Model weights receive no gradients.
    """
    sites = find_attention(model)
    _same_head_count(sites)
    device = _device(model)
    on_device = (
        (ids.to(device), mask.to(device) if mask is not None else None)
        for ids, mask in _batches(batches)
    )
    return probe_head_importance(model, on_device).float()


@torch.no_grad()
def attention_entropy(model: nn.Module, batches: Any) -> torch.Tensor:
    """Mean attention entropy (nats) of every head, ``(n_layers, n_heads)`` (fp32).

    The rows of real query tokens are averaged over all calibration sequences; the maps are
    streamed through the capture probe's :class:`~diffattn.probe.AttentionEntropy`, so no
    layer's N×N maps are kept.
    """
    sites = find_attention(model)
    _same_head_count(sites)
    device = _device(model)
    entropy = AttentionEntropy()
    with eval_mode(model), Probe(model, [entropy]):
        for ids, mask in _batches(batches):
            ids = ids.to(device)
            mask = mask.to(device) if mask is not None else None
            model(input_ids=ids, attention_mask=mask)
    return entropy.result()


def _same_head_count(sites: list[AttentionSite]) -> None:
    counts = {s.n_heads for s in sites}
    if len(counts) != 1:
        raise ValueError(f"head scores need the same head count in every layer, got {counts}")


def _top_k(scores: torch.Tensor, k: int, order: str) -> dict[int, tuple[int, ...]]:
    picked = {}
    for layer, row in enumerate(scores):
        # stable sort: ties go to the lower head index
        idx = torch.sort(row, descending=(order == "high"), stable=True).indices[:k]
        picked[layer] = tuple(sorted(int(i) for i in idx))
    return picked


def select_heads(
    model: nn.Module,
    batches: Any = None,
    method: str = DEFAULT_METHOD,
    k: int | float | None = None,
    order: str | None = None,
) -> HeadSelection:
    """Select heads per layer (§3.2): the top ``k`` by ``method`` score, or ``"all"``.

    Args:
        model: a supported decoder (see :mod:`diffattn.dex.sites`).
        batches: calibration token ids (tensor, dict or iterable of them); not needed for
            ``"all"``.
        method: ``"entropy"`` (default, the paper's best), ``"importance"`` or ``"all"``.
        k: heads per layer: an int, a fraction in (0, 1], or ``None`` for half the heads.
        order: ``"high"`` or ``"low"`` scores first; default ``"high"`` for entropy and
            ``"low"`` for importance, as in the paper.
    """
    sites = find_attention(model)
    n_heads = [s.n_heads for s in sites]
    if method == "all":
        return resolve_heads(sites, "all")
    if method not in DEFAULT_ORDER:
        raise ValueError(f"method must be 'entropy', 'importance' or 'all', got {method!r}")
    order = DEFAULT_ORDER[method] if order is None else order
    if order not in ("high", "low"):
        raise ValueError(f"order must be 'high' or 'low', got {order!r}")
    n = n_heads[0]
    if k is None:
        k = max(1, n // 2)
    elif isinstance(k, float) and 0 < k <= 1:
        k = max(1, round(k * n))
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in 1..{n} or a fraction in (0, 1], got {k!r}")
    if batches is None:
        raise ValueError(f"method={method!r} needs calibration batches of token ids")
    if method == "importance":
        scores = head_importance(model, batches)
    else:
        scores = attention_entropy(model, batches)
    return HeadSelection(
        heads=_top_k(scores, k, order),
        n_heads=n_heads,
        method=method,
        order=order,
        k=k,
        scores=[[float(v) for v in row] for row in scores],
    )
