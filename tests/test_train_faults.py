"""A rank killed under ``torchrun --max-restarts 1`` (CPU, gloo, 2 processes): the restarted
group resumes from the last checkpoint and reproduces the uninterrupted losses, and no
partial checkpoint directory survives.

The fault comes from ``tests/fault_train.py``, which wraps ``python -m diffattn.train``: one
rank SIGKILLs itself once (a marker file records that it happened), either after an
optimizer step or in the middle of writing a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffattn.fileio import is_partial_write
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import fault_env, tiny_recipe, write_recipe
from train_helpers import launch_with_faults as _launch

pytestmark = [pytestmark, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

STEPS = 6
TOLERANCE = 1e-6  # CPU resume is exact (docs/training.md); DDP on gloo is deterministic


def _losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _partial_writes(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if is_partial_write(p.name)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """The recipe and the losses of the uninterrupted two-process run."""
    root = tmp_path_factory.mktemp("faults")
    recipe = tiny_recipe(
        data_cache, steps=STEPS, checkpoint_every=2, keep_last=None, parallel="ddp"
    )
    path = write_recipe(root / "ddp.yaml", recipe)
    out = root / "uninterrupted"
    result = _launch(path, out, [], {}, restarts=0)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(out)
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))
    return path, losses


def _check_resumed(result, out: Path, marker: Path, expected: list[tuple[int, float]]) -> None:
    assert marker.is_file(), "the fault never fired"
    assert result.returncode == 0, (marker.read_text(), result.stderr[-4000:])
    got = _losses(out)
    assert [s for s, _ in got] == [s for s, _ in expected]  # every step once
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True))
    assert worst <= TOLERANCE, (worst, got, expected)
    assert not _partial_writes(out), _partial_writes(out)
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert checkpoints == [f"step-{s:08d}" for s in range(2, STEPS + 1, 2)]


@pytest.mark.parametrize(
    ("fault_at", "rank", "step"),
    [("after-step", 1, 3), ("mid-save", 0, 4)],
    ids=["rank1-killed-after-step-3", "rank0-killed-writing-checkpoint-4"],
)
def test_killed_rank_resumes_and_reproduces_losses(tmp_path, reference, fault_at, rank, step):
    """The restarted group resumes from the last complete checkpoint (step 2): the losses of
    steps 3.. equal the uninterrupted run's and the half-written checkpoint is cleaned up.

    The launcher decides on ``--resume`` (present once ``--out`` holds a checkpoint), since
    ``diffattn train --resume`` refuses an output directory without one."""
    recipe, expected = reference
    out, marker = tmp_path / "run", tmp_path / "fault-fired"
    env = fault_env(marker, fault_at, rank, step)
    result = _launch(recipe, out, [], env, restarts=1)
    _check_resumed(result, out, marker, expected)


def test_same_command_line_starts_and_resumes_under_restarts(tmp_path, reference):
    """``torchrun --max-restarts 1 ... --auto-resume`` on an empty ``--out``: the first launch
    starts fresh, the relaunch after the kill resumes from the checkpoint of step 2."""
    recipe, expected = reference
    out, marker = tmp_path / "run", tmp_path / "fault-fired"
    env = fault_env(marker, "after-step", 1, 3, resume_if_checkpointed=False)
    result = _launch(recipe, out, ["--auto-resume"], env, restarts=1, timeout=120)
    _check_resumed(result, out, marker, expected)
