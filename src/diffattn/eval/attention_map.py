"""``diffattn eval attention``: the attention picture of any model on your own prompt.

For a prompt (text through the model's tokenizer, or token ids), this draws the maps the
probe observes (:class:`~diffattn.probe.AttentionMaps`) over the prompt's tokens, for chosen
layers and heads:

* differential layers (DIFF V1 Eq.1, DIFF V2, Hugging Face DiffLlama): the two softmax maps
  A1 and A2 and the map that multiplies V, A1 − λA2 (DIFF V1 Eq.1; V2's λ is one value per
  token and head, so the row of query i is A1[i] − λ_i A2[i]);
* softmax layers (the Transformer baseline, Llama, Qwen2, Mistral, and those with Dex applied,
  which changes head outputs, not maps: ``diffattn eval effective`` estimates Dex's effective
  attention): the map A.

Two views: **row** (the attention of chosen query positions over every token before them, as
the papers' Figure 1 shows it) and **heatmap** (the whole causal map of every query). Tokens
label the axes; past ``max_labels`` tokens only every k-th is labelled (and the query), and the
figure says so.

``attention_maps.json`` holds, per model, the tokens and their ids, and per layer and head the
maps of the kept query rows over all tokens (``query_positions`` × prompt length, 0 above the
causal diagonal) exactly as the probe returns them (fp32 values written with the fewest digits
that read back as the same fp32 number), and λ. ``results.json`` holds the settings, the
tokens, and per layer, head and query λ and the three most attended tokens. Python::

    from diffattn.eval.attention_map import capture_maps, plot_rows
    maps = capture_maps(model, ids, layers=[1], heads=[0], queries=[-1])
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.eval.common import (
    EvalModel,
    finish,
    markdown_table,
    models_from_args,
    pyplot,
    save_figure,
)
from diffattn.loading import TextTokenizer
from diffattn.settings import Settings, setting

LAST_QUERY = (-1,)
"""The query rows a map shows by default: the last token's."""
MAX_LABELS = 48
"""The most token labels a heatmap axis shows (more are thinned out)."""
NAME = "attention"
HELP = "draw A1, A2 and A1 − λA2 (or A) over the tokens of your own prompt (DIFF V1 Fig 1)"
VIEWS = ("row", "heatmap", "both")
DIFF_MAPS = ("a1", "a2", "applied")
CLIP_PERCENTILE = 99.0
"""Heatmap colour scales end at this percentile of the causal entries' magnitudes."""
MAPS_NAME = "attention_maps.json"
MAP_TITLES = {"a": "A", "a1": "A1", "a2": "A2", "applied": "A1 − λA2"}


@dataclass
class LayerMaps:
    """What the probe saw in one layer for one prompt.

    Attributes:
        layer: 0-based layer index.
        kind: ``"softmax"``, ``"diff_v1"``, ``"diff_v2"`` or ``"diffllama"``.
        heads: the head indices kept (heads of the map that multiplies V).
        queries: the query positions kept, ascending.
        maps: ``"a"`` (softmax) or ``"a1"``, ``"a2"``, ``"applied"`` (DIFF) →
            ``(len(heads), len(queries), n_tokens)`` fp32 on CPU.
        lam: DIFF V1 / DiffLlama: 0-d λ (Eq.2); DIFF V2: ``(len(heads), len(queries))``
            λ of each head and query token; softmax: ``None``.
    """

    layer: int
    kind: str
    heads: list[int]
    queries: list[int]
    maps: dict[str, torch.Tensor]
    lam: torch.Tensor | None

    @property
    def differential(self) -> bool:
        return "applied" in self.maps


def parse_indices(text: str | None, option: str) -> list[int] | None:
    """``"0,3"`` → ``[0, 3]``; ``None`` or ``"all"`` → ``None`` (every index)."""
    if text is None or text.strip().lower() == "all":
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"{option}: expected comma-separated integers or 'all', got {text!r}"
        ) from None
    if not values:
        raise ValueError(f"{option}: expected comma-separated integers or 'all', got {text!r}")
    return values


def resolve_selection(
    model: nn.Module,
    n_tokens: int,
    layers: Sequence[int] | None,
    heads: Sequence[int] | None,
    queries: Sequence[int] | None,
) -> tuple[list[int], list[int] | None, list[int] | None]:
    """Check layers, heads and query positions against ``model`` and the prompt; return the
    layers, heads (``None``: all) and absolute query positions (``None``: all), or
    ``ValueError`` naming the option at fault. Negative query positions count from the end."""
    from diffattn.probe.models import view

    if n_tokens < 1:
        raise ValueError("the prompt has no tokens")
    views = view(model).layers
    n = len(views)
    chosen = list(range(n)) if layers is None else sorted(set(layers))
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise ValueError(f"--layers {bad}: the model has {n} layers (0-{n - 1})")
    if heads is not None:
        heads = sorted(set(heads))
        for i in chosen:
            count = views[i].out_heads
            wrong = [h for h in heads if not 0 <= h < count]
            if wrong:
                raise ValueError(f"--heads {wrong}: layer {i} has {count} heads (0-{count - 1})")
    if queries is not None:
        wrong = [q for q in queries if not -n_tokens <= q < n_tokens]
        if wrong:
            raise ValueError(
                f"--query {wrong}: the prompt has {n_tokens} tokens "
                f"(positions 0-{n_tokens - 1}, or -{n_tokens}-(-1) from the end)"
            )
        queries = sorted({q % n_tokens for q in queries})
    return chosen, heads, queries


def _vocab_size(model: nn.Module) -> int:
    embeddings = getattr(model, "get_input_embeddings", None)
    if callable(embeddings):
        return int(embeddings().weight.shape[0])
    return int(model.config.vocab_size)


@torch.no_grad()
def capture_maps(
    model: nn.Module,
    token_ids: Sequence[int],
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    queries: Sequence[int] | None = LAST_QUERY,
) -> dict[int, LayerMaps]:
    """The probe's maps of ``model`` on one prompt of ``token_ids``, per chosen layer.

    ``layers``/``heads``: indices (``None``: all); ``queries``: query positions, negative from
    the end (``None``: every row, the full map). Any model the probe observes.
    """
    from diffattn.probe import AttentionMaps, Probe, eval_mode
    from diffattn.probe.models import view

    ids = [int(t) for t in token_ids]
    layers, heads, queries = resolve_selection(model, len(ids), layers, heads, queries)
    vocab = _vocab_size(model)
    bad = sorted({t for t in ids if not 0 <= t < vocab})
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the model's vocabulary of {vocab}")
    kinds = {v.index: v.kind for v in view(model).layers}
    capture = AttentionMaps(
        what=("probs", "applied", "lam"), layers=layers, heads=heads, query_positions=queries
    )
    device = next(model.parameters()).device
    with eval_mode(model), Probe(model, [capture]):
        model(input_ids=torch.tensor([ids], device=device))
    out = {}
    for layer, calls in capture.result().items():
        (call,) = calls
        maps = {key.split(".", 1)[1]: t[0].float().cpu() for key, t in call.items() if "." in key}
        if "a" not in maps:
            maps["applied"] = call["applied"][0].float().cpu()
        lam = call.get("lam")
        if lam is not None:
            lam = lam.float().cpu()
            lam = lam[0, ..., 0] if lam.dim() == 4 else lam.reshape(())
        n_heads = next(iter(maps.values())).shape[0]
        kept_heads = list(range(n_heads)) if heads is None else list(heads)
        rows = list(range(len(ids))) if queries is None else list(queries)
        out[layer] = LayerMaps(layer, kinds[layer], kept_heads, rows, maps, lam)
    return out


# --------------------------------------------------------------------------------------------
# labels
def token_labels(tokenizer: TextTokenizer | None, ids: Sequence[int], width: int = 12) -> list[str]:
    """A short printable label per token: its text (special tokens by name), with newlines and
    tabs escaped and a token of spaces shown as ␣, cut to ``width`` characters; ``#id``
    without a tokenizer."""
    labels = []
    for token in ids:
        text = ""
        if tokenizer is not None:
            text = tokenizer.decode([token])
            backend = tokenizer.backend
            if not text:  # a special token: its name
                if hasattr(backend, "convert_ids_to_tokens"):
                    text = str(backend.convert_ids_to_tokens(int(token)) or "")
                elif hasattr(backend, "id_to_token"):
                    text = str(backend.id_to_token(int(token)) or "")
        text = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
        if text and not text.strip():
            text = text.replace(" ", "␣")
        if not text:
            text = f"#{token}"
        labels.append(text if len(text) <= width else text[: width - 1] + "…")
    return labels


def label_ticks(n: int, max_labels: int, always: Sequence[int] = ()) -> tuple[list[int], int]:
    """Positions to label among ``n`` tokens: all when ``n ≤ max_labels``, else every k-th
    (k = ⌈n / max_labels⌉) plus ``always``; returns ``(positions, k)``."""
    stride = max(1, math.ceil(n / max(1, max_labels)))
    ticks = set(range(0, n, stride)) | {p for p in always if 0 <= p < n}
    return sorted(ticks), stride


# --------------------------------------------------------------------------------------------
# figures
def _map_names(maps: LayerMaps) -> tuple[str, ...]:
    return DIFF_MAPS if maps.differential else ("a",)


def _lambda_value(maps: LayerMaps, head_slot: int, row_slot: int) -> float:
    lam = maps.lam
    return float(lam) if lam.dim() == 0 else float(lam[head_slot, row_slot])


def _lambda_text(maps: LayerMaps, head_slot: int, row_slot: int | None = None) -> str:
    if maps.lam is None:
        return ""
    if maps.lam.dim() == 0:
        return f", λ = {float(maps.lam):.3f}"
    lam = maps.lam[head_slot]
    if row_slot is not None:
        return f", λ = {float(lam[row_slot]):.3f}"
    return f", mean λ = {float(lam.mean()):.3f}"


def plot_rows(
    maps: LayerMaps,
    labels: Sequence[str],
    query: int,
    path: Path,
    title: str = "",
    max_labels: int = MAX_LABELS,
    marks: dict[str, Sequence[int]] | None = None,
) -> Path:
    """Row view: the attention of query position ``query`` over tokens 0…query, one column per
    head, one row per map (A1, A2, A1 − λA2, or A). Negative entries of A1 − λA2 are red.
    ``marks`` shades key positions by label (e.g. ``{"answer": [5, 6]}``)."""
    plt = pyplot()
    names = _map_names(maps)
    slot = maps.queries.index(query)
    n = query + 1
    ticks, stride = label_ticks(n, max_labels, [query])
    width = min(12.0, max(3.0, 0.16 * len(ticks) + 1.0))
    fig, axes = plt.subplots(
        len(names),
        len(maps.heads),
        figsize=(width * len(maps.heads), 1.9 * len(names) + 1.0),
        squeeze=False,
        sharex=True,
    )
    colours = ("#f2c14e", "#9bc53d", "#c3423f", "#5bc0eb")
    for col, head in enumerate(maps.heads):
        limit = max(float(maps.maps[m][col, slot, :n].abs().max()) for m in names) or 1.0
        for row, name in enumerate(names):
            ax = axes[row][col]
            values = maps.maps[name][col, slot, :n].numpy()
            colour = ["#c0392b" if v < 0 else "#2e6da4" for v in values]
            for i, (label, positions) in enumerate((marks or {}).items()):
                for j, p in enumerate(p for p in positions if 0 <= p < n):
                    ax.axvspan(
                        p - 0.5,
                        p + 0.5,
                        color=colours[i % len(colours)],
                        alpha=0.35,
                        label=label if j == 0 and row == 0 and col == 0 else None,
                    )
            ax.bar(range(n), values, color=colour, width=0.85)
            ax.axhline(0, color="black", linewidth=0.5)
            bottom = min(0.0, float(values.min()) * 1.15)
            ax.set_ylim(bottom, limit * 1.05)
            ax.set_xlim(-0.6, n - 0.4)
            extra = _lambda_text(maps, col, slot) if name == "applied" else ""
            ax.set_title(f"head {head}: {MAP_TITLES[name]}{extra}", fontsize=9)
            ax.tick_params(axis="y", labelsize=7)
        bottom_ax = axes[-1][col]
        bottom_ax.set_xticks(ticks)
        bottom_ax.set_xticklabels([labels[p] for p in ticks], rotation=90, fontsize=7)
        for tick, p in zip(bottom_ax.get_xticklabels(), ticks, strict=True):
            if p == query:
                tick.set_color("#c0392b")
                tick.set_fontweight("bold")
    if marks:
        fig.legend(loc="upper right", fontsize=8)
    note = f"query {query} ({labels[query]!r}) over tokens 0-{query}"
    if stride > 1:
        note += f"\n1 in {stride} tokens labelled (and the query; max_labels={max_labels})"
    fig.suptitle(f"{title}layer {maps.layer} ({maps.kind})\n{note}", fontsize=9)
    return save_figure(fig, path)


def plot_heatmap(
    maps: LayerMaps,
    labels: Sequence[str],
    path: Path,
    title: str = "",
    max_labels: int = MAX_LABELS,
) -> Path:
    """Heatmap view: the whole causal map of every query (rows) over every key (columns), one
    row of panels per head, one column per map. A1 and A2 share one scale per head; A1 − λA2 is
    drawn on a scale symmetric about 0 (blue positive, red negative); grey is masked. Scales
    end at the :data:`CLIP_PERCENTILE` th percentile of |entries| (the first query rows, which
    read one or two keys, would otherwise wash out the rest)."""
    import numpy as np

    plt = pyplot()
    names = _map_names(maps)
    n = len(labels)
    if maps.queries != list(range(n)):
        raise ValueError("plot_heatmap needs the maps of every query row (queries=None)")
    ticks, stride = label_ticks(n, max_labels)
    side = min(9.0, max(3.0, 0.14 * len(ticks) + 1.5))
    fig, axes = plt.subplots(
        len(maps.heads),
        len(names),
        figsize=(side * len(names), side * len(maps.heads) + 0.6),
        squeeze=False,
    )
    causal = np.tril(np.ones((n, n), dtype=bool))

    def clip(arrays) -> float:
        values = np.concatenate([np.abs(a[causal]) for a in arrays])
        return float(np.percentile(values, CLIP_PERCENTILE)) or float(values.max()) or 1.0

    for row, head in enumerate(maps.heads):
        probs_max = clip([maps.maps[m][row].numpy() for m in names if m != "applied"])
        for col, name in enumerate(names):
            ax = axes[row][col]
            values = np.ma.masked_where(~causal, maps.maps[name][row].numpy())
            if name == "applied":
                limit = clip([maps.maps[name][row].numpy()])
                cmap, vmin, vmax, extend = plt.get_cmap("RdBu"), -limit, limit, "both"
            else:
                cmap, vmin, vmax, extend = plt.get_cmap("Blues"), 0.0, probs_max, "max"
            cmap = cmap.with_extremes(bad="#dddddd")
            image = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
            bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, extend=extend)
            bar.ax.tick_params(labelsize=7)
            extra = _lambda_text(maps, row) if name == "applied" else ""
            ax.set_title(f"head {head}: {MAP_TITLES[name]}{extra}", fontsize=9)
            ax.set_xticks(ticks)
            ax.set_xticklabels([labels[p] for p in ticks], rotation=90, fontsize=6)
            ax.set_yticks(ticks)
            ax.set_yticklabels([labels[p] for p in ticks], fontsize=6)
            ax.set_xlabel("key", fontsize=8)
            ax.set_ylabel("query", fontsize=8)
    note = f"{n} tokens; colour scales clipped at the {CLIP_PERCENTILE:g}th percentile" + (
        f"; 1 in {stride} tokens labelled (max_labels={max_labels})" if stride > 1 else ""
    )
    fig.suptitle(f"{title}layer {maps.layer} ({maps.kind})\n{note}", fontsize=10)
    return save_figure(fig, path)


# --------------------------------------------------------------------------------------------
# the experiment
def prompt_ids(
    model: EvalModel, prompt: str | None, token_ids: Sequence[int] | None, special: bool
):
    """The prompt's token ids for ``model``: ``token_ids`` as given (checked against the
    vocabulary), or ``prompt`` through the model's tokenizer (``special``: with the tokens it
    adds, e.g. BOS)."""
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of --prompt, --prompt-file and --token-ids")
    if token_ids is not None:
        ids = [int(t) for t in token_ids]
        vocab = _vocab_size(model.model)
        bad = sorted({t for t in ids if not 0 <= t < vocab})
        if bad:
            raise ValueError(f"--token-ids {bad[:5]}: outside {model.name}'s vocabulary of {vocab}")
    else:
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        if model.tokenizer is None:
            raise ValueError(
                f"{model.spec}: no tokenizer is stored with this model; pass --token-ids, or "
                "save the model with its tokenizer"
            )
        ids = model.tokenizer.encode(prompt, special=special)
    if not ids:
        raise ValueError("the prompt has no tokens")
    from diffattn.eval.text import context_limit

    limit = context_limit(model)
    if limit and len(ids) > limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens, more than {model.name}'s context of {limit}"
        )
    return ids


def run(
    models: Sequence[EvalModel], settings: AttentionSettings | None = None, **changes: Any
) -> dict[str, Any]:
    """The maps of every model on one prompt (text, or ``token_ids``), every argument checked
    before the first forward pass; ``settings``, or its fields by name (``run(models,
    prompt="...", layers=[0])``).

    Returns ``{"models": {name: {"tokens", "token_ids", "labels", "maps"}}}``: the full text
    of each token, the ids, short axis labels, and ``{layer: LayerMaps}`` holding the rows of
    ``queries`` (``view="row"``) or every row (``"heatmap"``, ``"both"``).
    """
    settings = AttentionSettings.given(settings, changes)
    settings.check()
    layers, heads, queries, view = settings.layers, settings.heads, settings.queries, settings.view
    plans = []
    for model in models:
        ids = prompt_ids(model, settings.prompt, settings.token_ids, settings.special_tokens)
        resolve_selection(model.model, len(ids), layers, heads, queries)
        plans.append((model, ids))
    results: dict[str, Any] = {"models": {}}
    for model, ids in plans:
        rows = queries if view == "row" else None
        results["models"][model.name] = {
            "tokens": token_labels(model.tokenizer, ids, width=10_000),
            "token_ids": ids,
            "labels": token_labels(model.tokenizer, ids),
            "maps": capture_maps(model.model, ids, layers, heads, rows),
        }
    return results


def _fp32_values(tensor: torch.Tensor) -> Any:
    """Nested lists of the tensor's fp32 values, each written with the fewest digits that read
    back as the same fp32 number."""
    import numpy as np

    array = tensor.detach().cpu().float().numpy()
    if array.ndim == 0:
        return float(str(np.float32(array)))
    if array.ndim == 1:
        return [float(str(v)) for v in array]
    return [_fp32_values(torch.from_numpy(row)) for row in array]


def layer_values(maps: LayerMaps) -> dict[str, Any]:
    """One layer's JSON record: kind, kept query positions, λ (DIFF V1), and per head the maps
    ``(query rows × tokens)`` and V2's λ per query row."""
    record: dict[str, Any] = {"kind": maps.kind, "query_positions": maps.queries, "heads": {}}
    if maps.lam is not None and maps.lam.dim() == 0:
        record["lambda"] = _fp32_values(maps.lam)
    for slot, head in enumerate(maps.heads):
        entry = {name: _fp32_values(tensor[slot]) for name, tensor in maps.maps.items()}
        if maps.lam is not None and maps.lam.dim() > 0:
            entry["lambda"] = _fp32_values(maps.lam[slot])
        record["heads"][str(head)] = entry
    return record


def write_values(results: dict[str, Any], path: Path) -> Path:
    """Write every model's tokens and maps (:func:`layer_values`) as compact JSON."""
    import json
    import os

    data = {
        "models": {
            name: {
                "tokens": r["tokens"],
                "token_ids": r["token_ids"],
                "layers": {str(i): layer_values(m) for i, m in r["maps"].items()},
            }
            for name, r in results["models"].items()
        }
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _top_keys(maps: LayerMaps, labels: Sequence[str], slot: int, row: int, k: int = 3):
    """The ``k`` keys with the largest weight (A1 − λA2, or A) in one query row."""
    name = "applied" if maps.differential else "a"
    values = maps.maps[name][slot, row, : maps.queries[row] + 1]
    top = torch.topk(values, min(k, values.numel())).indices.tolist()
    return [(p, labels[p], float(values[p])) for p in top]


def summary(results: dict[str, Any], queries: Sequence[int]) -> dict[str, Any]:
    """What ``results.json`` holds: per model the tokens and, per layer, head and query, λ and
    the three most attended keys; the maps themselves are in :data:`MAPS_NAME`."""
    out: dict[str, Any] = {"values": MAPS_NAME, "models": {}}
    for name, record in results["models"].items():
        n = len(record["token_ids"])
        wanted = sorted({q % n for q in queries})
        rows = []
        for layer, maps in record["maps"].items():
            for slot, head in enumerate(maps.heads):
                for q in wanted:
                    row = maps.queries.index(q)
                    lam = math.nan if maps.lam is None else _lambda_value(maps, slot, row)
                    top = _top_keys(maps, record["labels"], slot, row)
                    rows.append(
                        {
                            "layer": layer,
                            "head": head,
                            "kind": maps.kind,
                            "query": q,
                            "lambda": lam,
                            "top_keys": top,
                        }
                    )
        out["models"][name] = {
            "tokens": record["tokens"],
            "token_ids": record["token_ids"],
            "rows": rows,
        }
    return out


def report(results: dict[str, Any], queries: Sequence[int], max_labels: int) -> str:
    """Per model: the tokens, and per layer, head and query the most attended keys."""
    parts = ["## Attention over the prompt (DIFF V1 Eq.1, Fig 1)\n"]
    for name, record in summary(results, queries)["models"].items():
        labels = results["models"][name]["labels"]
        tokens = " | ".join(label.replace("`", "'") for label in labels)
        parts.append(f"\n### {name}\n\n{len(labels)} tokens: `{tokens}`\n\n")
        rows = [
            (
                r["layer"],
                r["head"],
                r["kind"],
                r["query"],
                r["lambda"],
                ", ".join(f"{p} {t!r} {w:.3f}" for p, t, w in r["top_keys"]),
            )
            for r in record["rows"]
        ]
        parts.append(
            markdown_table(
                ["layer", "head", "kind", "query", "λ", "top keys (position, token, weight)"],
                rows,
            )
        )
    parts.append(
        "\nWeights are of A1 − λA2 for differential layers and of A for softmax layers. "
        f"`{MAPS_NAME}` holds A1, A2 and A1 − λA2 (or A) of every kept query row over all "
        f"tokens, and λ. Figures label at most {max_labels} tokens per axis (--max-labels).\n"
    )
    return "".join(parts)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text).strip("_") or "model"


def plot_all(
    results: dict[str, Any], out: Path, view: str, queries: Sequence[int], max_labels: int
) -> list[Path]:
    """Every figure of a run: per model and layer, a row view per query and/or a heatmap."""
    figures = []
    for name, record in results["models"].items():
        labels, n = record["labels"], len(record["token_ids"])
        for layer, maps in record["maps"].items():
            stem = out / f"attention_{_slug(name)}_L{layer}"
            if view in ("row", "both"):
                for q in sorted({q % n for q in queries}):
                    path = stem.with_name(f"{stem.name}_q{q}.png")
                    figures.append(plot_rows(maps, labels, q, path, f"{name}: ", max_labels))
            if view in ("heatmap", "both"):
                path = stem.with_name(f"{stem.name}_heatmap.png")
                figures.append(plot_heatmap(maps, labels, path, f"{name}: ", max_labels))
    return figures


def _indices(option: str):
    return lambda text: parse_indices(text, option)


@dataclass(frozen=True)
class AttentionSettings(Settings):
    """The settings of ``diffattn eval attention`` (and of :func:`run`): on the command line
    the indices are comma-separated text (``all``: every one), here lists (``None``: all)."""

    prompt: str | None = setting(
        None, group="prompt", help="the text to look at (through each model's tokenizer)"
    )
    prompt_file: Path | None = setting(  # noqa: RUF009 (a field, as every setting())
        None, group="prompt", command_only=True, help="read the prompt from this file"
    )
    token_ids: tuple[int, ...] | None = setting(
        None,
        group="prompt",
        parse=_indices("--token-ids"),
        help="comma-separated token ids instead of text (models without tokenizer)",
    )
    layers: tuple[int, ...] | None = setting(
        None,
        cli_default="all",
        parse=_indices("--layers"),
        help="comma-separated layers (default all)",
    )
    heads: tuple[int, ...] | None = setting(
        None,
        cli_default="all",
        parse=_indices("--heads"),
        help="comma-separated heads (default all)",
    )
    queries: tuple[int, ...] = setting(
        LAST_QUERY,
        flag="--query",
        dest="query",
        cli_default=None,
        parse=_indices("--query"),
        help="comma-separated query positions of the row view, negative from the end "
        "(default {default}, the last token)",
    )
    view: str = setting(
        "row",
        choices=VIEWS,
        error=f"--view must be one of {', '.join(VIEWS)}, got {{view!r}}",
        help="row: chosen query rows over the tokens (Fig 1); heatmap: the whole map; both",
    )
    max_labels: int = setting(
        MAX_LABELS,
        min=1,
        report_last=True,
        help="label at most this many tokens per axis; longer prompts label every k-th",
    )
    special_tokens: bool = setting(
        True,
        flag="--no-special-tokens",
        dest="no_special_tokens",
        cli_default=False,
        parse=operator.not_,
        help="do not add the tokenizer's special tokens (e.g. BOS) to the prompt",
    )

    @classmethod
    def from_args(cls, args: Any) -> AttentionSettings:
        """The settings of the command line, checked, with the prompt read from
        ``--prompt-file``."""
        if args.query is not None and args.view == "heatmap":
            raise ValueError("--query selects rows of the row view; --view heatmap draws every row")
        settings = super().from_args(args)
        settings.check()
        path = settings.prompt_file
        if path is None:
            return settings
        try:
            return replace(settings, prompt=path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--prompt-file {path}: cannot be read ({error})") from None


add_arguments = AttentionSettings.add_arguments


def prepare(args: Any) -> dict[str, Any]:
    """Load the models and check every argument against them and the prompt (before the
    output directory is touched)."""
    settings = AttentionSettings.from_args(args)
    models = models_from_args(args)
    for model in models:
        ids = prompt_ids(model, settings.prompt, settings.token_ids, settings.special_tokens)
        resolve_selection(model.model, len(ids), settings.layers, settings.heads, settings.queries)
    return {"models": models, "settings": settings}


def main(args: Any) -> int:
    prepared = getattr(args, "prepared", None) or prepare(args)
    models, settings = prepared["models"], prepared["settings"]
    results = run(models, settings)
    out = Path(args.out)
    queries, max_labels = settings.queries, settings.max_labels
    figures = plot_all(results, out, settings.view, queries, max_labels)
    write_values(results, out / MAPS_NAME)
    text = report(results, queries, max_labels)
    stored = settings.report()
    return finish(args, NAME, summary(results, queries), models, text, stored, figures)
