"""Which device each ``diffattn compare`` worker trains on, and the pool that keeps it there.

On CPU, ``--jobs N`` runs N worker processes and splits the cores among them (one torch
thread each by default). On CUDA, worker slot ``i`` of ``N`` uses ``cuda:(i mod G)``, G being
the number of devices this process sees (``torch.cuda.device_count()``, so
``CUDA_VISIBLE_DEVICES`` chooses them; the list is counted, never parsed): one run per device
at a time, ``N <= G`` unless ``--jobs-per-device K`` allows ``N <= G·K``. ``--jobs`` left
automatic means one run per slot (``G·K``), never more than there are runs.

A worker claims its slot once, in the pool's initializer, and keeps it for the life of the
process (:func:`worker_pool`): a shared counter, read and incremented under its lock, hands
slot k to the k-th worker that starts, and the pool never starts more workers than there are
slots. Two runs that train at the same time are in two different workers (a worker runs one job
at a time, start to end), so they hold two different slots, whatever the scheduling and even
if a job fails. Claiming a device per job from a shared queue instead would make that depend on
every job handing its device back (a killed job would keep it), and would open CUDA contexts on
several devices in one long-lived worker.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_held: str | None = None
"""The device this process holds: set for its life in a pool worker (:func:`_claim_device`),
for the body of :func:`holding` in the parent; ``None`` otherwise."""


def visible_devices(device: str) -> list[str] | None:
    """The devices worker slots are spread over for ``device``: ``cuda:0 … cuda:(G-1)`` for
    ``cuda`` (and ``auto`` where CUDA is available), G = ``torch.cuda.device_count()``, which
    counts what ``CUDA_VISIBLE_DEVICES`` exposes; ``[device]`` for one named device
    (``cuda:N``); ``None`` on CPU (and for a device string the run itself will refuse)."""
    import torch

    if device.startswith("cuda:"):
        return [device]
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return None


def assign_devices(jobs: int, devices: int | Sequence[str], per_device: int = 1) -> list[str]:
    """The device of each of ``jobs`` worker slots: slot ``i`` uses ``devices[i mod G]`` (a
    count ``G`` stands for ``cuda:0 … cuda:(G-1)``), so every device is used before any takes
    a second slot and none takes more than ``per_device``.

    Raises ``ValueError`` naming G when ``jobs > G · per_device``."""
    names = [f"cuda:{i}" for i in range(devices)] if isinstance(devices, int) else list(devices)
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    if per_device < 1:
        raise ValueError(f"--jobs-per-device must be at least 1, got {per_device}")
    if not names:
        raise ValueError("--jobs: no CUDA device is visible (see CUDA_VISIBLE_DEVICES)")
    if len(set(names)) != len(names):
        raise ValueError(f"device names must be distinct, got {names}")
    count = len(names)
    if jobs > count * per_device:
        each = "one run per device" if per_device == 1 else f"{per_device} runs per device"
        raise ValueError(
            f"--jobs {jobs}: only {count} CUDA device(s) visible, {each}; use --jobs "
            f"{count * per_device} or fewer, or --jobs-per-device {math.ceil(jobs / count)} "
            "to share each device among that many runs"
        )
    return [names[i % count] for i in range(jobs)]


def _cores() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def plan_workers(
    jobs: int | None, runs: int, device: str, per_device: int = 1
) -> tuple[int, int | None, list[str] | None]:
    """(worker processes, torch threads per worker, device of each worker slot) for ``runs``
    runs on ``device`` with ``--jobs`` = ``jobs`` (``None``: automatic).

    CPU: one run per core by default, the cores split among the runs, no device slots.
    CUDA: :func:`assign_devices` over the visible devices, automatic = every slot; no more
    workers than runs either way. CUDA asked for but no device visible: as before this module
    (``jobs`` or 1 workers, no slots); the runs themselves report that CUDA is missing."""
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    if per_device < 1:
        raise ValueError(f"--jobs-per-device must be at least 1, got {per_device}")
    devices = visible_devices(device)
    if devices is None and per_device != 1:
        raise ValueError("--jobs-per-device applies to CUDA devices; on CPU use --jobs alone")
    if devices == []:
        return (jobs or 1), None, None
    cores = _cores()
    slots = None
    if devices is None:
        jobs = min(runs, jobs or cores)
    else:
        slots = assign_devices(jobs or len(devices) * per_device, devices, per_device)
        jobs = min(runs, len(slots))
        slots = slots[:jobs]
    return jobs, (max(1, cores // jobs) if jobs > 1 else None), slots


def _use(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def _claim_device(devices: Sequence[str], claimed: Any) -> None:
    """Pool initializer: take the next unclaimed slot and hold its device for the life of this
    worker process."""
    global _held
    with claimed.get_lock():
        slot = claimed.value
        claimed.value += 1
    if slot >= len(devices):  # the pool replaced a worker; it never does without max_tasks
        raise RuntimeError(f"worker {slot + 1} started, but there are {len(devices)} slots")
    _held = devices[slot]
    _use(_held)


def worker_pool(jobs: int, devices: Sequence[str] | None = None):
    """A ``ProcessPoolExecutor`` of ``jobs`` spawned workers, each keeping freed memory for
    reuse (:func:`diffattn.compare.allocator.keep_freed_memory`); with ``devices`` (one per
    worker, from :func:`plan_workers`) the k-th worker to start holds ``devices[k]`` for its
    life."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    if devices is not None and len(devices) != jobs:
        raise ValueError(f"{jobs} workers need {jobs} device slots, got {list(devices)}")
    claimed = context.Value("i", 0) if devices is not None else None
    return ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=context,
        initializer=_start_worker,
        initargs=(tuple(devices) if devices is not None else None, claimed),
    )


def _start_worker(devices: Sequence[str] | None, claimed: Any) -> None:
    """Pool initializer: keep freed memory, then claim a device slot when there are any."""
    from diffattn.compare.allocator import keep_freed_memory

    keep_freed_memory()
    if devices is not None:
        _claim_device(devices, claimed)


@contextmanager
def holding(device: str | None) -> Iterator[None]:
    """This process holds ``device`` for the body (runs trained in the parent, ``--jobs 1``):
    ``cuda`` means ``device`` there and :func:`device_in_use` returns it."""
    global _held
    before = _held
    _held = device
    try:
        if device is not None and device.startswith("cuda"):
            import torch

            with torch.cuda.device(torch.device(device)):
                yield
        else:
            yield
    finally:
        _held = before


def held_device() -> str | None:
    """The device this process holds (see :func:`holding`, :func:`worker_pool`), or ``None``."""
    return _held


def device_in_use(requested: str) -> str:
    """The device a run asking for ``requested`` trains on in this process: the held one, else
    ``cuda:<current device>`` for ``cuda`` (``auto`` with CUDA), else ``cpu``."""
    if _held is not None:
        return _held
    import torch

    if requested.startswith("cuda:"):
        return requested
    if torch.cuda.is_available() and requested in ("cuda", "auto"):
        return f"cuda:{torch.cuda.current_device()}"
    return "cuda" if requested == "cuda" else "cpu"
