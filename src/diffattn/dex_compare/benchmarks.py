"""The benchmarks of ``diffattn dex compare``: every compared model (the pretrained one and each
trained method) on the same zero-shot multiple-choice items, needle prompts and many-shot
in-context task, through the importable ``run`` functions of ``diffattn eval``.

* ``mc`` (:func:`diffattn.eval.mc.run`): zero-shot HellaSwag, ARC-Easy and PIQA by default,
  acc and acc_norm as lm-evaluation-harness defines them (the benchmarks of the Dex paper's
  Tab. 1 and DIFF V1 Tab. 1), on the first ``mc_limit`` validation items of each task.
* ``needle`` (:func:`diffattn.eval.needle.run`): multi-needle retrieval accuracy (DIFF V1
  §3.4) and the attention the last prompt token puts on the answer and on the context outside
  the needles (DIFF V1 Tab. 3; for Dex the effective attention of App. F.3 Eq. 6, as in the
  Dex paper's Tab. 2).
* ``icl`` (:func:`diffattn.eval.icl.run`): the synthetic many-class task with constrained
  decoding over the label set (DIFF V1 §3.5), accuracy per number of demonstrations.

Each model is measured right after it is trained and then released, so only one model of the
comparison is in memory at a time. Wall time is recorded per benchmark and per item, to size
a recipe from a measured run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torch import nn

EVALS = ("mc", "needle", "icl")
MC_METRIC = "acc_norm"


@dataclass
class BenchmarkSettings:
    """What ``dex compare`` measures on every model besides the held-out loss."""

    evals: tuple[str, ...] = EVALS
    mc_tasks: tuple[str, ...] = ("hellaswag", "arc_easy", "piqa")
    mc_data: tuple[str, ...] = ()
    """``--data`` entries of ``eval mc`` (``[TASK=]PATH``); empty: the tasks' offline sets."""
    mc_source: str = "auto"
    mc_limit: int | None = 100
    needle_needles: int = 4
    needle_lengths: tuple[int, ...] = (512,)
    needle_depths: tuple[float, ...] = (0.0, 50.0, 100.0)
    needle_samples: int = 4
    icl_classes: int = 20
    icl_shots: tuple[Any, ...] = (4, 32)
    icl_test_items: int = 50
    icl_budget: int | None = None
    batch_size: int = 8
    seed: int = 0
    quiet: bool = field(default=True, compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchmarkSettings:
        """Settings from a recipe's ``benchmarks`` mapping; unknown keys are an error."""
        if not isinstance(data, Mapping):
            raise ValueError(f"benchmarks must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"benchmarks: unknown setting(s) {unknown}; known: {sorted(known)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """A ``ValueError`` naming the first bad setting (before any model is trained)."""
        from diffattn.eval.icl import parse_shots
        from diffattn.eval.mc import check_settings

        bad = [e for e in self.evals if e not in EVALS]
        if bad or not self.evals or len(set(self.evals)) != len(self.evals):
            raise ValueError(f"evals must be distinct names among {', '.join(EVALS)}, got {bad}")
        if "mc" in self.evals:
            check_settings(self.mc_tasks, self.mc_data, 0, self.mc_limit, self.batch_size)
        if "needle" in self.evals:
            counts = (self.needle_needles, self.needle_samples, *self.needle_lengths)
            if not self.needle_lengths or min(counts) < 1:
                raise ValueError(
                    "needle_needles, needle_samples and needle_lengths must be at least 1"
                )
        if "icl" in self.evals:
            parse_shots(self.icl_shots)
            if self.icl_test_items < 1 or self.icl_classes < 2:
                raise ValueError("icl_test_items must be at least 1 and icl_classes at least 2")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("quiet")
        return data


def eval_model(model: nn.Module, name: str, spec: str, tokenizer: Any, kind: str) -> Any:
    """``model`` as a :class:`~diffattn.eval.common.EvalModel` in eval mode."""
    from diffattn.eval.common import EvalModel
    from diffattn.loading import TextTokenizer

    config = getattr(model, "config", None)
    attention = str(getattr(config, "model_type", "unknown")) + ("+dex" if kind == "dex" else "")
    return EvalModel(name, spec, model.eval(), TextTokenizer(tokenizer), kind, attention)


def _timed(
    count_items: Callable[[dict[str, Any]], int], function: Any, *args: Any, **kwargs: Any
) -> dict[str, Any]:
    """``function(*args, **kwargs)``'s result, its ``seconds`` and ``seconds_per_item`` (the
    result holding ``count_items(result)`` items)."""
    start = time.perf_counter()
    result = function(*args, **kwargs)
    seconds = time.perf_counter() - start
    return {"result": result, "seconds": seconds, "seconds_per_item": seconds / count_items(result)}


def evaluate(model: Any, settings: BenchmarkSettings) -> dict[str, Any]:
    """Every benchmark of ``settings`` on one :class:`EvalModel`; the raw results of each
    ``run`` with ``seconds`` and ``seconds_per_item`` beside them."""
    from diffattn.eval import icl, mc, needle

    out: dict[str, Any] = {}
    common = {"seed": settings.seed, "batch_size": settings.batch_size, "quiet": settings.quiet}
    if "mc" in settings.evals:
        out["mc"] = _timed(
            lambda result: sum(t["items"] for t in result["tasks"].values()),
            mc.run,
            [model],
            tasks=list(settings.mc_tasks) or None,
            data=list(settings.mc_data),
            source=settings.mc_source,
            limit=settings.mc_limit,
            **common,
        )
    if "needle" in settings.evals:
        out["needle"] = _timed(
            lambda result: sum(c["n"] for c in result["models"][model.name]["cells"]),
            needle.run,
            [model],
            needles=settings.needle_needles,
            lengths=settings.needle_lengths,
            depths=settings.needle_depths,
            samples=settings.needle_samples,
            **common,
        )
    if "icl" in settings.evals:
        out["icl"] = _timed(
            lambda result: len(result["models"][model.name]["runs"]) * result["test_items"],
            icl.run,
            [model],
            classes=settings.icl_classes,
            shots=settings.icl_shots,
            budget=settings.icl_budget,
            test_items=settings.icl_test_items,
            **common,
        )
    return out


def summary(name: str, measured: Mapping[str, Any]) -> dict[str, Any]:
    """The headline figures of one model's :func:`evaluate` result, with standard errors:
    ``mc/<task>`` (acc_norm), ``mc/mean``, ``needle`` (accuracy), ``needle/answer_mass``,
    ``needle/noise_mass`` and ``icl/<shots>`` (accuracy)."""
    figures: dict[str, tuple[float, float]] = {}
    if "mc" in measured:
        tasks = measured["mc"]["result"]["models"][name]
        for task, scores in tasks.items():
            figures[f"mc/{task}"] = (scores[MC_METRIC], scores[f"{MC_METRIC}_stderr"])
        values = [scores[MC_METRIC] for scores in tasks.values()]
        errors = [scores[f"{MC_METRIC}_stderr"] for scores in tasks.values()]
        figures["mc/mean"] = (
            sum(values) / len(values),
            math.sqrt(sum(e * e for e in errors)) / len(errors),
        )
    if "needle" in measured:
        result = measured["needle"]["result"]["models"][name]
        outcomes = [o for cell in result["cells"] for o in cell["outcomes"]]
        figures["needle"] = (result["accuracy"], _binomial_stderr(result["accuracy"], outcomes))
        for key in ("answer_mass", "noise_mass"):
            cells = [c[key] for c in result["cells"] if key in c]
            if cells:
                figures[f"needle/{key}"] = (sum(cells) / len(cells), math.nan)
    if "icl" in measured:
        result = measured["icl"]["result"]["models"][name]
        for run in result["runs"]:
            figures[f"icl/{run['demonstrations']}-shot"] = (run["accuracy"], run["stderr"])
    return {key: {"value": v, "stderr": e} for key, (v, e) in figures.items()}


def _binomial_stderr(accuracy: float, outcomes: Sequence[int]) -> float:
    n = len(outcomes)
    return math.sqrt(accuracy * (1 - accuracy) / n) if n else math.nan


def timings(measured: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    return {
        key: {"seconds": value["seconds"], "seconds_per_item": value["seconds_per_item"]}
        for key, value in measured.items()
    }


def _cell(figure: Mapping[str, float] | None) -> str:
    if figure is None or figure["value"] is None or figure["value"] != figure["value"]:
        return "—"
    value, error = figure["value"], figure["stderr"]
    if error is None or error != error:
        return f"{value:.3f}"
    return f"{value:.3f} ± {error:.3f}"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table: one row per model, one column per headline figure (value ± stderr)."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row.get("benchmarks", {}) if k not in keys]
    header = ["method", "held-out loss", *keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        loss = row.get("val_loss")
        cells = [row["name"], "—" if loss is None else f"{loss:.4f}"]
        cells += [_cell(row.get("benchmarks", {}).get(k)) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(rows: Sequence[Mapping[str, Any]], first: str = "dex", second: str = "lora8") -> str:
    """Whether ``first`` beats ``second``, figure by figure: the difference with its
    standard error (independent items' errors combined), and "beats" only where it is larger
    than two standard errors. Empty when either is missing."""
    by = {r["method"]: r for r in rows if r.get("status") == "ok"}
    if first not in by or second not in by:
        return ""
    a, b = by[first], by[second]
    lines = [f"{a['name']} against {b['name']} (difference, ± standard error; > 2 SE is a win):"]
    loss = a["val_loss"] - b["val_loss"]
    lines.append(
        f"- held-out loss: {loss:+.4f} ({'lower' if loss < 0 else 'not lower'} for {a['name']})"
    )
    wins = losses = 0
    for key, fa in a.get("benchmarks", {}).items():
        fb = b.get("benchmarks", {}).get(key)
        if fb is None or key in ("needle/answer_mass", "needle/noise_mass"):
            continue
        diff = fa["value"] - fb["value"]
        se = math.sqrt(fa["stderr"] ** 2 + fb["stderr"] ** 2) if fa["stderr"] == fa["stderr"] else 0
        word = "tie"
        if se > 0 and abs(diff) > 2 * se:
            word = "win" if diff > 0 else "loss"
            wins, losses = wins + (diff > 0), losses + (diff < 0)
        lines.append(f"- {key}: {diff:+.3f} ± {se:.3f} ({word})")
    beats = loss < 0 and wins > 0 and losses == 0
    lines.append(
        f"- overall: {a['name']} {'beats' if beats else 'does not beat'} {b['name']} here "
        f"({wins} significant wins, {losses} significant losses on the benchmarks)"
    )
    return "\n".join(lines)


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Grouped bars: each headline accuracy (x) per model (bars), with ±1 SE whiskers."""
    try:
        from diffattn.eval.common import pyplot, save_figure

        plt = pyplot()
    except ImportError:
        return None
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row.get("benchmarks", {}) if "mass" not in k and k not in keys]
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(keys) + 2), 4))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        figures = [row.get("benchmarks", {}).get(k) for k in keys]
        values = [f["value"] if f else math.nan for f in figures]
        errors = [f["stderr"] if f and f["stderr"] == f["stderr"] else 0.0 for f in figures]
        ax.bar(
            [j + (i - (len(rows) - 1) / 2) * width for j in range(len(keys))],
            values,
            width,
            yerr=errors,
            label=row["name"],
            capsize=2,
        )
    ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right")
    ax.set_ylabel("accuracy (mc: acc_norm)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return path
