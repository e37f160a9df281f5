"""``diffattn compare --jobs N`` across devices: the slot-to-device assignment, and the worker
pool in which every worker process holds one device for its life, run in real spawned
processes with fake device names (no CUDA needed)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from extras import require_extra

pytestmark = require_extra("train", "hf")


from diffattn.cli import main
from diffattn.compare import CompareOptions, run_compare
from diffattn.compare import devices as devices_module
from diffattn.compare.devices import assign_devices, held_device, plan_workers, worker_pool

FAKE = ["fake:0", "fake:1"]


@pytest.mark.parametrize(
    ("jobs", "count", "per_device", "expected"),
    [
        (1, 1, 1, ["cuda:0"]),
        (1, 8, 1, ["cuda:0"]),
        (2, 2, 1, ["cuda:0", "cuda:1"]),
        (8, 8, 1, [f"cuda:{i}" for i in range(8)]),
        (2, 1, 2, ["cuda:0", "cuda:0"]),
        (4, 2, 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
        (3, 2, 2, ["cuda:0", "cuda:1", "cuda:0"]),  # every device before any takes a second
        (16, 8, 2, [f"cuda:{i % 8}" for i in range(16)]),
    ],
)
def test_slots_go_round_the_devices(jobs, count, per_device, expected):
    slots = assign_devices(jobs, count, per_device)
    assert slots == expected
    assert max(slots.count(d) for d in slots) <= per_device


@pytest.mark.parametrize(("jobs", "count", "per_device"), [(2, 1, 1), (9, 8, 1), (17, 8, 2)])
def test_more_jobs_than_device_slots_is_refused_naming_the_devices(jobs, count, per_device):
    with pytest.raises(ValueError, match=f"--jobs {jobs}: only {count} CUDA device") as error:
        assign_devices(jobs, count, per_device)
    assert "--jobs-per-device" in str(error.value)
    with pytest.raises(ValueError, match="no CUDA device"):
        assign_devices(1, 0)
    with pytest.raises(ValueError, match="--jobs-per-device"):
        assign_devices(1, 2, 0)


def test_worker_plan_on_cuda_and_on_cpu(monkeypatch):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # CPU, as before: one run per core (never more than the runs), the cores split among them
    assert plan_workers(None, 9, "cpu") == (
        min(9, cores), max(1, cores // min(9, cores)) if min(9, cores) > 1 else None, None
    )  # fmt: skip
    assert plan_workers(1, 9, "cpu") == (1, None, None)
    with pytest.raises(ValueError, match="--jobs-per-device applies to CUDA"):
        plan_workers(2, 9, "cpu", per_device=2)

    eight = [f"cuda:{i}" for i in range(8)]
    monkeypatch.setattr(devices_module, "visible_devices", lambda device: eight)
    jobs, _, slots = plan_workers(None, 9, "cuda")  # automatic: one per visible device
    assert (jobs, slots) == (8, eight)
    assert plan_workers(None, 9, "cuda", per_device=2)[2] == [*eight, eight[0]]  # 9 runs only
    assert plan_workers(None, 3, "cuda")[2] == eight[:3]  # never more workers than runs
    assert plan_workers(1, 9, "cuda")[:3:2] == (1, ["cuda:0"])
    with pytest.raises(ValueError, match="only 8 CUDA device"):
        plan_workers(9, 9, "cuda")
    monkeypatch.setattr(devices_module, "visible_devices", lambda device: [])
    assert plan_workers(None, 9, "cuda") == (1, None, None)  # no device: the run says so


def _hold(seconds: float) -> tuple[str | None, int, float, float]:
    """A job for the pool: which device its worker holds, in which process, from when to when."""
    started = time.time()
    time.sleep(seconds)
    return held_device(), os.getpid(), started, time.time()


def _overlap(a, b) -> bool:
    return a[2] < b[3] and b[2] < a[3]


def _span(run) -> tuple[str | None, int, float, float]:
    """(device, 0, start, end) of a finished run, as :func:`_hold` gives them: its
    ``config.yaml`` is written as training starts, its final checkpoint as it ends."""
    times = [p.stat().st_mtime for p in Path(run.run_dir).rglob("*") if p.is_file()]
    return run.device, 0, min(times), max(times)


@pytest.mark.parametrize(("names", "per_device"), [(FAKE, 1), (FAKE[:1], 2)])
def test_each_worker_holds_one_device_for_its_life(names, per_device):
    slots = assign_devices(len(names) * per_device, names, per_device)  # two workers
    with worker_pool(len(slots), slots) as pool:
        records = list(pool.map(_hold, [0.3] * (3 * len(slots))))
    by_pid: dict[int, set] = {}
    for device, pid, _, _ in records:
        by_pid.setdefault(pid, set()).add(device)
    assert all(len(held) == 1 for held in by_pid.values())  # a worker keeps its device
    held = [next(iter(h)) for h in by_pid.values()]
    assert len(by_pid) <= len(slots) and all(held.count(d) <= per_device for d in names)
    for device, _, started, _ in records:  # at no start are more than per_device jobs on it
        assert sum(r[0] == device and r[2] <= started < r[3] for r in records) <= per_device


def test_compare_records_the_device_of_every_run(tmp_path, monkeypatch, capsys):
    """The real path: run_compare plans the slots, spawns workers that claim fake devices, trains
    the tiny recipe on CPU in them and records each run's device in results.json and report.md;
    the runs that overlapped in time held different devices."""
    monkeypatch.setattr(devices_module, "visible_devices", lambda device: FAKE)
    from compare_helpers import tiny_overrides, write_corpus

    overrides = tiny_overrides(write_corpus(tmp_path / "corpus"), tmp_path / "cache")
    out = tmp_path / "out"
    options = CompareOptions(
        out=out, overrides=overrides, steps=2, seeds=2, attentions=("baseline", "diff_v1"),
        progress=False, evaluate=False, part="lm",
    )  # fmt: skip
    result = run_compare(options)  # jobs automatic: one worker per (fake) device
    assert {r.device for r in result.runs} <= set(FAKE)
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["attention"], r["seed"], r["device"]) for r in runs] == [
        (r.attention, r.seed, r.device) for r in result.runs
    ]
    assert "Devices: `fake:" in (out / "report.md").read_text()
    spans = [_span(run) for run in result.runs]
    for a in spans:
        assert not any(b is not a and b[0] == a[0] and _overlap(a, b) for b in spans)

    options.jobs = 1  # in this process: it holds the first slot's device while the runs are reused
    assert {r.device for r in run_compare(options).runs} == {"fake:0"}

    # --jobs beyond the devices: one clear error naming them, before anything is written
    monkeypatch.setattr(devices_module, "visible_devices", lambda device: ["cuda:0", "cuda:1"])
    other = tmp_path / "other"
    assert main(["compare", "--out", str(other), "--part", "lm", "--jobs", "3"]) == 2
    assert "--jobs 3: only 2 CUDA device(s) visible" in capsys.readouterr().err
    assert not other.exists()
