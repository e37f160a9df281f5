"""The retrieval experiment's part of the comparison report: claims, measurements, the
accuracy-vs-difficulty plot (DIFF V1 Table 2's analogue) and the attention picture at one query
position (Figure 1's analogue)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from diffattn.compare.arms import REFERENCE, arm_of, colours, title_of
from diffattn.compare.plots import _pyplot, save
from diffattn.compare.report import device_lines


def _mean_sd(values: list[float], fmt: str) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "—"
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:{fmt}}"
    return f"{mean:{fmt}} ± {statistics.stdev(values):{fmt}}"


def measurement_rows(settings: Any) -> list[tuple[str, str, str]]:
    rows = [(f"acc_{p}", f"accuracy, {p} pairs", ".3f") for p in settings.grid]
    rows += [
        ("acc_mean", "accuracy, mean over pair counts", ".3f"),
        ("answer_share", "share on the queried pair (last layer)", ".3f"),
        ("lookalike_share", "share on look-alike pairs (last layer)", ".3f"),
        ("noise_share", "share outside the queried pair (last layer)", ".3f"),
        ("answer_mass", "signed mass on the queried pair (last layer)", ".3f"),
        ("noise_mass", "signed mass outside the queried pair (last layer)", ".3f"),
    ]
    for bits in settings.bits:
        rows.append((f"qacc_{bits}", f"accuracy, {bits}-bit attention logits", ".3f"))
    for bits in settings.bits:
        rows.append((f"qdrop_{bits}", f"accuracy lost at {bits} bits", "+.3f"))
    return rows


def lambda_summary(per_type: dict[str, list[dict[str, Any]]]) -> list[str]:
    """λ per layer at the end of training, mean ± sd over seeds, for each arm whose type has a
    λ (its declaration's ``lambda_key`` and ``lambda_label``)."""
    lines = []
    for attention, runs in per_type.items():
        arm = arm_of(attention)
        if arm is None or arm.lambda_key is None:
            continue
        per_seed = [r.get("lambda", {}).get(arm.lambda_key) for r in runs]
        per_seed = [v for v in per_seed if v]
        if not per_seed:
            continue
        layers = list(zip(*per_seed, strict=True))
        cells = ", ".join(
            f"layer {i + 1}: {_mean_sd(list(v), '.3f')}" for i, v in enumerate(layers)
        )
        lines.append(f"- {arm.title} {arm.declaration.lambda_label}: {cells}")
    return lines


def retrieval_section(
    out: Path, settings: Any, per_type: dict[str, list[dict[str, Any]]], z: float = 2.0
) -> tuple[list[str], dict[str, Any], list[Path]]:
    """(markdown lines, JSON data, plots) of the retrieval experiment."""
    from diffattn.compare.claims import (
        RETRIEVAL_CLAIMS,
        claimed_arms,
        claims_table,
        evaluate_claims,
    )

    verdicts = []
    if REFERENCE in per_type and len(per_type) > 1:
        verdicts = evaluate_claims(RETRIEVAL_CLAIMS, per_type, z=z, claimed=claimed_arms(per_type))
    plots = [
        p for p in (plot_accuracy(out, settings, per_type), plot_attention(out, per_type)) if p
    ]
    lines = _task_paragraph(settings, per_type)
    if verdicts:
        lines += [claims_table(verdicts, z), ""]
    lines += _measurements_table(settings, per_type)
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    lines.append("")
    data = {
        "settings": asdict(settings),
        "claims": [_verdict_record(v) for v in verdicts],
        "runs": per_type,
        "plots": [p.name for p in plots],
    }
    return lines, data, plots


def _task_paragraph(settings: Any, per_type: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The section's heading and the paragraph that states the task (DIFF V1 Table 2's
    multi-needle retrieval, token-level), the models, their parameters and the training."""
    task = settings.task()
    params = {a: runs[0].get("params") for a, runs in per_type.items() if runs}
    return [
        "## Retrieval among distractors (token-level)",
        "",
        f"Token-level multi-query associative recall (`diffattn.data.synthetic.RetrievalTask`): "
        f"two-token keys (prefix, suffix) and one-token values from disjoint ranges, "
        f"{settings.queries} queries per episode, each queried key with up to "
        f"{settings.lookalikes} look-alike key(s) sharing its prefix, the pairs among filler in a "
        f"context of {settings.context} tokens (sequence {task.seq_len}); chance "
        f"{1 / settings.values:.3f}. Difficulty: pairs in the context, grid "
        f"{list(settings.grid)}, training on every count from {min(settings.grid)} to "
        f"{max(settings.grid)}, loss on the answers only. Models: {settings.n_layers} layers, "
        f"d_model {settings.d_model}, {settings.n_heads} baseline heads; parameters "
        + ", ".join(f"{title_of(a)} {p:,}" for a, p in params.items() if p)
        + f". {settings.steps} steps of {settings.batch_size} fresh episodes, lr "
        f"{settings.lr:g}; {settings.seeds} seeds; {settings.test_episodes} fixed test "
        "episodes per pair count, the same for every model.",
        "",
    ]


def _measurements_table(settings: Any, per_type: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The measurements (mean ± sd over seeds) per model, what the attention figures mean
    (Figure 1's applied map, Figure 8's quantized logits), the λ summary and the device line."""
    lines = ["### Retrieval measurements (mean ± sd over seeds)", ""]
    models = list(per_type)
    lines += [
        "| measurement | " + " | ".join(title_of(m) for m in models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for key, label, fmt in measurement_rows(settings):
        cells = [_mean_sd([r.get(key, math.nan) for r in per_type[m]], fmt) for m in models]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Attention is the applied map (A, or DIFF's signed A1 − λA2) at the position that "
        "predicts each answer, last layer, mean over heads, queries and pair counts; *shares* "
        "divide each mass by the row's total (a differential row sums to 1 − λ), *signed mass* "
        "does not. Per layer and head figures are in results.json. Accuracy lost at b bits is "
        "the mean accuracy minus the accuracy with every attention logit quantized to b bits "
        "(dynamic absmax per head and row).",
        "",
        *lambda_summary(per_type),
        "",
        *device_lines(
            (a, seed, r.get("device"))
            for a, runs in per_type.items()
            for seed, r in enumerate(runs)
        ),
    ]
    return lines


def _verdict_record(verdict: Any) -> dict[str, Any]:
    """One claim's verdict as results.json stores it."""
    return {
        "key": verdict.claim.key,
        "claim": verdict.claim.statement,
        "source": verdict.claim.source,
        "model": verdict.model,
        "differences": list(verdict.differences),
        "mean": verdict.mean,
        "stderr": verdict.stderr,
        "verdict": verdict.verdict,
        "paper_claim": verdict.claimed,
    }


def plot_accuracy(
    out: Path, settings: Any, per_type: dict[str, list[dict[str, Any]]]
) -> Path | None:
    """``retrieval_accuracy.png``: accuracy against pairs in the context, one line (mean over
    seeds) per type, a dot per seed; chance dashed."""
    plt = _pyplot()
    if plt is None or not per_type:
        return None
    grid = list(settings.grid)
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    offsets = {a: (i - (len(per_type) - 1) / 2) * 0.12 for i, a in enumerate(per_type)}
    colour_of = colours(per_type)
    for attention, runs in per_type.items():
        colour = colour_of[attention]
        means = [statistics.fmean(r[f"acc_{p}"] for r in runs) for p in grid]
        ax.plot(grid, means, color=colour, marker="o", label=title_of(attention))
        for p in grid:
            ys = [r[f"acc_{p}"] for r in runs]
            ax.scatter([p + offsets[attention]] * len(ys), ys, color=colour, s=10, alpha=0.6)
    ax.axhline(1 / settings.values, color="black", ls="--", lw=0.8, label="chance")
    ax.set(
        xlabel="key–value pairs in the context",
        ylabel="accuracy",
        title="retrieval among look-alike distractors",
        ylim=(0, 1.02),
    )
    ax.set_xticks(grid)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save(fig, out / "retrieval_accuracy.png")


def plot_attention(out: Path, per_type: dict[str, list[dict[str, Any]]]) -> Path | None:
    """``retrieval_attention.png``: the last layer's applied map at one query position of the
    same test episode, each type's first seed, mean over heads; the queried pair and the
    look-alike pairs shaded."""
    plt = _pyplot()
    examples = {a: runs[0].get("example") for a, runs in per_type.items() if runs}
    examples = {a: e for a, e in examples.items() if e}
    if plt is None or not examples:
        return None
    fig, axes = plt.subplots(
        len(examples), 1, figsize=(11, 2.4 * len(examples)), sharex=True, squeeze=False,
        constrained_layout=True,
    )  # fmt: skip
    colour_of = colours(per_type)
    for ax, (attention, example) in zip(axes[:, 0], examples.items(), strict=True):
        heads = example["applied"]
        row = [statistics.fmean(col) for col in zip(*heads, strict=True)]
        xs = range(len(row))
        ax.bar(xs, row, color=colour_of[attention], width=0.9)
        a, b = example["answer"]
        ax.axvspan(a - 0.5, b - 0.5, color="green", alpha=0.2, label="queried pair")
        for i, (c, d) in enumerate(example["lookalikes"]):
            ax.axvspan(c - 0.5, d - 0.5, color="red", alpha=0.2,
                       label="look-alike pair" if i == 0 else None)  # fmt: skip
        for i, (c, d) in enumerate(example["others"]):
            ax.axvspan(c - 0.5, d - 0.5, color="gray", alpha=0.12,
                       label="other pairs" if i == 0 else None)  # fmt: skip
        ax.axhline(0, color="black", lw=0.6)
        verdict = "right" if example["correct"] else "wrong"
        ax.set_title(
            f"{title_of(attention)}: layer {example['layer'] + 1}, query at position "
            f"{example['position']} ({verdict}), mean over heads",
            fontsize="small",
        )
        ax.set_ylabel("attention")
        ax.legend(fontsize="x-small", loc="upper left")
    axes[-1, 0].set_xlabel(
        f"key position (one test episode with {next(iter(examples.values()))['pairs']} pairs)"
    )
    return save(fig, out / "retrieval_attention.png")
