"""The comparison report: one row per attention type, with the spread over seeds.

``report.json`` holds everything (settings, every run, the curves); ``report.md`` shows the
table, the settings, the λ summaries and the plots; the same table is printed at the end.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

NAMES = {"baseline": "Transformer", "diff_v1": "DIFF V1", "diff_v2": "DIFF V2"}


@dataclass
class RunSummary:
    """One finished training run, read back from its ``metrics.jsonl``."""

    attention: str
    seed: int
    run_dir: str
    parameters: int
    steps: int
    tokens: int
    final_val_loss: float
    final_train_loss: float
    tokens_per_s: float
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    lambda_curve: list[tuple[int, list[float]]] = field(default_factory=list)
    """(step, per-layer λ): DIFF V1's λ (Eq.2), DIFF V2's mean λ; empty for the baseline."""


def summarise_run(attention: str, seed: int, config: Any, run_dir: Path, result: Any) -> RunSummary:
    """Collect the curves and final numbers of a run (also of one finished earlier)."""
    from diffattn.model import count_parameters
    from diffattn.train import read_metrics

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no metrics.jsonl records; the run did not log")
    train_curve = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val_curve = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    key = "lambda" if attention == "diff_v1" else "lambda_mean"
    lambda_curve = [(r["step"], r[key]) for r in records if key in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:] or [math.nan]
    tail = [loss for _, loss in train_curve[-max(1, len(train_curve) // 10) :]]
    return RunSummary(
        attention=attention,
        seed=seed,
        run_dir=str(run_dir),
        parameters=count_parameters(config.model_config()),
        steps=records[-1]["step"],
        tokens=int(records[-1].get("tokens", result.tokens)),
        final_val_loss=val_curve[-1][1] if val_curve else math.nan,
        final_train_loss=statistics.fmean(tail),
        tokens_per_s=statistics.median(speeds),
        train_curve=train_curve,
        val_curve=val_curve,
        lambda_curve=lambda_curve,
    )


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def table_rows(runs: list[RunSummary]) -> list[dict[str, Any]]:
    """One row per attention type (in run order), aggregated over seeds."""
    rows = []
    for attention in dict.fromkeys(r.attention for r in runs):
        mine = [r for r in runs if r.attention == attention]
        val_mean, val_std = _mean_std([r.final_val_loss for r in mine])
        last = mine[-1].lambda_curve[-1][1] if mine[-1].lambda_curve else None
        rows.append(
            {
                "attention": attention,
                "model": NAMES.get(attention, attention),
                "parameters": mine[0].parameters,
                "tokens": mine[0].tokens,
                "seeds": [r.seed for r in mine],
                "val_loss": val_mean,
                "val_loss_std": val_std,
                "train_loss": statistics.fmean(r.final_train_loss for r in mine),
                "tokens_per_s": statistics.fmean(r.tokens_per_s for r in mine),
                "final_lambda": last,
            }
        )
    return rows


def _format_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "parameters", "tokens", "val loss", "train loss", "tokens/s", "λ per layer"]
    body = []
    for row in rows:
        val = f"{row['val_loss']:.4f}"
        if len(row["seeds"]) > 1:
            val += f" ± {row['val_loss_std']:.4f}"
        lam = row["final_lambda"]
        body.append(
            [
                row["model"],
                f"{row['parameters']:,}",
                f"{row['tokens']:,}",
                val,
                f"{row['train_loss']:.4f}",
                f"{row['tokens_per_s']:,.0f}",
                "—" if lam is None else " ".join(f"{v:.3f}" for v in lam),
            ]
        )
    return header, body


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header, body = _format_rows(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def text_table(rows: list[dict[str, Any]]) -> str:
    header, body = _format_rows(rows)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        + [fmt.format(*cells) for cells in body]
    )


def write_report(
    out: Path, base: Any, runs: list[RunSummary], prepared: Any, elapsed_s: float
) -> tuple[Path, list[Path]]:
    """Write ``report.json``, the plots and ``report.md``; print the table."""
    from diffattn.compare.plots import plot_lambda, plot_losses
    from diffattn.train import dump_config

    rows = table_rows(runs)
    plots = [p for p in (plot_losses(out, runs), plot_lambda(out, runs)) if p is not None]
    stats = getattr(prepared, "stats", None)
    data = {
        "rows": rows,
        "runs": [asdict(r) for r in runs],
        "elapsed_s": elapsed_s,
        "data": asdict(stats) if hasattr(stats, "__dataclass_fields__") else str(stats),
        "tokenizer": getattr(getattr(prepared, "tokenizer", None), "name", None),
        "recipe": dump_config(base),
        "plots": [p.name for p in plots],
    }
    (out / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")

    tokens_per_step = base.global_batch_size * base.seq_len
    lines = [
        "# diffattn compare",
        "",
        f"Same tokens, order and seed for every model; {base.steps} steps of "
        f"{base.global_batch_size} × {base.seq_len} = {tokens_per_step:,} tokens. "
        f"Validation loss is the mean next-token loss on {base.eval_batches} held-out batches "
        "(held out by document); train loss is the mean of the last 10% of logged steps. "
        f"Total wall time {elapsed_s / 60:.1f} min.",
        "",
        markdown_table(rows),
        "",
        "λ per layer: DIFF V1's λ of Eq.2 (shared by the heads of a layer) and DIFF V2's mean "
        "token-wise λ = sigmoid(x·W_λ), at the last logged step.",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    if not plots:
        lines.append("(no plots: install matplotlib, e.g. `pip install 'diffattn[train]'`)")
    lines += ["", "## Data", "", f"- tokenizer: `{data['tokenizer']}`", f"- {data['data']}"]
    lines += ["", "## Recipe", "", "```yaml", dump_config(base).rstrip(), "```", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    print("\n" + text_table(rows))
    print(f"\nreport: {report}" + "".join(f"\nplot:   {out / p.name}" for p in plots))
    return report, plots
