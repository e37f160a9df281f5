"""PNG plots of a comparison: loss curves, λ per layer over steps and the measurements
(matplotlib, Agg). Each arm is named and coloured by its type's declaration (``title``,
``colour``, ``lambda_label``; :mod:`diffattn.compare.arms`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffattn.compare.arms import arm_of, colours, title_of


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` (PNG, 120 dpi), close it and return ``path``."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    colour_of = colours(dict.fromkeys(run.attention for run in runs))
    for run in runs:
        colour = colour_of[run.attention]
        label = None if run.attention in labelled else title_of(run.attention)
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
    return save(fig, out / "loss_curves.png")


def plot_lambda(out: Path, runs: list[Any]) -> Path | None:
    """``lambda.png``: per layer, each arm's λ over steps (first seed), as its type names it
    (``lambda_label``: DIFF V1's λ of Eq.2, DIFF V2's mean sigmoid(x·W_λ))."""
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
        arm = arm_of(attention)
        what = "λ" if arm is None else arm.declaration.lambda_label
        ax.set(title=f"{title_of(attention)}: {what}", xlabel="step", ylabel="λ")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return save(fig, out / "lambda.png")


EVAL_PANELS = (
    ("retrieval accuracy (Tab 2; MQAR)",
     ("needle_1_1", "needle_2_2", "needle_4_2", "needle_6_2", "recall_acc"),
     ("1,1", "2,2", "4,2", "6,2", "recall")),
    ("attention share (Tab 3)", ("answer_share", "noise_share"), ("answer", "noise")),
    ("loss added by b-bit logits (Fig 8)", ("quant_gap_8", "quant_gap_6", "quant_gap_4"),
     ("8", "6", "4")),
)  # fmt: skip


def plot_evals(out: Path, per_seed: dict[str, list[dict[str, Any]]]) -> Path | None:
    """``evals.png``: needle accuracy per (N, R), attention shares and the loss added by
    quantized logits; bars are means over seeds, whiskers the sd, dots single seeds."""
    plt = _pyplot()
    if plt is None or not per_seed:
        return None
    import statistics

    fig, axes = plt.subplots(1, len(EVAL_PANELS), figsize=(15, 4), constrained_layout=True)
    width = 0.8 / len(per_seed)
    colour_of = colours(per_seed)
    for ax, (title, keys, labels) in zip(axes, EVAL_PANELS, strict=True):
        for m, (attention, evals) in enumerate(per_seed.items()):
            for k, key in enumerate(keys):
                values = [float(e[key]) for e in evals if e.get(key) is not None]
                if not values:
                    continue
                x = k + (m - (len(per_seed) - 1) / 2) * width
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                ax.bar(
                    x,
                    statistics.fmean(values),
                    width,
                    yerr=sd,
                    color=colour_of[attention],
                    label=title_of(attention) if k == 0 else None,
                    capsize=2,
                )
                ax.scatter([x] * len(values), values, color="black", s=6, zorder=3)
        ax.set_xticks(range(len(keys)), labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_xlabel("needles (N, R) and associative recall")
    axes[2].set_xlabel("bits")
    axes[0].legend(fontsize="small")
    return save(fig, out / "evals.png")
