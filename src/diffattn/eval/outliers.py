"""``diffattn eval outliers``: activation outliers and low-bit attention logits (DIFF V1 Table 5,
Fig 8).

* **Outliers** (Table 5): the top-1/2/3/10/100 and the median of |attention logits| (the
  scaled pre-softmax logits of every layer, both maps of DIFF pooled, only entries a real query
  may attend) and of |hidden states| (every entry of each layer's output at real tokens),
  streamed over ``--max-tokens`` tokens of held-out documents cut into ``--seq-len`` windows.
  The median is read off a log-spaced histogram (to within 1.8%; see
  :class:`diffattn.probe.RunningStats`).
* **Quantized attention logits** (Fig 8): the loss with the logits of every layer quantized to
  ``--bits`` bits inside attention (16 = unquantized), through the probe's
  :class:`~diffattn.probe.LogitTransform`. The quantizer (:func:`quantize_absmax`) is
  symmetric dynamic absmax quantization **per head and query row**: over the entries the mask
  allows, scale = absmax / (2^(b−1) − 1), round to nearest, clamp, dequantize; masked entries
  are left alone. Per row, the result does not depend on how the observed attention blocks
  query rows. The DIFF paper does not state the granularity it used.

Documents are read and windowed like ``diffattn eval loss`` (same ``--data``, ``--split``,
``--valid-fraction``, ``--data-seed``); the 16-bit loss is eval loss's loss on the same windows.

Results per model (``results.json``): ``logits`` and ``hidden`` (top1, top2, top3, top10,
top100, median, mean, std, max, count), ``logits_layers`` and ``hidden_layers`` (the same per
layer), ``quantized_loss`` ({bits: mean NLL in nats}) and ``counts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    command_main,
    markdown_table,
    one_axes,
    panel_row,
    save_axes,
    save_figure,
)
from diffattn.eval.text import (
    WINDOW_BOUNDS,
    DataSettings,
    measure_windows,
    padded_batches,
    window_nll,
)
from diffattn.eval.text import model_windows as model_windows  # importable from here too
from diffattn.eval.text import padded as padded  # importable from here too
from diffattn.settings import like, setting, shared

NAME = "outliers"
HELP = "top-k |attention logits| and |hidden states|, loss with 8/6/4-bit logits (DIFF Tab 5)"
RANKS = ("top1", "top2", "top3", "top10", "top100", "median")


@dataclass(frozen=True)
class OutliersSettings(DataSettings):
    """The settings of ``diffattn eval outliers`` (and of :func:`run`)."""

    max_tokens: int = like(DataSettings, "max_tokens", 50_000)
    bits: tuple[int, ...] = setting(
        (16, 8, 6, 4),
        help="bit widths of the attention logits (16 = unquantized; default {default})",
    )
    batch_size: int = shared(CommonOptions, "batch_size", error=WINDOW_BOUNDS)
    seed: int = shared(CommonOptions, "seed")


add_arguments = OutliersSettings.add_arguments


def check_bits(bits: Sequence[int]) -> list[int]:
    bits = [int(b) for b in bits]
    bad = [b for b in bits if not 2 <= b <= 16]
    if not bits or bad:
        raise ValueError(f"--bits must be between 2 and 16 (16 = unquantized), got {bad or bits}")
    return sorted(set(bits), reverse=True)


def quantize_absmax(logits: torch.Tensor, allowed: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric dynamic absmax quantization of ``logits`` ``(…, S)`` per row (last dimension):
    scale = max |allowed entries| / (2^(bits−1) − 1), round to nearest, clamp to ±(2^(bits−1)
    − 1), dequantize. Entries ``allowed`` (bool, broadcastable) does not mark are returned
    unchanged; ``bits=16`` returns ``logits`` itself. Rounding error ≤ scale / 2 per entry."""
    if not 2 <= int(bits) <= 16:
        raise ValueError(f"bits must be between 2 and 16, got {bits}")
    if bits == 16:
        return logits
    levels = 2 ** (int(bits) - 1) - 1
    allowed = allowed.to(logits.device).expand_as(logits)
    absmax = logits.abs().masked_fill(~allowed, 0.0).amax(-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / levels, torch.ones_like(absmax))
    quantized = torch.clamp(torch.round(logits / scale), -levels, levels) * scale
    return torch.where(allowed, quantized, logits)


@torch.no_grad()
def outlier_stats(
    model: EvalModel,
    pieces: Sequence[Sequence[int]],
    batch_size: int,
    top_k: int = 100,
    quiet: bool = True,
) -> dict[str, Any]:
    """Streamed |logit| and |hidden state| statistics of ``model`` over ``pieces``."""
    from diffattn.probe import HiddenStats, LogitStats, Probe

    logit_stats, hidden_stats = LogitStats(top_k=top_k), HiddenStats(top_k=top_k)
    label = f"outliers {model.name}"
    with Probe(model.model, [logit_stats, hidden_stats]):
        for _, ids, mask in padded_batches(model, pieces, batch_size, label, quiet):
            model.model(**model.window_inputs(ids, mask))
    logits, hidden = logit_stats.result(), hidden_stats.result()
    return {
        "logits": logits["all"],
        "hidden": hidden["all"],
        "logits_layers": logits["layers"],
        "hidden_layers": hidden["layers"],
    }


def quantized_loss(
    model: EvalModel,
    pieces: Sequence[Sequence[int]],
    bits: int,
    batch_size: int,
    quiet: bool = True,
) -> float:
    """Mean next-token NLL over ``pieces`` with every layer's attention logits quantized to
    ``bits`` bits (16: the model as it is, no probe)."""
    from diffattn.probe import LogitTransform, Probe

    if bits == 16:
        nlls = window_nll(model, pieces, batch_size, quiet)
    else:
        transform = LogitTransform(
            lambda logits, allowed, layer: quantize_absmax(logits, allowed, bits)
        )
        with Probe(model.model, [transform]):
            nlls = window_nll(model, pieces, batch_size, quiet)
    return float(torch.cat(nlls).double().mean())


def run(
    models: Sequence[EvalModel],
    settings: OutliersSettings | None = None,
    *,
    top_k: int = 100,
    quiet: bool = True,
    **changes: Any,
) -> dict[str, Any]:
    """Outlier statistics and quantized-logit loss of every model (see the module docstring);
    ``settings``, or its fields by name (``run(models, bits=(16, 4))``)."""
    settings = OutliersSettings.given(settings, changes)
    if top_k < 100:
        raise ValueError(f"--top-k must be at least 100, got {top_k}")
    bits = check_bits(settings.bits)
    settings.check()
    batch_size = settings.batch_size

    def measure(model: EvalModel, pieces: list[list[int]]) -> dict[str, Any]:
        entry = outlier_stats(model, pieces, batch_size, top_k, quiet)
        entry["quantized_loss"] = {
            b: quantized_loss(model, pieces, b, batch_size, quiet) for b in bits
        }
        entry["counts"] = {
            "windows": len(pieces),
            "tokens": sum(len(p) for p in pieces),
            "targets": sum(len(p) - 1 for p in pieces),
        }
        return entry

    results = measure_windows(models, settings, settings.seed, measure)
    results["bits"] = bits  # after "models", "documents" and "data_fingerprint"
    return results


def plot_topk(results: dict[str, Any], path: Path) -> Path:
    """Grouped bars of top-1/2/3/10/100 and median per model, logits and hidden states."""
    names = list(results["models"])
    fig, axes = panel_row(2, "Activation outliers (DIFF V1 Table 5)", (11, 4))
    width = 0.8 / max(len(names), 1)
    for ax, key, title in (
        (axes[0], "logits", "|attention logits|"),
        (axes[1], "hidden", "|hidden states|"),
    ):
        for i, name in enumerate(names):
            stats = results["models"][name][key]
            values = [stats.get(r, float("nan")) for r in RANKS]
            ax.bar([x + i * width for x in range(len(RANKS))], values, width, label=name)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(RANKS))])
        ax.set_xticklabels(["top-1", "top-2", "top-3", "top-10", "top-100", "median"])
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    return save_figure(fig, path)


def plot_bits(results: dict[str, Any], path: Path) -> Path:
    """Loss against the bit width of the attention logits, one line per model."""
    fig, ax = one_axes()
    for name, entry in results["models"].items():
        points = sorted((int(b), v) for b, v in entry["quantized_loss"].items())
        ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=name)
    ax.invert_xaxis()
    ax.set_xticks(sorted(int(b) for b in results["bits"]))
    return save_axes(
        fig,
        ax,
        path,
        "Low-bit attention logits (DIFF V1 Fig 8)",
        "bits of attention logits (16 = unquantized)",
        "loss (nats)",
    )


def report(results: dict[str, Any]) -> str:
    header = ["model", "top-1", "top-2", "top-3", "top-10", "top-100", "median"]
    parts = []
    for key, title in (("logits", "attention logits"), ("hidden", "hidden states")):
        rows = [
            (name, *(float(r[key].get(k, float("nan"))) for k in RANKS))
            for name, r in results["models"].items()
        ]
        parts.append(f"## Largest |{title}| (DIFF V1 Table 5)\n\n" + markdown_table(header, rows))
    bits = results["bits"]
    rows = [
        (name, *(float(r["quantized_loss"][b]) for b in bits))
        for name, r in results["models"].items()
    ]
    parts.append(
        "## Loss with quantized attention logits (DIFF V1 Fig 8)\n\n"
        + markdown_table(["model", *(f"{b}-bit" for b in bits)], rows)
        + "\nMean NLL in nats per token; 16-bit is unquantized. Logits are quantized with "
        "symmetric absmax per head and query row, in every layer.\n"
    )
    return "\n".join(parts)


def figures(results: dict[str, Any], out: Path) -> list[Path]:
    return [
        plot_topk(results, out / "outliers_topk.png"),
        plot_bits(results, out / "quantized_loss.png"),
    ]


def main(args: Any) -> int:
    return command_main(args, NAME, OutliersSettings, run, report, figures)
