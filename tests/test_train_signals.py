"""Stopping: SIGTERM/SIGINT save a checkpoint, NaN/Inf stops and keeps the last good one."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

from diffattn.checkpoint import load_model
from diffattn.train import TrainConfig, TrainingDiverged, train
from diffattn.train.checkpoint import list_checkpoints
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import (
    subprocess_env,
    tiny_recipe,
    train_cli,
    write_recipe,
)

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


_cli = train_cli


def _wait_for_steps(metrics, count: int, process, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"training exited early: {process.communicate()}")
        if metrics.is_file():
            lines = metrics.read_text().splitlines()
            if len(lines) >= count:
                return len(lines)
        time.sleep(0.1)
    raise AssertionError("training did not reach the expected step in time")


@pytest.mark.parametrize("name", ["SIGTERM"])
def test_signal_saves_a_checkpoint_then_exits(tmp_path, data_cache, name):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tiny_recipe(data_cache, steps=100_000, schedule={"total_steps": 100_000}),
    )
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "diffattn.train", str(recipe), "--out", str(out), "--quiet"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_steps(out / "metrics.jsonl", 3, process)
        process.send_signal(getattr(signal, name))
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + getattr(signal, name), err
    found = list_checkpoints(out / "checkpoints")
    assert len(found) == 1
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert found[0][0] == records[-1]["step"] >= 3  # saved at the step it stopped
    # the run continues from there
    config = TrainConfig.from_dict(
        tiny_recipe(data_cache, steps=found[0][0] + 2, schedule={"total_steps": 100_000})
    )
    resumed = train(config, out, resume=True, progress=False)
    assert sorted(resumed.losses) == [found[0][0] + 1, found[0][0] + 2]


def test_sigint_in_process_stops_after_the_step_with_a_checkpoint(tmp_path, data_cache):
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when run as a background job

    def interrupt(state):
        if state.step == 2:
            signal.raise_signal(signal.SIGINT)

    config = TrainConfig.from_dict(tiny_recipe(data_cache, steps=50))
    result = train(config, tmp_path / "run", progress=False, callbacks=[interrupt])
    assert result.stopped == "SIGINT" and result.exit_code == 130
    # the flag is agreed on with the step's loss, so a signal raised after that (here: in a
    # callback) ends the next step
    assert result.step == 3 and result.checkpoint.name == "step-00000003"
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_huge_learning_rate_stops_with_a_clear_message_and_keeps_good_checkpoints(
    tmp_path, data_cache, capsys
):
    recipe = write_recipe(
        tmp_path / "r.yaml", tiny_recipe(data_cache, steps=20, checkpoint_every=1, keep_last=None)
    )
    out = tmp_path / "run"
    assert _cli(str(recipe), "--out", str(out), "--set", "optim.lr=1e30") == 1
    err = capsys.readouterr().err
    assert "non-finite" in err and "last good checkpoint is" in err, err
    found = list_checkpoints(out / "checkpoints")
    assert found, "the steps before the divergence were checkpointed"
    stopped_at = int(err.split(" at step ")[1].split()[0]) if " at step " in err else None
    last_step, last = found[-1]
    assert stopped_at is None or last_step < stopped_at
    model = load_model(last)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_nan_injected_by_a_hook_stops_the_run_before_it_reaches_a_checkpoint(
    tmp_path, data_cache
):
    def poison(state):
        if state.step == 3:
            with torch.no_grad():
                state.model.layers[0].attn.lambda_q1.fill_(math.nan)

    config = TrainConfig.from_dict(tiny_recipe(data_cache, steps=10, checkpoint_every=2))
    with pytest.raises(TrainingDiverged) as info:
        train(config, tmp_path / "run", progress=False, callbacks=[poison])
    assert info.value.step == 4  # the weights of step 3 give a NaN loss at step 4
    assert info.value.checkpoint.name == "step-00000002"
    assert "non-finite loss at step 4" in str(info.value)
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]


def test_nan_weights_are_never_checkpointed(tmp_path, data_cache):
    def poison(state):
        if state.step == 2:
            with torch.no_grad():
                state.model.norm.weight[0] = math.inf

    config = TrainConfig.from_dict(tiny_recipe(data_cache, steps=10, checkpoint_every=2))
    with pytest.raises(TrainingDiverged, match="non-finite weights after step 2"):
        train(config, tmp_path / "run", progress=False, callbacks=[poison])
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_kill_9_loses_only_the_steps_since_the_last_checkpoint(tmp_path, data_cache):
    recipe = tiny_recipe(data_cache, steps=100_000, checkpoint_every=3)
    path = write_recipe(tmp_path / "r.yaml", recipe)
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "diffattn.train", str(path), "--out", str(out), "--quiet"],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_steps(out / "metrics.jsonl", 7, process)
        process.kill()
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    found = list_checkpoints(out / "checkpoints")
    assert found and found[-1][0] % 3 == 0
    last = found[-1][0]
    target = last + 3
    resumed = train(
        TrainConfig.from_dict({**recipe, "steps": target}), out, resume=True, progress=False
    )
    assert sorted(resumed.losses) == list(range(last + 1, target + 1))
    reference = train(
        TrainConfig.from_dict({**recipe, "steps": target}), tmp_path / "ref", progress=False
    )
    for step, loss in resumed.losses.items():
        assert abs(loss - reference.losses[step]) <= 1e-6
