"""``diffattn bench --plot``: tokens/s against sequence length, one panel per mode, and
below it each row's paired throughput ratio to its baseline (DIFF V1 / baseline, ...).

The analogue of Dex Fig 12 (throughput of base Llama, Diff Transformer and Dex against context
length): every row of the run is a line (ours solid, Hugging Face ones dashed), the x axis is
the sequence length (the prompt length in decode) on a log₂ scale, and each point is the
median tokens/s of that length's interleaved run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffattn.bench.models import DEX_ROWS, HF_ROWS, REFERENCE

TITLES = {"fwd": "forward", "fwd+bwd": "forward + backward", "decode": "decode"}


def plot_sweep(records: list[dict[str, Any]], path: Path) -> Path:
    """Write the PNG of ``records`` (from one ``diffattn bench`` run) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("no records to plot")
    modes = [m for m in TITLES if any(r["mode"] == m for r in records)]
    colors = _colors(records)
    fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 8), squeeze=False)
    first = records[0]
    for ax, mode in zip(axes[1], modes, strict=True):
        _ratio_panel(ax, [r for r in records if r["mode"] == mode], mode, colors)
    for ax, mode in zip(axes[0], modes, strict=True):
        rows = [r for r in records if r["mode"] == mode]
        names = list(dict.fromkeys(r["attention"] for r in rows))
        for name in names:
            points = sorted(
                (r["seq_len"], r["tokens_per_s"]) for r in rows if r["attention"] == name
            )
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, _style(name), marker="o", label=name, color=colors[name])
        ax.set_xscale("log", base=2)
        lengths = sorted({r["seq_len"] for r in rows})
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("prompt length" if mode == "decode" else "sequence length N")
        ax.set_ylabel("tokens/s")
        ax.set_title(TITLES[mode])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"d_model {first['d_model']}, {first['layers']} layers, {first['device_name']} "
        f"({first['threads']} threads), {first['dtype']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _colors(records: list[dict[str, Any]]) -> dict[str, str]:
    """One colour per row name, the same in every panel."""
    names = dict.fromkeys(r["attention"] for r in records)
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def _ratio_panel(ax, rows: list[dict[str, Any]], mode: str, colors: dict[str, str]) -> None:
    """Paired throughput ratio of every row to its reference row against length (the
    reference rows themselves, at 1, are left out; a dotted line marks 1)."""
    names = [n for n in dict.fromkeys(r["attention"] for r in rows) if n not in REFERENCES]
    for name in names:
        points = sorted(
            (r["seq_len"], r["paired_ratio_to_baseline"]) for r in rows if r["attention"] == name
        )
        xs, ys = zip(*points, strict=True)
        label = f"{name} / {_reference_of(rows, name)}"
        ax.plot(xs, ys, _style(name), marker="o", label=label, color=colors[name])
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    lengths = sorted({r["seq_len"] for r in rows})
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("prompt length" if mode == "decode" else "sequence length N")
    ax.set_ylabel("paired throughput ratio")
    ax.set_title(f"{TITLES[mode]}: ratio to its baseline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


REFERENCES = (REFERENCE, HF_ROWS[0])


def _style(name: str) -> str:
    """Our rows (every attention type) solid, Dex rows dotted, the other HF rows dashed."""
    return ":" if name in DEX_ROWS else "--" if name in HF_ROWS else "-"


def _reference_of(rows: list[dict[str, Any]], name: str) -> str:
    return next(r["ratio_reference"] for r in rows if r["attention"] == name)
