"""Dex against LoRA and full fine-tuning on the same data, order and step budget.

The comparison of the Dex paper's Tab. 1 at small scale: every method starts from the same
pretrained model and trains with :func:`diffattn.train.train` on the same tokens in the same
order (same seed) for the same number of steps, with the App. F.1 recipe (AdamW, cosine
schedule, warm-up ratio 0.03): peak learning rate 1e-4 for the partial methods (Dex, LoRA with
r = 8 and r = 32 on q/k/v/o via PEFT, α = 2r) and 1e-5 for full fine-tuning. Dex adapts the
highest-entropy half of the heads of every layer (§3.2, §4.1) with T = half the run. The
held-out loss of the pretrained model and of each method is written to ``report.md`` and
``report.json`` with ``loss_curves.png`` (training and held-out loss over steps).

With :class:`~diffattn.dex_compare.benchmarks.BenchmarkSettings`, every model (the pretrained
one and each trained method, LoRA merged into its weights, Dex with its hooks) is also measured
on zero-shot multiple choice, needle retrieval and the synthetic many-shot ICL task right after
it is trained (:mod:`diffattn.dex_compare.benchmarks`); ``results.json`` then holds every raw
result with the settings, the command and the versions, ``benchmarks.png`` the accuracies, and
``report.md`` the table and whether Dex beats LoRA r = 8. A recipe file
(``configs/dex/smollm2.yaml``, :func:`load_recipe`) holds these settings.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from diffattn.dex import train as dex_train
from diffattn.dex_compare.benchmarks import BenchmarkSettings
from diffattn.fileio import check_output_directory, clear_output_directory
from diffattn.loading import ModelSource, load_model, resolve_source

METHODS = ("dex", "lora8", "lora32", "ft")
LABELS = {
    "base": "base (pretrained)",
    "dex": "Dex",
    "lora8": "LoRA r=8",
    "lora32": "LoRA r=32",
    "ft": "full fine-tuning",
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_factory(source: ModelSource, rank: int) -> Callable[[], nn.Module]:
    """A ``model_factory`` wrapping the pretrained model with PEFT LoRA on q/k/v/o."""

    def make() -> nn.Module:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as error:
            raise ValueError(f"the LoRA runs need peft: pip install peft ({error})") from None
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS
        )
        return get_peft_model(load_model(source, dtype=torch.float32).train(), config)

    return make


def full_factory(source: ModelSource) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = load_model(source, dtype=torch.float32).train()
        for param in model.parameters():
            param.requires_grad_(True)
        return model

    return make


def _curves(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]], float]:
    from diffattn.train import read_metrics

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    times = [r["step_time_s"] for r in records if "step_time_s" in r][1:] or [math.nan]
    return train, val, sorted(times)[len(times) // 2]


def _keeping(make: Callable[[], nn.Module], built: list[nn.Module]) -> Callable[[], nn.Module]:
    """``make`` that also appends what it builds to ``built`` (the model the trainer trains)."""

    def wrapped() -> nn.Module:
        built.append(make())
        return built[-1]

    return wrapped


def _for_eval(model: nn.Module, method: str) -> tuple[nn.Module, str]:
    """The trained model as it is evaluated, and its kind: LoRA merged into the base weights
    (a plain model, so attention probes see its softmax maps), Dex with its hooks (the needle
    attention then uses Dex's effective attention), full fine-tuning as it is."""
    if method.startswith("lora"):
        return model.merge_and_unload(), "hf"
    return model, "dex" if method == "dex" else "hf"


def _tokenizer(source: ModelSource) -> Any:
    from diffattn.loading import has_tokenizer, load_saved_tokenizer

    directory = source.model_dir
    if not has_tokenizer(directory):
        raise ValueError(
            f"model {source.spec!r} has no tokenizer stored with it; the benchmarks need one"
        )
    return load_saved_tokenizer(directory)


def _measure(
    model: nn.Module, method: str, spec: str, tokenizer: Any, kind: str, settings: Any
) -> dict[str, Any]:
    from diffattn.dex_compare.benchmarks import eval_model, evaluate

    was_training = model.training
    with torch.no_grad():
        found = evaluate(eval_model(model, method, spec, tokenizer, kind), settings)
    model.train(was_training)
    return found


def _attach(row: dict[str, Any], method: str, found: dict[str, Any], measured: dict) -> None:
    from diffattn.dex_compare.benchmarks import summary, timings

    row["benchmarks"] = summary(method, found)
    row["eval_timings"] = timings(found)
    measured[method] = found


def _benchmark_report(
    out: Path,
    report: dict[str, Any],
    rows: list[dict[str, Any]],
    measured: dict[str, Any],
    settings: BenchmarkSettings,
) -> list[str]:
    """Write ``results.json`` and ``benchmarks.png``; the report's benchmark section."""
    from diffattn.dex_compare import benchmarks
    from diffattn.eval.common import _plain
    from diffattn.version import __version__

    figure = benchmarks.plot(rows, out / "benchmarks.png")
    if figure is not None:
        report["plots"].append(figure.name)
    record = {
        "experiment": "dex compare",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "diffattn_version": __version__,
        "torch_version": torch.__version__,
        "settings": settings.to_dict(),
        "figures": list(report["plots"]),
        "results": {**report, "benchmarks": measured},
    }
    (out / "results.json").write_text(json.dumps(_plain(record), indent=2) + "\n")
    timing_lines = [
        f"- {row['name']}: "
        + ", ".join(
            f"{key} {t['seconds']:.1f} s ({t['seconds_per_item']:.2f} s/item)"
            for key, t in row["eval_timings"].items()
        )
        for row in rows
        if "eval_timings" in row
    ]
    return [
        "",
        "## Benchmarks",
        "",
        "Zero-shot multiple choice (acc_norm of lm-evaluation-harness, first "
        f"{settings.mc_limit} validation items per task), needle retrieval "
        f"({settings.needle_needles} needles, lengths {list(settings.needle_lengths)}, depths "
        f"{list(settings.needle_depths)}%, {settings.needle_samples} samples per cell; answer "
        "and noise mass of the last token's attention, effective attention for Dex) and the "
        f"synthetic {settings.icl_classes}-class ICL task ({settings.icl_test_items} test items, "
        "accuracy per number of demonstrations); value ± standard error over items.",
        "",
        benchmarks.table(rows),
        "",
        benchmarks.verdict(rows),
        "",
        "Evaluation wall time per model:",
        "",
        *timing_lines,
        "",
        f"![benchmarks]({figure.name})" if figure is not None else "(no plot: matplotlib)",
    ]


def load_recipe(path: str | Path) -> dict[str, Any]:
    """A ``dex compare`` recipe (YAML): ``steps``, ``methods``, ``set`` (``key=value``
    training-config entries) and ``benchmarks`` (:class:`BenchmarkSettings` fields, or
    ``false`` for none). Returns those keys with ``benchmarks`` as settings or ``None``."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"recipe {path}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path}: expected a mapping of settings")
    unknown = sorted(set(data) - {"steps", "methods", "set", "benchmarks"})
    if unknown:
        raise ValueError(f"recipe {path}: unknown key(s) {unknown}")
    overrides = data.get("set", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ValueError(f"recipe {path}: set must be a list of key=value strings")
    found = data.get("benchmarks", False)
    try:
        settings = None if found in (False, None) else BenchmarkSettings.from_dict(found)
    except (TypeError, ValueError) as error:
        raise ValueError(f"recipe {path}: {error}") from None
    return {
        "steps": data.get("steps"),
        "methods": data.get("methods"),
        "set": overrides,
        "benchmarks": settings,
    }


def compare_methods(
    model: str,
    out: str | Path,
    steps: int,
    overrides: Sequence[str] = (),
    methods: Sequence[str] | None = None,
    progress: bool = True,
    overwrite: bool = False,
    benchmarks: BenchmarkSettings | None = None,
) -> dict[str, Any]:
    """Train each method, evaluate, write the report; returns the ``report.json`` content.

    ``benchmarks``: also measure the pretrained model and every trained one on
    :mod:`diffattn.dex_compare.benchmarks` (the rows then carry ``benchmarks`` and
    ``eval_timings``).
    """
    from diffattn.compare.plots import plot_losses
    from diffattn.dex.selection import select_heads

    methods = _checked_methods(methods)
    out = Path(out)
    replace = check_output_directory(
        out,
        overwrite,
        option="--out",
        hint="choose another --out or pass --overwrite to replace it",
    )
    if benchmarks is not None:
        benchmarks.check()
    source, pretrained, config, tokenizer, data = _load(
        model, steps, overrides, benchmarks, progress
    )
    t_start = time.perf_counter()
    base_loss = dex_train.held_out_loss(pretrained, config, data)
    heads = select_heads(pretrained, dex_train.calibration_batches(config, data), "entropy")
    rows: list[dict[str, Any]] = [_base_row(base_loss)]
    measured: dict[str, Any] = {}
    if benchmarks is not None:
        found = _measure(pretrained, "base", model, tokenizer, "hf", benchmarks)
        _attach(rows[0], "base", found, measured)
    del pretrained
    anneal = max(1, steps // 2)
    factories = _factories(source, heads, anneal)
    bench = None if benchmarks is None else _Benchmarking(model, tokenizer, benchmarks, measured)
    runs = []
    if replace:  # every input is valid: the old contents go now, as a whole
        clear_output_directory(out)
    for method in methods:
        make, lr = factories[method]
        row, run = _train_method(method, make, lr, config, data, out, base_loss, progress, bench)
        rows.append(row)
        if run is not None:
            runs.append(run)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_losses(out, runs)
    elapsed = time.perf_counter() - t_start
    report = _report_record(model, steps, config, data, heads, anneal, rows, elapsed, plot)
    _write_report(out, report, config, plot, measured, benchmarks)
    return report


def _report_record(
    model: str,
    steps: int,
    config: Any,
    data: Any,
    heads: Any,
    anneal: int,
    rows: list[dict[str, Any]],
    elapsed: float,
    plot: Path | None,
) -> dict[str, Any]:
    """``report.json``: the setting shared by every method, the selected heads, the rows."""
    return {
        "model": model,
        "steps": steps,
        "tokens_per_step": config.global_batch_size * config.seq_len,
        "seed": config.seed,
        "heads": heads.to_dict(),
        "anneal_steps": anneal,
        "rows": rows,
        "elapsed_s": elapsed,
        "tokenizer": getattr(data.tokenizer, "name", None),
        "plots": [plot.name] if plot is not None else [],
    }


def _checked_methods(methods: Sequence[str] | None) -> list[str]:
    """The methods to train (all of :data:`METHODS` when ``None``); refuses unknown ones."""
    methods = list(METHODS if methods is None else methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods must be among {', '.join(METHODS)}, got {methods!r}")
    return methods


def _load(
    model: str,
    steps: int,
    overrides: Sequence[str],
    benchmarks: BenchmarkSettings | None,
    progress: bool,
) -> tuple[ModelSource, nn.Module, Any, Any, Any]:
    """The pretrained model (checked to be one Dex supports), the training config every method
    shares, the tokenizer the benchmarks need (``None`` without them) and the prepared data."""
    source = resolve_source(model)
    pretrained = load_model(source, dtype=torch.float32).train()
    dex_train.check_supported(pretrained, source)
    config = dex_train.base_config(source, steps, overrides)
    tokenizer = _tokenizer(source) if benchmarks is not None else None
    data = dex_train.prepare(config, progress=progress)
    return source, pretrained, config, tokenizer, data


def _base_row(base_loss: float) -> dict[str, Any]:
    """The pretrained model's row: nothing trained, Δ = 0 by definition."""
    return {
        "method": "base",
        "name": LABELS["base"],
        "trainable_parameters": 0,
        "lr": None,
        "val_loss": base_loss,
        "delta": 0.0,
        "train_loss": None,
        "step_time_s": None,
        "status": "ok",
    }


def _factories(
    source: ModelSource, heads: Any, anneal: int
) -> dict[str, tuple[Callable[[], nn.Module], float]]:
    """Per method, the model factory and the peak learning rate (Dex paper App. F.1: 1e-4 for
    Dex and LoRA, 1e-5 for full fine-tuning); Dex adapts ``heads`` with T = ``anneal``."""
    from diffattn.dex.adapter import apply

    def dex_make() -> nn.Module:
        return apply(load_model(source, dtype=torch.float32).train(), heads, anneal_steps=anneal)

    return {
        "dex": (dex_make, dex_train.DEX_LR),
        "lora8": (lora_factory(source, 8), dex_train.DEX_LR),
        "lora32": (lora_factory(source, 32), dex_train.DEX_LR),
        "ft": (full_factory(source), dex_train.FULL_FT_LR),
    }


@dataclass
class _Benchmarking:
    """What measuring each trained model needs: the model's spec (for the names), the
    tokenizer, the settings, and the raw results gathered so far by method."""

    model: str
    tokenizer: Any
    settings: BenchmarkSettings
    measured: dict[str, Any]


def _train_method(
    method: str,
    make: Callable[[], nn.Module],
    lr: float,
    config: Any,
    data: Any,
    out: Path,
    base_loss: float,
    progress: bool,
    bench: _Benchmarking | None,
) -> tuple[dict[str, Any], SimpleNamespace | None]:
    """Train one method on the shared data and order at learning rate ``lr`` into
    ``out/runs/METHOD``; its row and loss curves (``None`` when it diverged: the row says so).
    With ``bench``, the trained model is measured as it is evaluated (:func:`_for_eval`)."""
    from diffattn.train import TrainingDiverged, train
    from diffattn.train.config import ConfigError

    run_config = config.replace(optim={**config.to_dict()["optim"], "lr": lr})
    run_dir = out / "runs" / method
    row = {"method": method, "name": LABELS[method], "lr": lr}
    built: list[nn.Module] = []
    try:
        result = train(
            run_config,
            run_dir,
            progress=progress,
            callbacks=dex_train.dex_callbacks() if method == "dex" else (),
            data=data,
            model_factory=_keeping(make, built),
        )
    except ConfigError as error:
        raise ValueError(str(error)) from None
    except TrainingDiverged as error:
        row.update(status=f"diverged: {error}", val_loss=math.nan, delta=math.nan)
        row.update(trainable_parameters=None, train_loss=None, step_time_s=None)
        return row, None
    val = result.val_losses.get(result.step, math.nan)
    train_curve, val_curve, step_time = _curves(run_dir)
    tail = [loss for _, loss in train_curve[-max(1, len(train_curve) // 10) :]]
    row.update(
        trainable_parameters=result.trainable_parameters,
        val_loss=val,
        delta=val - base_loss,
        train_loss=sum(tail) / len(tail),
        step_time_s=step_time,
        status="ok",
    )
    if bench is not None:
        trained, kind = _for_eval(built[-1], method)
        spec = f"{bench.model} ({method})"
        found = _measure(trained, method, spec, bench.tokenizer, kind, bench.settings)
        _attach(row, method, found, bench.measured)
        del trained
    built.clear()
    gc.collect()
    return row, SimpleNamespace(
        attention=LABELS[method], train_curve=train_curve, val_curve=val_curve
    )


def _write_report(
    out: Path,
    report: dict[str, Any],
    config: Any,
    plot: Path | None,
    measured: dict[str, Any],
    benchmarks: BenchmarkSettings | None,
) -> None:
    """Write ``report.md`` and ``report.json`` (and, with benchmarks, ``results.json`` and
    ``benchmarks.png``) and print the tables."""
    rows = report["rows"]
    table = markdown_table(rows)
    lines = [
        "# diffattn dex compare",
        "",
        f"Model `{report['model']}`; every method trains {report['steps']} steps of "
        f"{config.global_batch_size} × {config.seq_len} tokens on the same data in the same "
        f"order (seed {config.seed}), "
        "AdamW with a cosine schedule and 3% warm-up (Dex paper App. F.1): peak learning rate "
        "1e-4 for Dex and LoRA (q/k/v/o, α = 2r), 1e-5 for full fine-tuning. Held-out loss is "
        f"the mean next-token loss on {config.eval_batches} held-out batches; Δ is against the "
        f"pretrained model. Dex adapts the highest-entropy half of each layer's heads "
        f"(§3.2) with T = {report['anneal_steps']}. Total wall time "
        f"{report['elapsed_s'] / 60:.1f} min.",
        "",
        table,
        "",
    ]
    lines.append(f"![loss curves]({plot.name})" if plot is not None else "(no plot: matplotlib)")
    if benchmarks is not None:
        lines += _benchmark_report(out, report, rows, measured, benchmarks)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n" + table)
    if benchmarks is not None:
        from diffattn.dex_compare.benchmarks import table as benchmark_table
        from diffattn.dex_compare.benchmarks import verdict

        print("\n" + benchmark_table(rows) + "\n\n" + verdict(rows))
    print(f"\nreport: {out / 'report.md'}")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = ["method", "trainable", "lr", "held-out loss", "Δ vs base", "train loss", "s/step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def num(value: Any, fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    for row in rows:
        cells = [
            row["name"],
            num(row.get("trainable_parameters"), ","),
            num(row.get("lr"), "g"),
            num(row.get("val_loss"), ".4f"),
            num(row.get("delta"), "+.4f"),
            num(row.get("train_loss"), ".4f"),
            num(row.get("step_time_s"), ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
