"""The language-modelling part of ``diffattn compare``: its runs as jobs (train, or resume, or
reuse, then measure), run in this process or in a worker, and their summaries."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from diffattn.compare.arms import parse_arm
from diffattn.compare.evaluate import EvalSettings
from diffattn.compare.report import RunSummary, summarise_run


@dataclass
class _Job:
    """One (arm, seed) run: train (or resume, or reuse), then measure (``attention``: the
    arm's name)."""

    attention: str
    seed: int
    config: Any
    run_dir: Path
    progress: bool
    threads: int | None
    held_out: Any
    eval_settings: EvalSettings


def _train_and_measure(job: _Job) -> tuple[int, dict[str, Any], float, str]:
    """Run ``job`` (in this process or a worker) on the device the process holds (see
    :mod:`diffattn.compare.devices`); returns (tokens, measurements, seconds, device)."""
    import torch

    from diffattn.compare.devices import device_in_use
    from diffattn.compare.evaluate import evaluate_checkpoint
    from diffattn.data import prepare_data
    from diffattn.eval.common import resolve_device
    from diffattn.train import train
    from diffattn.train.checkpoint import latest_checkpoint

    if job.threads is not None:
        torch.set_num_threads(job.threads)
    device = device_in_use(str(job.config.device))  # the trainer's "cuda" is this device
    started = time.perf_counter()
    prepared = prepare_data(job.config.data_config(), progress=False)  # cached by the parent
    resume = latest_checkpoint(job.run_dir / "checkpoints") is not None
    result = train(job.config, job.run_dir, resume=resume, progress=job.progress, data=prepared)
    if result.stopped is not None:
        raise KeyboardInterrupt(f"{job.attention} seed {job.seed} stopped by {result.stopped}")
    evals: dict[str, Any] = {}
    if job.held_out is not None:
        evals = evaluate_checkpoint(
            latest_checkpoint(job.run_dir / "checkpoints"),
            job.run_dir,
            job.eval_settings,
            job.held_out,
            device=device if device.startswith("cuda") else resolve_device(str(job.config.device)),
        )
    return int(result.tokens), evals, time.perf_counter() - started, device


def needle_settings_for(settings: EvalSettings, sources: Sequence[str]) -> EvalSettings:
    """``settings`` with the needle digits and recall sizes of the mix's ``synthetic:`` sources,
    so the evaluation asks what the models were trained to retrieve."""
    from dataclasses import replace

    from diffattn.data.synthetic import is_synthetic_spec, parse_synthetic_spec

    for spec in sources:
        if is_synthetic_spec(spec):
            parsed = parse_synthetic_spec(spec)
            if parsed.task == "needle":
                settings = replace(settings, needle_digits=parsed.params["digits"])
            else:
                settings = replace(
                    settings,
                    recall_pairs=parsed.params["pairs"],
                    recall_queries=parsed.params["queries"],
                )
    return settings


def lm_work(
    options: Any,
    base: Any,
    configs: dict,
    out: Path,
    say: Any,
    threads: int | None,
    progress: bool,
) -> tuple[list[_Job], Any]:
    """Prepare the language-modelling data (in this process) and return the part's jobs, one
    per (arm, seed) of ``configs`` in ``out/runs/<arm directory>-seed<k>``, each run with
    ``threads`` torch threads (showing its progress bar when ``progress``), and the prepared
    data."""
    from diffattn.compare.evaluate import held_out_windows
    from diffattn.data import prepare_data

    say(f"diffattn compare: preparing data ({', '.join(base.data_config().sources)})")
    prepared = prepare_data(base.data_config(), progress=options.progress)
    held_out = None
    if options.evaluate:
        max_tokens = options.eval_settings.max_tokens
        if max_tokens is None:  # the trainer's own validation windows: one validation loss
            eval_rows = base.eval_batches * (base.eval_batch_size or base.global_batch_size)
            max_tokens = eval_rows * base.seq_len
        held_out = held_out_windows(prepared.valid, base.seq_len, max_tokens)
    settings = needle_settings_for(options.eval_settings, base.data_config().sources)
    work = [
        _Job(
            attention,
            seed,
            config,
            out / "runs" / f"{parse_arm(attention).directory}-seed{seed}",
            options.progress and progress,
            threads,
            held_out,
            settings,
        )
        for (attention, seed), config in configs.items()
    ]
    return work, prepared


def lm_summaries(work: list[_Job], done: dict[int, tuple]) -> list[RunSummary]:
    """The summary of every finished job of the language-modelling part (``done[i]``: job i's
    tokens, measurements, seconds and device)."""
    summaries: list[RunSummary] = []
    for index, job in enumerate(work):
        tokens, evals, _, device = done[index]
        result = SimpleNamespace(tokens=tokens)
        summary = summarise_run(job.attention, job.seed, job.config, job.run_dir, result)
        summary.evals = evals
        summary.device = device
        summaries.append(summary)
    return summaries


def lm_finished_line(job: _Job, result: tuple, done: int, total: int) -> str:
    """The progress line of a finished language-modelling run."""
    return (
        f"[{done}/{total}] {job.attention}, seed {job.seed}: "
        f"{result[2]:.0f} s on {result[3]} -> {job.run_dir}"
    )
