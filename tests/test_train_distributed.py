"""Two processes on CPU (gloo, torchrun on 127.0.0.1) give the single-process losses.

DDP and FSDP2 split each global batch over the ranks; the losses, validation losses and λ
equal a single process training on the same global batch. A checkpoint written under FSDP2
is a full model directory that loads, and resumes, in one process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from diffattn.checkpoint import load_model
from diffattn.train import TrainConfig, distributed, train
from diffattn.train.parallel import parallelize
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import (
    free_port,
    subprocess_env,
    tiny_recipe,
    torchrun,
    write_recipe,
)

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


TOLERANCE = 1e-5


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _compare(reference: list[dict], distributed: list[dict], keys=("loss", "val_loss")):
    assert [r["step"] for r in reference] == [r["step"] for r in distributed]
    worst = 0.0
    for ref, got in zip(reference, distributed, strict=True):
        for key in keys:
            if key in ref:
                worst = max(worst, abs(ref[key] - got[key]))
        for key in ("lambda", "lambda_mean"):
            if key in ref:
                worst = max(worst, max(abs(a - b) for a, b in zip(ref[key], got[key], strict=True)))
    assert worst <= TOLERANCE, worst
    return worst


def test_ddp_two_processes_equal_one_process(tmp_path, data_cache):
    recipe = tiny_recipe(data_cache, steps=4, eval_every=2, model={"attention": "diff_v2"})
    reference = tmp_path / "single"
    train(TrainConfig.from_dict(recipe), reference, progress=False)
    path = write_recipe(tmp_path / "ddp.yaml", {**recipe, "parallel": "ddp"})
    result = torchrun([str(path), "--out", str(tmp_path / "ddp"), "--quiet"])
    assert result.returncode == 0, result.stderr[-3000:]
    _compare(_records(reference), _records(tmp_path / "ddp"))


def test_fsdp2_two_processes_equal_one_process_and_checkpoint_loads_alone(tmp_path, data_cache):
    recipe = tiny_recipe(data_cache, steps=6, eval_every=2)
    reference = tmp_path / "single"
    single = train(
        TrainConfig.from_dict({**recipe, "checkpoint_every": 4}), reference, progress=False
    )
    # the gathered format (checkpoint_format: full); the sharded one: test_train_sharded.py
    sharded_recipe = {**recipe, "parallel": "fsdp", "micro_batch_size": 2}
    sharded_recipe["checkpoint_format"] = "full"
    sharded_recipe["activation_checkpointing"] = True
    path = write_recipe(tmp_path / "fsdp.yaml", sharded_recipe)
    out = tmp_path / "fsdp"
    result = torchrun([str(path), "--out", str(out), "--steps", "4", "--quiet"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "terminate called" not in result.stderr, result.stderr[-3000:]
    _compare(_records(reference)[:4], _records(out))

    # the FSDP2 checkpoint is a full model directory equal to the single-process one (Adam
    # divides by sqrt(v), so where a gradient is ~0 a rounding difference in the reduction
    # order moves a weight by up to ~lr·1e-3; 1e-4 bounds that at lr 3e-3)
    sharded_model = load_model(out / "checkpoints" / "step-00000004")
    single_model = load_model(reference / "checkpoints" / "step-00000004")
    for (name, a), (_, b) in zip(
        sharded_model.state_dict().items(), single_model.state_dict().items(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-4, rtol=0), name

    # ... and resumes in one process, continuing like the single-process run
    moved = tmp_path / "continued"
    shutil.copytree(out, moved)
    resumed = train(TrainConfig.from_dict(recipe), moved, resume=True, progress=False)
    assert sorted(resumed.losses) == [5, 6]
    for step in (5, 6):
        assert abs(resumed.losses[step] - single.losses[step]) <= TOLERANCE


GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names come from /proc")
def test_shutdown_frees_the_group_and_joins_its_threads(monkeypatch):
    """A group nothing else holds is freed by shutdown(): gloo's worker threads are gone."""
    variables = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    variables.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    env = distributed.read_env()
    assert distributed.init_process_group(env, torch.device("cpu"))
    try:
        total = distributed.all_reduce_sum(torch.ones(3))  # a world of 1: a no-op
        torch.distributed.all_reduce(total)  # the group's own worker threads run this one
        # the worker threads run; the transport's own thread is "gloo_tcp_loop" or, on the
        # libuv transport, an unnamed "uv" one, so only the worker's name is required here
        assert "pt_gloo_runloop" in _thread_names()
    finally:
        freed = distributed.shutdown()
    assert freed
    assert not torch.distributed.is_initialized()
    assert not set(GLOO_THREADS) & set(_thread_names())
    assert distributed.shutdown()  # nothing left to leave


# A gloo worker thread of rank 0 runs a completion callback that needs the GIL again once the
# interpreter finalizes (the gate opens in a finalizer that then sleeps, releasing the GIL).
_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import torch
    from diffattn.train import distributed

    env = distributed.read_env()
    distributed.init_process_group(env, torch.device("cpu"))
    started, gate = threading.Event(), threading.Event()
    if env.rank == 1:
        time.sleep(0.5)  # rank 0 registers its callback before the collective can complete
    work = torch.distributed.all_reduce(torch.ones(4), async_op=True)
    if env.rank == 0:
        work.get_future().then(lambda future: (started.set(), gate.wait()))
        started.wait()  # the collective is done; the worker thread waits in the callback
    else:
        work.wait()


    class Finalizing:
        def __del__(self, _open=gate.set, _sleep=time.sleep):
            _open()
            _sleep(1.0)


    finalizing = Finalizing()  # the group stays: destroying it would wait for the callback
    if sys.argv[1] == "exit_process":
        distributed.exit_process(0)
    sys.exit(0)
    """
)


def _run_exit_script(tmp_path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "leave.py"
    script.write_text(_EXIT_SCRIPT, encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        how,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=subprocess_env()
    )


def test_exit_process_does_not_race_a_communication_thread(tmp_path):
    """The torchrun entry point's exit: no SIGABRT while a gloo worker still runs Python."""
    result = _run_exit_script(tmp_path, "exit_process")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "terminate called" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_sys_exit_aborts_while_a_communication_thread_runs_python(tmp_path):
    """The hazard exit_process avoids, as torch 2.13 and CPython 3.11 have it: a gloo worker
    thread that takes the GIL while the interpreter finalizes is ended by Python and the
    process aborts. When that no longer happens, exit_process can become sys.exit."""
    result = _run_exit_script(tmp_path, "sys.exit")
    assert result.returncode != 0
    assert "SIGABRT" in result.stderr, result.stderr[-3000:]


def test_parallelize_rejects_an_unknown_mode():
    from diffattn import DiffTransformerLM, ModelConfig

    model = DiffTransformerLM(ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4))
    assert parallelize(model, "none") is model
    with pytest.raises(ValueError, match="unknown parallel mode 'zero'"):
        parallelize(model, "zero")


@pytest.mark.slow
def test_fsdp2_sharded_initialisation_trains(tmp_path, data_cache):
    """fsdp_init: sharded fills each shard in place (no full copy); the run trains."""
    recipe = tiny_recipe(data_cache, steps=6, parallel="fsdp", fsdp_init="sharded")
    path = write_recipe(tmp_path / "fsdp.yaml", recipe)
    result = torchrun([str(path), "--out", str(tmp_path / "run"), "--quiet"])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in _records(tmp_path / "run")]
    assert len(losses) == 6 and all(map(math.isfinite, losses))
    assert losses[-1] < losses[0]
    # FSDP2 saves sharded by default; the convert command consolidates the run's final one
    from diffattn.cli import main

    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "model")]) == 0
    model = load_model(tmp_path / "model")
    assert all(torch.isfinite(p).all() for p in model.parameters())
