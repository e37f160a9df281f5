"""The comparison report: one row per arm, with the spread over seeds.

Each arm is named by its declaration's ``title`` and its changes
(:attr:`diffattn.compare.arms.Arm.title`); differences are taken against the baseline
(:data:`~diffattn.compare.arms.REFERENCE`).

``results.json`` holds everything (settings, every run with its curves and measurements, the
claims with their verdicts); ``report.md`` shows the claims table, the measurements, the
validation-noise check, the training table and the plots; the tables are printed at the end.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diffattn.compare.arms import REFERENCE, arm_of, title_of


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
    """(step, per-layer λ) under the type's ``lambda_key`` (DIFF V1's λ of Eq.2, DIFF V2's
    mean λ); empty for a type without λ (the baseline)."""
    evals: dict[str, Any] = field(default_factory=dict)
    """The measurements of :mod:`diffattn.compare.evaluate` (empty when not evaluated)."""
    device: str | None = None
    """The device the run trained on in this invocation: ``cpu`` or ``cuda:i``, i counted among
    the devices ``CUDA_VISIBLE_DEVICES`` exposes (:mod:`diffattn.compare.devices`)."""


def summarise_run(attention: str, seed: int, config: Any, run_dir: Path, result: Any) -> RunSummary:
    """Collect the curves and final numbers of a run (also of one finished earlier)."""
    from diffattn.model import count_parameters
    from diffattn.train import read_metrics

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no metrics.jsonl records; the run did not log")
    train_curve = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val_curve = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    arm = arm_of(attention)
    key = None if arm is None else arm.lambda_key
    lambda_curve = [(r["step"], r[key]) for r in records if key is not None and key in r]
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
    """One row per arm (in run order), aggregated over seeds."""
    rows = []
    for attention in dict.fromkeys(r.attention for r in runs):
        mine = [r for r in runs if r.attention == attention]
        val_mean, val_std = _mean_std([r.final_val_loss for r in mine])
        last = mine[-1].lambda_curve[-1][1] if mine[-1].lambda_curve else None
        rows.append(
            {
                "attention": attention,
                "model": title_of(attention),
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


MEASUREMENTS: tuple[tuple[str, str, str], ...] = (
    ("val_loss", "val loss", ".4f"),
    ("ar_hit", "AR-Hit", ".4f"),
    ("others", "Others", ".4f"),
    ("recall_acc", "associative recall acc.", ".3f"),
    ("needle_acc", "needle (mean)", ".3f"),
    ("needle_1_1", "needle N=1 R=1", ".3f"),
    ("needle_2_2", "needle N=2 R=2", ".3f"),
    ("needle_4_2", "needle N=4 R=2", ".3f"),
    ("needle_6_2", "needle N=6 R=2", ".3f"),
    ("answer_share", "attention to answer", ".3f"),
    ("noise_share", "attention noise", ".3f"),
    ("logit_top1", "top-1 abs logit", ".2f"),
    ("logit_median", "median abs logit", ".3f"),
    ("hidden_top1", "top-1 abs hidden", ".2f"),
    ("hidden_median", "median abs hidden", ".3f"),
    ("quant_loss_8", "loss, 8-bit logits", ".4f"),
    ("quant_loss_6", "loss, 6-bit logits", ".4f"),
    ("quant_loss_4", "loss, 4-bit logits", ".4f"),
)
"""Rows of the measurement table: (key in the evals, label, format)."""


def per_seed_evals(runs: list[RunSummary]) -> dict[str, list[dict[str, Any]]]:
    """``{attention: [evals of seed 0, seed 1, ...]}`` over the evaluated runs."""
    out: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: r.seed):
        if run.evals:
            out.setdefault(run.attention, []).append(run.evals)
    return out


def measurement_table(per_seed: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: one row per measurement, one column per model (mean ± sd over seeds)."""
    models = list(per_seed)
    lines = [
        "| measurement | " + " | ".join(title_of(m) for m in models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for key, label, fmt in MEASUREMENTS:
        cells = []
        for model in models:
            values = [float(e[key]) for e in per_seed[model] if e.get(key) is not None]
            values = [v for v in values if not math.isnan(v)]
            if not values:
                cells.append("—")
                continue
            mean, std = _mean_std(values)
            cells.append(f"{mean:{fmt}}" + (f" ± {std:{fmt}}" if len(values) > 1 else ""))
        if any(c != "—" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def validation_noise(per_seed: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per arm other than the baseline: the held-out loss difference to the baseline, paired by
    window within each seed (mean difference and its standard error over windows, averaged over
    seeds), next to the spread of the difference over seeds."""
    base = per_seed.get(REFERENCE)
    rows: list[dict[str, Any]] = []
    if not base:
        return rows
    for model, evals in per_seed.items():
        if model == REFERENCE or len(evals) != len(base):
            continue
        window_diffs, window_sems, seed_diffs = [], [], []
        for mine, ref in zip(evals, base, strict=True):
            a, b = mine.get("window_loss") or [], ref.get("window_loss") or []
            if len(a) != len(b) or len(a) < 2:
                continue
            d = [x - y for x, y in zip(a, b, strict=True)]
            window_diffs.append(statistics.fmean(d))
            window_sems.append(statistics.stdev(d) / math.sqrt(len(d)))
            seed_diffs.append(mine["val_loss"] - ref["val_loss"])
        if not window_diffs:
            continue
        rows.append(
            {
                "model": model,
                "windows": len(evals[0].get("window_loss") or []),
                "difference": statistics.fmean(seed_diffs),
                "window_sem": statistics.fmean(window_sems),
                "seed_sd": statistics.stdev(seed_diffs) if len(seed_diffs) > 1 else math.nan,
            }
        )
    return rows


def outcome_sentences(verdicts: list[Any]) -> list[str]:
    """Plain sentences on the validation loss of each arm against the Transformer (they say so
    when the arm loses): the loss claim's verdict, or an arm's measured difference."""
    from diffattn.compare.claims import HIGHER, LOWER

    lines = []
    for v in verdicts:
        if v.claim.key != "val_loss":
            continue
        name = title_of(v.model)
        size = f"{abs(v.mean):.4f} nats ({v.measured()})"
        if v.verdict in ("supported", LOWER):
            lines.append(
                f"- {name} reaches a lower validation loss than the Transformer, by {size}."
            )
        elif v.verdict in ("not supported", HIGHER):
            lines.append(
                f"- {name} loses to the Transformer at this size: its validation loss is higher "
                f"by {size}."
            )
        else:
            lines.append(
                f"- {name} and the Transformer cannot be told apart on validation loss at this "
                f"size: the difference is {v.measured()}."
            )
    return lines


def write_report(
    out: Path,
    base: Any,
    runs: list[RunSummary],
    prepared: Any,
    elapsed_s: float,
    z: float = 2.0,
    retrieval: tuple[list[str], dict[str, Any], list[Path]] | None = None,
) -> tuple[Path, list[Path]]:
    """Write ``results.json``, the plots and ``report.md``; print the tables.

    ``runs`` may be empty (the language-modelling part not run); ``retrieval`` is the
    retrieval experiment's section (:func:`~diffattn.compare.retrieval_report.retrieval_section`)
    when it ran."""
    from diffattn.compare.plots import plot_evals, plot_lambda, plot_losses

    rows = table_rows(runs)
    per_seed = per_seed_evals(runs)
    verdicts = judge_paper_claims(per_seed, z)
    noise = validation_noise(per_seed)
    plots = [
        p
        for p in (plot_losses(out, runs), plot_lambda(out, runs), plot_evals(out, per_seed))
        if p is not None
    ]
    retrieval_lines, retrieval_data, retrieval_plots = retrieval or ([], None, [])
    data = results_data(
        base, runs, prepared, elapsed_s, z, rows, verdicts, noise, plots, retrieval_data
    )
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    tmp.replace(out / "results.json")

    report = out / "report.md"
    lines = ["# diffattn compare", "", f"Total wall time {elapsed_s / 60:.1f} min.", ""]
    lines += retrieval_lines
    if not runs:
        report.write_text("\n".join(lines), encoding="utf-8")
        print(f"\nreport: {report}" + "".join(f"\nplot:   {p}" for p in retrieval_plots))
        return report, retrieval_plots
    seeds = sorted({r.seed for r in runs})
    lines += language_modelling_intro(base, seeds)
    lines += claims_section(verdicts, z, len(seeds))
    lines += measurements_section(per_seed)
    lines += validation_noise_section(noise)
    lines += training_section(base, rows, runs, plots)
    lines += data_and_recipe_section(base, data)
    report.write_text("\n".join(lines), encoding="utf-8")
    plots = retrieval_plots + plots
    print_summary(rows, verdicts)
    print(f"\nreport: {report}" + "".join(f"\nplot:   {out / p.name}" for p in plots))
    return report, plots


def judge_paper_claims(per_seed: dict[str, list[dict[str, Any]]], z: float) -> list[Any]:
    """The verdicts on the papers' claims (:data:`~diffattn.compare.claims.PAPER_CLAIMS`) for
    the arms they are about, and every other arm's measured differences
    (:func:`~diffattn.compare.claims.evaluate_claims`); ``[]`` unless the baseline and at least
    one other arm were evaluated."""
    from diffattn.compare.claims import PAPER_CLAIMS, claimed_arms, evaluate_claims

    if REFERENCE in per_seed and len(per_seed) > 1:
        return evaluate_claims(PAPER_CLAIMS, per_seed, z=z, claimed=claimed_arms(per_seed))
    return []


def results_data(
    base: Any,
    runs: list[RunSummary],
    prepared: Any,
    elapsed_s: float,
    z: float,
    rows: list[dict[str, Any]],
    verdicts: list[Any],
    noise: list[dict[str, Any]],
    plots: list[Path],
    retrieval_data: dict[str, Any] | None,
) -> dict[str, Any]:
    """The content of ``results.json``: the table rows, the claims with their verdicts, the
    validation-noise check, every run, the data, the recipe and the plots' names."""
    from diffattn.train import dump_config

    stats = getattr(prepared, "stats", None)
    return {
        "rows": rows,
        "claims": [
            {
                "key": v.claim.key,
                "claim": v.claim.statement,
                "source": v.claim.source,
                "model": v.model,
                "prediction": v.claim.prediction,
                "differences": list(v.differences),
                "mean": v.mean,
                "stderr": v.stderr,
                "verdict": v.verdict,
                "paper_claim": v.claimed,
            }
            for v in verdicts
        ],
        "verdict_rule": {"z": z, "pairing": "by seed", "min_seeds": 2},
        "validation_noise": noise,
        "runs": [asdict(r) for r in runs],
        "elapsed_s": elapsed_s,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "data": asdict(stats) if hasattr(stats, "__dataclass_fields__") else str(stats),
        "tokenizer": getattr(getattr(prepared, "tokenizer", None), "name", None),
        "recipe": dump_config(base),
        "plots": [p.name for p in plots],
        "retrieval": retrieval_data,
    }


def language_modelling_intro(base: Any, seeds: list[int]) -> list[str]:
    """Markdown lines opening the language-modelling part: the seeds, steps, tokens and data
    every model shares."""
    tokens_per_step = base.global_batch_size * base.seq_len
    return [
        "## Language modelling",
        "",
        f"Same tokens, order and seed for every model; {len(seeds)} seed(s) "
        f"({', '.join(map(str, seeds))}); {base.steps} steps of "
        f"{base.global_batch_size} × {base.seq_len} = {tokens_per_step:,} tokens. "
        f"Data: {', '.join(base.data_config().sources)}.",
        "",
    ]


def claims_section(verdicts: list[Any], z: float, n_seeds: int) -> list[str]:
    """Markdown lines on the papers' claims: the loss outcome in sentences, the claims table and
    a warning below 3 seeds; ``[]`` without verdicts."""
    from diffattn.compare.claims import claims_table

    if not verdicts:
        return []
    lines = ["### The papers' claims at this scale", ""]
    lines += [*outcome_sentences(verdicts), ""]
    lines += [claims_table(verdicts, z), ""]
    if n_seeds < 3:
        lines += [
            f"With {n_seeds} seed(s) the spread is poorly known; every verdict is "
            "inconclusive below 2 seeds. Use `--seeds 3` or more.",
            "",
        ]
    return lines


def measurements_section(per_seed: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown lines with the measurement table and what its rows measure; ``[]`` when no run
    was evaluated."""
    if not per_seed:
        return []
    return [
        "### Measurements (mean ± sd over seeds)",
        "",
        measurement_table(per_seed),
        "",
        "The trainer's validation stream; needles at the trained length on the "
        "synthetic haystack; attention shares are the last prompt token's attention on the "
        "answer needles and on the context outside every needle, divided by the row's total "
        "(a differential map sums to 1 − λ); |logit| pools both maps of DIFF.",
        "",
    ]


def validation_noise_section(noise: list[dict[str, Any]]) -> list[str]:
    """Markdown lines with the rows of :func:`validation_noise` as a table and how to read it;
    ``[]`` without rows."""
    if not noise:
        return []
    lines = ["### Is the validation set large enough?", ""]
    lines += [
        "| model | windows | loss − Transformer | window-level s.e. (paired) | sd over seeds |",
        "|---|---|---|---|---|",
    ]
    for row in noise:
        lines.append(
            f"| {title_of(row['model'])} | {row['windows']} | "
            f"{row['difference']:+.4f} | {row['window_sem']:.4f} | {row['seed_sd']:.4f} |"
        )
    lines += [
        "",
        "A difference smaller than twice its window-level standard error is within the "
        "noise of the validation set; the sd over seeds is the noise of training.",
        "",
    ]
    return lines


def training_section(
    base: Any, rows: list[dict[str, Any]], runs: list[RunSummary], plots: list[Path]
) -> list[str]:
    """Markdown lines with the training table, the devices the runs used, how the columns are
    measured, and the plots (or how to get them)."""
    lines = ["### Training", "", markdown_table(rows), ""]
    lines += device_lines((r.attention, r.seed, r.device) for r in runs)
    lines += [
        "Validation loss here is the trainer's last evaluation "
        f"({base.eval_batches} held-out batches); train loss is the mean of the last 10% of "
        "logged steps. λ per layer: DIFF V1's λ of Eq.2 (shared by the heads of a layer) and "
        "DIFF V2's mean token-wise λ = sigmoid(x·W_λ), at the last logged step.",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    if not plots:
        lines.append("(no plots: install matplotlib, e.g. `pip install 'diffattn[train]'`)")
    return lines


def data_and_recipe_section(base: Any, data: dict[str, Any]) -> list[str]:
    """Markdown lines naming the tokenizer and the data (from the :func:`results_data` of the
    report), then the recipe as YAML."""
    from diffattn.train import dump_config

    lines = ["", "### Data", "", f"- tokenizer: `{data['tokenizer']}`", f"- {data['data']}"]
    lines += ["", "### Recipe", "", "```yaml", dump_config(base).rstrip(), "```", ""]
    return lines


def print_summary(rows: list[dict[str, Any]], verdicts: list[Any]) -> None:
    """Print the training table and one line per verdict."""
    print("\n" + text_table(rows))
    if verdicts:
        print()
        for v in verdicts:
            print(f"{title_of(v.model):8} {v.claim.key:13} {v.measured():28} {v.verdict}")


def device_lines(runs: Iterable[tuple[str, int, str | None]]) -> list[str]:
    """A markdown line naming the device of every (attention, seed, device) run, when any ran on
    a device other than the CPU; ``[]`` otherwise."""
    by_device: dict[str, list[str]] = {}
    for attention, seed, device in runs:
        by_device.setdefault(device or "unknown", []).append(f"{title_of(attention)} seed {seed}")
    if set(by_device) <= {"cpu", "unknown"}:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    among = f" (indices among CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    cells = "; ".join(
        f"`{d}`: {', '.join(names)}" for d, names in sorted(by_device.items(), key=_device_order)
    )
    return [f"Devices{among}: {cells}.", ""]


def _device_order(item: tuple[str, Any]) -> tuple[int, str]:
    return len(item[0]), item[0]  # cuda:2 before cuda:10


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
