"""The sweep of ``diffattn scaling`` (:func:`run_scaling`) and the fit of finished runs
(:func:`fit_results`); see the package's documentation for the layout of ``OUT``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diffattn.compare.arms import parse_arms
from diffattn.scaling.plan import (
    AXES,
    COUNTS,
    PlannedRun,
    ScalingOptions,
    default_recipe,
    plan_runs,
    plan_text,
)
from diffattn.scaling.points import Point, read_points

PLAN_NAME = "scaling.yaml"


def _finished(run: PlannedRun, run_dir: Path) -> dict[int, float] | None:
    """The validation losses of a run that already reached its last step, else ``None``."""
    from diffattn.train import read_metrics
    from diffattn.train.checkpoint import latest_checkpoint, list_checkpoints

    if latest_checkpoint(run_dir / "checkpoints") is None:
        return None
    last_step = list_checkpoints(run_dir / "checkpoints")[-1][0]
    if last_step != run.config.steps:
        return None
    losses = {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}
    return losses if all(step in losses for step, _ in run.points) else None


def _run_points(run: PlannedRun, losses: dict[int, float], run_dir: Path) -> list[Point]:
    missing = [step for step, _ in run.points if step not in losses]
    if missing:
        raise ValueError(
            f"{run_dir}: no validation loss at step(s) {missing}; the held-out split may be "
            "too small for one evaluation batch (lower eval_batch_size or add data)"
        )
    return [
        Point(run.attention, float(x), float(losses[step]), f"{run_dir}@{step}")
        for step, x in run.points
    ]


def run_scaling(options: ScalingOptions) -> dict[str, Any]:
    """Train (or reuse) every run of the sweep, fit, and write the report into ``OUT``."""
    from diffattn.data import prepare_data
    from diffattn.fileio import use_plan_directory
    from diffattn.scaling import report
    from diffattn.train import train
    from diffattn.train.checkpoint import latest_checkpoint

    say = print if options.progress else (lambda *a, **k: None)
    base, runs = plan_runs(options)
    out = Path(options.out)
    use_plan_directory(out, PLAN_NAME, plan_text(options, base, runs), options.overwrite, "a sweep")
    started = time.perf_counter()
    say(f"diffattn scaling: preparing data ({', '.join(base.data_config().sources)})")
    prepared = prepare_data(base.data_config(), progress=options.progress)
    points: list[Point] = []
    for index, run in enumerate(runs, start=1):
        run_dir = out / "runs" / run.name
        losses = _finished(run, run_dir)
        if losses is not None:
            say(f"[{index}/{len(runs)}] {run.name}: finished earlier, reused")
        else:
            resume = latest_checkpoint(run_dir / "checkpoints") is not None
            say(
                f"\n[{index}/{len(runs)}] {run.name}: {run.parameters:,} parameters "
                f"({run.non_embedding:,} non-embedding), {run.config.steps} steps -> {run_dir}"
            )
            result = train(
                run.config, run_dir, resume=resume, progress=options.progress, data=prepared
            )
            if result.stopped is not None:
                raise KeyboardInterrupt(f"{run.name} stopped by {result.stopped}")
            losses = _finished(run, run_dir) or dict(result.val_losses)
        points += _run_points(run, losses, run_dir)
    fitted = report.fit_all(points, options.axis)
    settings = {
        "axis": options.axis,
        "count": options.count,
        "sizes": list(options.sizes),
        "tokens": list(options.tokens),
        "attentions": list(options.attentions),
        "recipe": str(options.config or default_recipe()),
        "overrides": list(options.overrides),
        "steps": {run.name: run.config.steps for run in runs},
        "parameters": {run.name: run.parameters for run in runs},
        "non_embedding_parameters": {run.name: run.non_embedding for run in runs},
        "seconds": round(time.perf_counter() - started, 1),
    }
    paths = report.write(out, fitted, options.axis, options.count, settings, _header())
    say("\n" + paths[2])
    say(f"wrote {paths[0]}, {paths[1]}, {out / 'scaling.png'}")
    return fitted


def fit_results(
    sources: Sequence[str | Path],
    out: str | Path,
    axis: str = ScalingOptions.axis,
    count: str = ScalingOptions.count,
    attentions: tuple[str, ...] = ScalingOptions.attentions,
    progress: bool = ScalingOptions.progress,
) -> dict[str, Any]:
    """Fit and report the points of finished runs or files (:func:`.points.read_points`);
    the defaults are those of :class:`~diffattn.scaling.ScalingOptions`."""
    from diffattn.scaling import report

    if axis not in AXES:
        raise ValueError(f"--axis: choose one of {', '.join(AXES)}, got {axis!r}")
    if count not in COUNTS:
        raise ValueError(f"--count: choose one of {', '.join(COUNTS)}, got {count!r}")
    if not sources:
        raise ValueError("--from-results: give run directories or a .json/.csv file")
    wanted = {arm.name for arm in parse_arms(attentions, "--attention")}
    points = [p for p in read_points(list(sources), axis, count) if p.attention in wanted]
    fitted = report.fit_all(points, axis)
    settings = {"axis": axis, "count": count, "from_results": [str(s) for s in sources]}
    paths = report.write(Path(out), fitted, axis, count, settings, _header())
    if progress:
        print(paths[2])
        print(f"wrote {paths[0]}, {paths[1]}, {Path(out) / 'scaling.png'}")
    return fitted


def _header() -> str:
    import sys

    import torch

    from diffattn.version import __version__

    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    return (
        "# diffattn scaling\n\n"
        f"Command: `{command}`  \ndiffattn {__version__}, torch {torch.__version__}\n"
    )
