"""PNG plots of a comparison: loss curves and λ per layer over steps (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffattn.compare.report import NAMES

COLOURS = {"baseline": "tab:gray", "diff_v1": "tab:blue", "diff_v2": "tab:orange"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _smooth(values: list[float], weight: float = 0.8) -> list[float]:
    """Exponential moving average (the usual display smoothing of training curves)."""
    out, level = [], None
    for v in values:
        level = v if level is None else weight * level + (1 - weight) * v
        out.append(level)
    return out


def plot_losses(out: Path, runs: list[Any]) -> Path | None:
    """``loss_curves.png``: smoothed training loss and validation loss vs step."""
    plt = _pyplot()
    if plt is None or not runs:
        return None
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    labelled = set()
    for run in runs:
        colour = COLOURS.get(run.attention)
        label = None if run.attention in labelled else NAMES.get(run.attention, run.attention)
        labelled.add(run.attention)
        steps, losses = zip(*run.train_curve, strict=True) if run.train_curve else ((), ())
        ax_train.plot(steps, _smooth(list(losses)), color=colour, label=label, lw=1.5)
        if run.val_curve:
            steps, losses = zip(*run.val_curve, strict=True)
            ax_val.plot(steps, losses, color=colour, label=label, marker="o", ms=3, lw=1.5)
    ax_train.set(title="training loss (EMA 0.8)", xlabel="step", ylabel="loss")
    ax_val.set(title="validation loss", xlabel="step", ylabel="loss")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    path = out / "loss_curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_lambda(out: Path, runs: list[Any]) -> Path | None:
    """``lambda.png``: per layer, DIFF V1's λ and DIFF V2's mean λ over steps (first seed)."""
    plt = _pyplot()
    panels = {}
    for run in runs:
        if run.lambda_curve and run.attention not in panels:
            panels[run.attention] = run
    if plt is None or not panels:
        return None
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.5 * len(panels), 4), constrained_layout=True, squeeze=False
    )
    for ax, (attention, run) in zip(axes[0], panels.items(), strict=True):
        steps = [s for s, _ in run.lambda_curve]
        per_layer = list(zip(*(values for _, values in run.lambda_curve), strict=True))
        cmap = plt.get_cmap("viridis", max(2, len(per_layer)))
        for layer, values in enumerate(per_layer):
            ax.plot(steps, values, color=cmap(layer), label=f"layer {layer + 1}")
        what = "λ (Eq.2)" if attention == "diff_v1" else "mean sigmoid(x·W_λ)"
        ax.set(title=f"{NAMES.get(attention, attention)}: {what}", xlabel="step", ylabel="λ")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    path = out / "lambda.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
