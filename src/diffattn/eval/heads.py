"""``diffattn eval heads``: per-head analyses of attention (Dex §2, App. B).

Measured per layer and head on a few calibration windows (``--max-tokens`` tokens cut into
``--seq-len`` windows of held-out documents, read like ``diffattn eval loss``). "The map" is
the attention map that multiplies V: A for softmax attention, A1 − λA2 for DIFF (V1, V2 and
Hugging Face DiffLlama). Only entries a real (non-padding) query may attend count.

* **Sparsity ratio** at ε = 1e-4 and 1e-6 (Dex Fig 2a/b): the share of allowed entries with
  |map| < ε.
* **Entropy** (Dex Fig 2c/d): mean row entropy in nats, of A, or of |A1 − λA2| renormalised to
  sum to one; for DIFF also of each map A1 and A2 (``a1``, ``a2``).
* **Signs** (Dex Fig 3): share of allowed entries that are positive / negative and their mean
  magnitude (negatives exist only in DIFF maps).
* **Cosine distance** between the maps of two heads of a layer (Dex Fig 5, 15, 16):
  1 − cos of the flattened maps of one window, averaged over windows.
* **Linear CKA** between the outputs of two heads of a layer (what ``o_proj`` reads; Dex Fig 5,
  17, 19): ||YᵀX||_F² / (||XᵀX||_F ||YᵀY||_F) with X, Y centered over all calibration tokens.
* **Head importance** (Michel et al.; Dex Fig 6): E|∂L/∂ξ_h| of identity head gates,
  normalised by the layer's maximum and sorted.
* **Dex** (Fig 11a), for models with Dex applied: per adapted head, the mean over tokens of
  cos(O, Δ) and of ‖Δ‖/‖O‖, with O the head output and Δ = O' − O what Dex adds.

Results per model (``results.json``): ``sparsity`` ({ε: layers × heads}), ``entropy``
({map: layers × heads}; in a mixed stack ``a1``/``a2`` are NaN at the softmax layers, listed
in ``one_map_layers``), ``positive_share``, ``negative_share``, ``positive_mean``,
``negative_mean``, ``importance`` (raw), ``importance_normalised``, ``importance_sorted``
(layers × heads), ``cosine_distance`` and ``cka`` ({layer: heads × heads}), ``dex`` (a list of
{layer, head, cosine, relative_norm}, only with Dex), ``counts``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    batches,
    finish,
    markdown_table,
    models_from_args,
    one_axes,
    panel_row,
    progress,
    save_axes,
    save_figure,
)
from diffattn.eval.text import WINDOW_BOUNDS, DataSettings, measure_windows, padded
from diffattn.eval.text import model_windows as model_windows  # importable from here too
from diffattn.probe import AttentionEntropy, Capture, HeadOutputs, Probe
from diffattn.settings import like, setting, shared, takes_settings

NAME = "heads"
HELP = "per-head sparsity, entropy, signs, redundancy (cosine, CKA), importance (Dex §2)"
EPSILONS = (1e-4, 1e-6)


@dataclass(frozen=True)
class HeadsSettings(DataSettings):
    """The settings of ``diffattn eval heads`` (and of :func:`run`, which reads no ``layer``:
    that is the figures')."""

    max_tokens: int = like(DataSettings, "max_tokens", 8192)
    batch_size: int = shared(CommonOptions, "batch_size", error=WINDOW_BOUNDS)
    seed: int = shared(CommonOptions, "seed")
    layer: int | None = setting(
        None, help="layer of the cosine-distance and CKA matrix figures (default: the middle one)"
    )


add_arguments = HeadsSettings.add_arguments


# ----------------------------------------------------------------------------------------------
# metrics: pure functions of tensors
# ----------------------------------------------------------------------------------------------
def _valid(maps: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    if allowed is None:
        return torch.ones_like(maps, dtype=torch.bool)
    return allowed.to(maps.device).expand_as(maps)


def sparsity_counts(
    maps: torch.Tensor, allowed: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head of ``maps`` ``(B, H, R, S)``: how many allowed entries have |value| < ``eps``,
    and how many allowed entries there are (``(H,)`` float64 each)."""
    valid = _valid(maps, allowed)
    below = ((maps.abs() < eps) & valid).sum((0, 2, 3)).double()
    return below, valid.sum((0, 2, 3)).double()


def sparsity_ratio(maps: torch.Tensor, allowed: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``(H,)``: share of the allowed entries of each head's map with |value| < ``eps``."""
    below, total = sparsity_counts(maps, allowed, eps)
    return below / total.clamp_min(1)


def sign_sums(maps: torch.Tensor, allowed: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Per head: counts and summed magnitudes of positive and negative allowed entries, and
    the number of allowed entries (``(H,)`` float64 each)."""
    valid = _valid(maps, allowed)
    pos = (maps > 0) & valid
    neg = (maps < 0) & valid
    m = maps.double()
    return {
        "positive_count": pos.sum((0, 2, 3)).double(),
        "negative_count": neg.sum((0, 2, 3)).double(),
        "positive_sum": torch.where(pos, m, 0.0).sum((0, 2, 3)),
        "negative_sum": torch.where(neg, -m, 0.0).sum((0, 2, 3)),
        "total": valid.sum((0, 2, 3)).double(),
    }


def sign_shares(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shares and mean magnitudes from :func:`sign_sums` (NaN mean where no such entry)."""
    total = sums["total"].clamp_min(1)
    out = {}
    for sign in ("positive", "negative"):
        count = sums[f"{sign}_count"]
        out[f"{sign}_share"] = count / total
        out[f"{sign}_mean"] = torch.where(
            count > 0, sums[f"{sign}_sum"] / count.clamp_min(1), math.nan
        )
    return out


def gram(maps: torch.Tensor) -> torch.Tensor:
    """``(…, H, H)`` inner products of the heads' flattened maps, ``maps`` ``(…, H, R, S)``."""
    flat = maps.double().flatten(-2)
    return flat @ flat.transpose(-1, -2)


def cosine_distance_from_gram(g: torch.Tensor) -> torch.Tensor:
    norms = g.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()
    denom = (norms[..., :, None] * norms[..., None, :]).clamp_min(1e-300)
    return 1.0 - g / denom


def cosine_distance(maps: torch.Tensor) -> torch.Tensor:
    """``(H, H)``: 1 − cosine similarity between the heads' maps, ``maps`` ``(H, …)`` (each
    head's map flattened)."""
    flat = maps.double().reshape(maps.shape[0], -1)
    return cosine_distance_from_gram(flat @ flat.T)


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of ``x`` ``(N, d1)`` and ``y`` ``(N, d2)``: ||YᵀX||_F² / (||XᵀX||_F ||YᵀY||_F),
    both centered over the N rows."""
    x = x.double() - x.double().mean(0)
    y = y.double() - y.double().mean(0)
    cross = torch.linalg.matrix_norm(y.T @ x) ** 2
    return float(cross / (torch.linalg.matrix_norm(x.T @ x) * torch.linalg.matrix_norm(y.T @ y)))


def cka_from_moments(
    second: torch.Tensor, first: torch.Tensor, count: int, heads: int
) -> torch.Tensor:
    """``(H, H)`` linear CKA between head blocks from streamed moments of the concatenated
    head outputs: ``second`` = Σ xxᵀ ``(d, d)``, ``first`` = Σ x ``(d,)`` over ``count`` tokens."""
    mean = first / count
    cov = second - count * torch.outer(mean, mean)
    width = cov.shape[0] // heads
    blocks = cov.reshape(heads, width, heads, width).transpose(1, 2)  # (H, H, w, w)
    norms = torch.linalg.matrix_norm(blocks)  # ||X_gᵀ X_h||_F
    diag = norms.diagonal()
    return norms**2 / (diag[:, None] * diag[None, :]).clamp_min(1e-300)


def cka_matrix(outputs: torch.Tensor) -> torch.Tensor:
    """``(H, H)`` linear CKA between heads, ``outputs`` ``(H, N, w)`` (N tokens)."""
    x = outputs.double().transpose(0, 1).reshape(outputs.shape[1], -1)  # (N, H·w)
    return cka_from_moments(x.T @ x, x.sum(0), x.shape[0], outputs.shape[0])


def dex_shift(o: torch.Tensor, o_dex: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the mean over tokens of cos(O, Δ) and of ‖Δ‖/‖O‖ with Δ = O' − O; ``o`` and
    ``o_dex`` ``(H, N, w)``. Returns two ``(H,)`` float64 tensors."""
    o, delta = o.double(), (o_dex.double() - o.double())
    cos = torch.nn.functional.cosine_similarity(o, delta, dim=-1, eps=1e-30)
    ratio = delta.norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-30)
    return cos.mean(-1), ratio.mean(-1)


# ----------------------------------------------------------------------------------------------
# streaming over calibration windows
# ----------------------------------------------------------------------------------------------
class HeadMapStats(Capture):
    """Sparsity counts, sign sums and per-window map Gram matrices of the applied map, per
    layer (real query rows only)."""

    name = "head_map_stats"

    def __init__(self, epsilons: Sequence[float] = EPSILONS, **kw):
        super().__init__(**kw)
        self.epsilons = tuple(epsilons)
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.current: dict[int, torch.Tensor] = {}
        self.distance: dict[int, torch.Tensor] = {}
        self.windows: dict[int, int] = {}

    def needs_attention(self, layer: int) -> bool:
        return self.wants_layer(layer)

    def _add(self, layer: int, parts: dict[str, torch.Tensor]) -> None:
        sums = self.sums.setdefault(layer, {})
        for key, value in parts.items():
            sums[key] = value if key not in sums else sums[key] + value

    def _flush(self, layer: int) -> None:
        g = self.current.pop(layer, None)
        if g is None:
            return
        distance = cosine_distance_from_gram(g).sum(0)
        previous = self.distance.get(layer)
        self.distance[layer] = distance if previous is None else previous + distance
        self.windows[layer] = self.windows.get(layer, 0) + g.shape[0]

    def on_attention(self, event) -> None:
        maps = event.applied.detach().float()
        valid = event.allowed & self.real_rows(event)[:, None, :, None]
        parts: dict[str, torch.Tensor] = dict(sign_sums(maps, valid))
        for eps in self.epsilons:
            parts[f"below_{eps:g}"] = sparsity_counts(maps, valid, eps)[0]
        self._add(event.layer, {k: v.cpu() for k, v in parts.items()})
        if event.row_start == 0:
            self._flush(event.layer)
        step = gram(torch.where(valid, maps, 0.0)).cpu()
        self.current[event.layer] = step + self.current.get(event.layer, 0.0)

    def result(self) -> dict[str, Any]:
        for layer in list(self.current):
            self._flush(layer)
        out: dict[str, Any] = {"layers": sorted(self.sums)}
        for layer in out["layers"]:
            sums = self.sums[layer]
            total = sums["total"].clamp_min(1)
            entry: dict[str, Any] = {
                f"{eps:g}": sums[f"below_{eps:g}"] / total for eps in self.epsilons
            }
            entry.update(sign_shares(sums))
            entry["cosine_distance"] = self.distance[layer] / max(self.windows[layer], 1)
            out[layer] = entry
        return out


class _OutputMoments:
    """Streamed Σxxᵀ, Σx and token count of each layer's concatenated head outputs, and the
    Dex shift sums, read from :class:`~diffattn.probe.HeadOutputs` after every forward."""

    def __init__(self) -> None:
        self.second: dict[int, torch.Tensor] = {}
        self.first: dict[int, torch.Tensor] = {}
        self.count: dict[int, int] = {}
        self.heads: dict[int, int] = {}
        self.dex: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, capture: HeadOutputs, mask: torch.Tensor) -> None:
        real = mask.bool()
        for layer, calls in capture.store.items():
            for call in calls:
                o = call["output"]  # (B, H, N, w)
                tokens = o.transpose(1, 2)[real[:, -o.shape[2] :]].double().cpu()  # (T, H, w)
                x = tokens.reshape(tokens.shape[0], -1)
                self.heads[layer] = o.shape[1]
                self.second[layer] = x.T @ x + self.second.get(layer, 0.0)
                self.first[layer] = x.sum(0) + self.first.get(layer, 0.0)
                self.count[layer] = self.count.get(layer, 0) + x.shape[0]
                if "dex_output" in call:
                    after = call["dex_output"].transpose(1, 2)[real[:, -o.shape[2] :]]
                    after = after.double().cpu().transpose(0, 1)
                    cos, ratio = dex_shift(tokens.transpose(0, 1), after)
                    n = tokens.shape[0]
                    delta = (after - tokens.transpose(0, 1)).abs().amax((1, 2))
                    sums = self.dex.setdefault(layer, {})
                    for key, value in (("cos", cos * n), ("ratio", ratio * n), ("max", delta)):
                        old = sums.get(key)
                        if key == "max":
                            sums[key] = value if old is None else torch.maximum(old, value)
                        else:
                            sums[key] = value if old is None else old + value
                    sums["n"] = sums.get("n", 0) + n
        capture.store.clear()

    def cka(self) -> dict[int, torch.Tensor]:
        return {
            layer: cka_from_moments(
                self.second[layer], self.first[layer], self.count[layer], self.heads[layer]
            )
            for layer in sorted(self.second)
        }

    def dex_points(self) -> list[dict[str, Any]]:
        points = []
        for layer, sums in sorted(self.dex.items()):
            for head in range(sums["cos"].numel()):
                if float(sums["max"][head]) == 0.0:  # a head Dex does not adapt
                    continue
                points.append(
                    {
                        "layer": layer,
                        "head": head,
                        "cosine": float(sums["cos"][head] / sums["n"]),
                        "relative_norm": float(sums["ratio"][head] / sums["n"]),
                    }
                )
        return points


def _is_dex(model: torch.nn.Module) -> bool:
    from diffattn.dex import is_dex

    return bool(is_dex(model))


def _stack(per_layer: dict[int, torch.Tensor], n_layers: int) -> torch.Tensor:
    width = max(v.numel() for v in per_layer.values())
    out = torch.full((n_layers, width), math.nan, dtype=torch.float64)
    for layer, value in per_layer.items():
        out[layer, : value.numel()] = value.double()
    return out


def importance_figures(model: EvalModel, groups: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """Raw, per-layer max-normalised and sorted (descending) head importance."""
    from diffattn.probe.analysis import head_importance

    raw = head_importance(model.model, groups)
    if not raw.isnan().any():
        normalised = raw / raw.amax(1, keepdim=True).clamp_min(1e-30)
        return raw, normalised, normalised.sort(1, descending=True).values
    # a mixed stack: rows NaN-padded beyond a layer's heads, which stay last when sorted
    normalised = raw / raw.nan_to_num(0.0).amax(1, keepdim=True).clamp_min(1e-30)
    ordered = normalised.nan_to_num(-math.inf).sort(1, descending=True).values
    return raw, normalised, ordered.masked_fill(ordered == -math.inf, math.nan)


@torch.no_grad()
def _streamed(model: EvalModel, groups, quiet: bool) -> dict[str, Any]:
    from diffattn.probe.models import view

    layers = view(model.model).layers
    differential = [layer.index for layer in layers if layer.differential]
    maps = ["applied", "a1", "a2"] if differential else ["applied"]
    entropies = {m: AttentionEntropy(map=m) for m in maps}
    stats = HeadMapStats()
    dex = _is_dex(model.model)
    outputs = HeadOutputs(stages=("output", "dex_output") if dex else ("output",))
    moments = _OutputMoments()
    with Probe(model.model, [*entropies.values(), stats, outputs]):
        for ids, mask in progress(groups, len(groups), f"heads {model.name}", quiet):
            model.model(**model.window_inputs(ids, mask))
            moments.add(outputs, mask.cpu())
    return {
        "entropy": {m: e.result() for m, e in entropies.items()},
        "maps": stats.result(),
        "cka": moments.cka(),
        "dex": moments.dex_points() if dex else None,
        "n_layers": len(layers),
        "one_map_layers": [v.index for v in layers if differential and not v.differential],
    }


def analyse_model(
    model: EvalModel, pieces: Sequence[Sequence[int]], batch_size: int, quiet: bool = True
) -> dict[str, Any]:
    """Every per-head figure of ``model`` on the calibration windows ``pieces``."""
    groups = [padded(group, model.device) for group in batches(pieces, batch_size)]
    streamed = _streamed(model, groups, quiet)
    n_layers, per_map = streamed["n_layers"], streamed["maps"]
    layers = per_map["layers"]

    def table(key: str) -> torch.Tensor:
        return _stack({layer: per_map[layer][key] for layer in layers}, n_layers)

    entry: dict[str, Any] = {
        "n_layers": n_layers,
        "sparsity": {f"{eps:g}": table(f"{eps:g}") for eps in EPSILONS},
        "entropy": streamed["entropy"],
    }
    for key in ("positive_share", "negative_share", "positive_mean", "negative_mean"):
        entry[key] = table(key)
    entry["cosine_distance"] = {layer: per_map[layer]["cosine_distance"] for layer in layers}
    entry["cka"] = streamed["cka"]
    raw, normalised, ordered = importance_figures(model, groups)
    entry.update(importance=raw, importance_normalised=normalised, importance_sorted=ordered)
    if streamed["dex"] is not None:
        entry["dex"] = streamed["dex"]
    if streamed["one_map_layers"]:  # a mixed stack: its softmax layers have no A1, A2
        entry["one_map_layers"] = streamed["one_map_layers"]
    entry["counts"] = {
        "windows": len(pieces),
        "tokens": sum(len(p) for p in pieces),
    }
    return entry


@takes_settings(HeadsSettings)
def run(models: Sequence[EvalModel], settings: HeadsSettings, quiet: bool) -> dict[str, Any]:
    """Per-head analyses of every model on the same documents (see the module docstring);
    ``settings``, or its fields by name (``run(models, seq_len=256)``)."""

    def measure(model: EvalModel, pieces: list[list[int]]) -> dict[str, Any]:
        return analyse_model(model, pieces, settings.batch_size, quiet)

    results = measure_windows(models, settings, settings.seed, measure)
    results["epsilons"] = [f"{eps:g}" for eps in EPSILONS]  # after "data_fingerprint"
    return results


# ----------------------------------------------------------------------------------------------
# figures and report
# ----------------------------------------------------------------------------------------------
def _integer_ticks(ax: Any, shape: Sequence[int]) -> None:
    """Ticks at whole row and column indices (at most about 16 of each)."""
    for axis, n in ((ax.yaxis, shape[0]), (ax.xaxis, shape[1])):
        axis.set_ticks(range(0, n, max(1, math.ceil(n / 16))))


def _plot_panels(
    panels: Sequence[tuple[str, Any]], title: str, ylabel: str, path: Path, **imshow: Any
) -> Path | None:
    """One image per ``(name, matrix)`` panel, heads along x and ``ylabel`` along y, each with
    its colour bar; ``None`` without panels."""
    if not panels:
        return None
    fig, axes = panel_row(len(panels), title, (4.0 * len(panels) + 1, 4.0))
    for ax, (name, value) in zip(axes, panels, strict=True):
        value = torch.as_tensor(value).double()
        image = ax.imshow(value.numpy(), **imshow)
        _integer_ticks(ax, value.shape)
        ax.set_xlabel("head")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        fig.colorbar(image, ax=ax)
    return save_figure(fig, path)


def plot_heatmaps(results: dict[str, Any], key: str, sub: str | None, title: str, path: Path):
    """Layer × head heatmap of ``results["models"][*][key]`` (``[sub]``), one panel per model."""
    panels = []
    for name, entry in results["models"].items():
        value = entry.get(key)
        if value is not None and sub is not None:
            value = value.get(sub)
        if value is not None:
            panels.append((name, torch.as_tensor(value, dtype=torch.float64)))
    return _plot_panels(panels, title, "layer", path, aspect="auto", cmap="viridis")


def plot_matrices(results: dict[str, Any], key: str, layer: int, title: str, path: Path):
    """Head × head matrix of one layer, one panel per model."""
    panels = [
        (name, entry[key][layer])
        for name, entry in results["models"].items()
        if layer in entry[key]
    ]
    return _plot_panels(panels, f"{title}, layer {layer}", "head", path, cmap="magma", vmin=0.0)


def plot_dex(results: dict[str, Any], path: Path):
    """cos(O, Δ) against ‖Δ‖/‖O‖ per adapted head (Dex Fig 11a)."""
    series = {n: e["dex"] for n, e in results["models"].items() if e.get("dex")}
    if not series:
        return None
    fig, ax = one_axes(figsize=(5, 4))
    for name, points in series.items():
        ax.scatter([p["relative_norm"] for p in points], [p["cosine"] for p in points], label=name)
    return save_axes(
        fig, ax, path, "What Dex adds to each adapted head (Dex Fig 11a)", "‖Δ‖ / ‖O‖", "cos(O, Δ)"
    )


def _mean_off_diagonal(matrix: torch.Tensor) -> float:
    m = torch.as_tensor(matrix, dtype=torch.float64)
    n = m.shape[0]
    if n < 2:
        return math.nan
    return float((m.sum() - m.diagonal().sum()) / (n * (n - 1)))


def report(results: dict[str, Any]) -> str:
    parts = []
    for name, entry in results["models"].items():
        rows = []
        for layer in range(entry["n_layers"]):
            importance = entry.get("importance_normalised")
            rows.append(
                (
                    layer,
                    float(torch.nanmean(entry["sparsity"]["0.0001"][layer])),
                    float(torch.nanmean(entry["sparsity"]["1e-06"][layer])),
                    float(torch.nanmean(entry["entropy"]["applied"][layer].double())),
                    float(torch.nanmean(entry["negative_share"][layer])),
                    _mean_off_diagonal(entry["cosine_distance"].get(layer, torch.zeros(1, 1))),
                    _mean_off_diagonal(entry["cka"].get(layer, torch.zeros(1, 1))),
                    float(importance[layer].min()) if importance is not None else math.nan,
                )
            )
        parts.append(
            f"### {name}\n\nMeans over the heads of each layer.\n\n"
            + markdown_table(
                [
                    "layer",
                    "sparsity ε=1e-4",
                    "sparsity ε=1e-6",
                    "entropy",
                    "negative share",
                    "cos. distance",
                    "CKA",
                    "min norm. importance",
                ],
                rows,
            )
        )
        if entry.get("one_map_layers"):
            parts.append(
                f"Layers {', '.join(map(str, entry['one_map_layers']))} are softmax layers of a "
                "mixed stack: one map A, so their entropies of A1 and A2 are NaN (the entropy "
                "above is of A there).\n"
            )
        if entry.get("dex"):
            parts.append(
                "Dex (Fig 11a), per adapted head:\n\n"
                + markdown_table(
                    ["layer", "head", "cos(O, Δ)", "‖Δ‖/‖O‖"],
                    [
                        (p["layer"], p["head"], p["cosine"], p["relative_norm"])
                        for p in entry["dex"]
                    ],
                )
            )
    return (
        "## Per-head analyses (Dex §2, App. B)\n\n"
        + "\n".join(parts)
        + "\nEntropy in nats (of |A1 − λA2| renormalised for DIFF); cosine distance and CKA are "
        "the mean over pairs of distinct heads; importance is normalised by the layer's "
        "largest.\n"
    )


def main(args: Any) -> int:
    from diffattn.probe.models import view

    settings = HeadsSettings.from_args(args)
    models = models_from_args(args)
    n_layers = min(len(view(m.model).layers) for m in models)
    layer = n_layers // 2 if settings.layer is None else settings.layer
    if not 0 <= layer < n_layers:
        raise ValueError(f"--layer must be between 0 and {n_layers - 1}, got {layer}")
    settings = replace(settings, layer=layer)
    results = run(models, settings, quiet=args.quiet)
    out = Path(args.out)
    figures = [
        plot_heatmaps(
            results, "entropy", "applied", "Attention entropy (nats)", out / "entropy.png"
        ),
        plot_heatmaps(
            results, "sparsity", "0.0001", "Sparsity ratio, ε = 1e-4", out / "sparsity.png"
        ),
        plot_heatmaps(
            results,
            "importance_normalised",
            None,
            "Head importance / layer max",
            out / "importance.png",
        ),
        plot_matrices(
            results,
            "cosine_distance",
            layer,
            "Cosine distance of maps",
            out / "cosine_distance.png",
        ),
        plot_matrices(results, "cka", layer, "Linear CKA of head outputs", out / "cka.png"),
        plot_dex(results, out / "dex_shift.png"),
    ]
    return finish(args, NAME, results, models, report(results), settings.report(), figures)
