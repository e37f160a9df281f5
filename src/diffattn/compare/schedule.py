"""Both parts of ``diffattn compare`` in one pool of worker processes.

Run one part after the other and each part ends with fewer runs than workers (nine runs on two
workers: the ninth trains alone), the language-modelling data is prepared while no run trains,
and every worker process starts twice. With one pool for both parts (where both plan the same
workers: :func:`~diffattn.compare.devices.plan_workers`) the parent submits the first
retrieval runs, prepares the language-modelling data while they train, then submits the
language-modelling runs (the longer ones) and the rest of the retrieval runs, so the cores stay
busy until the last run and a short run is the one that finishes alone.

Every run is the same computation as in its own part (the same function, settings, seed and
threads, in a worker of the same kind), so no result changes; only the order in which runs
start does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def shared_plan(options: Any, base: Any, configs: dict, retrieval: Any) -> tuple | None:
    """``(jobs, threads, devices)`` when both parts would run on the same workers (more than
    one) and can share a pool, else ``None`` (each part then runs on its own)."""
    from diffattn.compare.arms import parse_arms
    from diffattn.compare.devices import plan_workers

    if options.part != "all":
        return None
    per_device = options.jobs_per_device
    runs = retrieval.seeds * len(parse_arms(options.attentions))
    first = plan_workers(options.jobs, runs, retrieval.device, per_device)
    second = plan_workers(options.jobs, len(configs), str(base.device), per_device)
    if first != second or first[0] < 2:
        return None
    return first


def run_both(
    options: Any,
    base: Any,
    configs: dict,
    retrieval: Any,
    out: Path,
    say: Any,
    plan: tuple,
) -> tuple[dict[str, list[dict[str, Any]]], list[Any], Any]:
    """Run every retrieval and language-modelling run of the plan in one pool of ``plan``'s
    workers (see the module docstring); returns the retrieval results per type, the
    language-modelling summaries and the prepared data."""
    from diffattn.compare.arms import parse_arms
    from diffattn.compare.devices import worker_pool
    from diffattn.compare.language_modelling import (
        _train_and_measure,
        lm_finished_line,
        lm_summaries,
        lm_work,
    )
    from diffattn.compare.retrieval import by_type, finished_line, plan_runs, run_one

    jobs, threads, devices = plan
    arms = parse_arms(options.attentions)
    runs = plan_runs(out, retrieval, arms, threads)
    on = f" on {', '.join(devices)}" if devices else ""
    say(f"diffattn compare: both parts in one pool of {jobs} workers{on}")
    say(f"retrieval: {len(runs)} runs; language modelling: {len(configs)} runs")
    finished: dict[str, dict[int, Any]] = {"retrieval": {}, "lm": {}}
    with worker_pool(jobs, devices) as pool:
        futures: dict[Any, tuple[str, int]] = {}
        try:
            for index, run in enumerate(runs[:jobs]):
                futures[pool.submit(run_one, run)] = ("retrieval", index)
            work, prepared = lm_work(options, base, configs, out, say, threads, False)
            for index, job in enumerate(work):
                futures[pool.submit(_train_and_measure, job)] = ("lm", index)
            for index, run in enumerate(runs[jobs:], start=jobs):
                futures[pool.submit(run_one, run)] = ("retrieval", index)
            for part, index, result in _as_finished(futures):
                finished[part][index] = result
                count = len(finished[part])
                if part == "retrieval":
                    say(finished_line(runs[index], result, count, len(runs)))
                else:
                    say(lm_finished_line(work[index], result, count, len(work)))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    per_type = by_type(runs, finished["retrieval"], arms)
    return per_type, lm_summaries(work, finished["lm"]), prepared


def _as_finished(futures: dict[Any, tuple[str, int]]):
    """``(part, index, result)`` of each future as it finishes; a worker's error is raised."""
    from concurrent.futures import FIRST_COMPLETED, wait

    pending = set(futures)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            part, index = futures[future]
            yield part, index, future.result()
