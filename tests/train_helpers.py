"""Shared pieces of the trainer tests: a tiny recipe, a shared data cache, subprocess runs.

The ``test_train_*`` modules import from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from helpers import free_port

REPO = Path(__file__).resolve().parents[1]


def tiny_recipe(cache_dir: str | os.PathLike, **changes: Any) -> dict[str, Any]:
    """A recipe that trains in well under a second per step on one CPU thread."""
    recipe: dict[str, Any] = {
        "model": {
            "preset": "tiny",
            "attention": "diff_v1",
            "vocab_size": 512,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "head_dim": 8,
            "max_seq_len": 64,
        },
        "data": {
            "sources": ["stdlib"],
            "tokenizer": "bpe:512",
            "max_bytes": 300_000,
            "valid_fraction": 0.2,
            "cache_dir": str(cache_dir),
        },
        "optim": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2, "total_steps": 50},
        "steps": 8,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "seq_len": 32,
        "log_every": 1,
        "eval_every": 0,
        "eval_batches": 2,
        "checkpoint_every": 0,
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    return recipe


def fsdp_recipe(cache_dir: str | os.PathLike) -> dict[str, Any]:
    """The tiny recipe as a 2-process FSDP2 run of 4 steps (sharded checkpoints by default),
    a checkpoint every 2 steps, all kept."""
    return tiny_recipe(
        cache_dir, steps=4, checkpoint_every=2, keep_last=None, parallel="fsdp", micro_batch_size=2
    )


def short_documents_recipe(tmp_path, data_cache, **changes):
    """The tiny recipe on 3,000 documents of 5 to 30 words (``tmp_path/docs.jsonl``): most
    32-token windows cross a document boundary."""
    import json
    import random

    rng = random.Random(0)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "theta",
        "kappa",
        "sigma",
        "omega",
        "def",
        "return",
    ]
    path = tmp_path / "docs.jsonl"
    with path.open("w") as f:
        for _ in range(3000):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))
            f.write(json.dumps({"text": text}) + "\n")
    data = {"sources": [str(path)], "max_bytes": None}
    return tiny_recipe(data_cache, data={**data, **changes.pop("data", {})}, **changes)


def write_recipe(path: Path, recipe: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m diffattn.train ARGS`` on 127.0.0.1."""
    return torchrun_target(["-m", "diffattn.train", *args], nproc, timeout)


def torchrun_target(
    target: list[str], nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc TARGET`` (a script and its arguments, or ``-m``
    MODULE ...) on 127.0.0.1, with a free port and the test environment."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *target,
    ]
    return run_launcher(command, timeout, subprocess_env())


def run_launcher(
    command: list[str], timeout: float, env: dict[str, str]
) -> subprocess.CompletedProcess:
    """Run a launcher (torchrun and its workers) in its own process group.

    A run past ``timeout`` is a hang: every process of the group gets SIGABRT, on which
    Python's faulthandler (``PYTHONFAULTHANDLER=1``) prints each thread's stack, then SIGKILL,
    so no worker outlives the test; the failure shows those stacks and the output so far.
    """
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        _signal_group(process.pid, signal.SIGKILL)
        raise AssertionError(
            f"{' '.join(command)} hung for {timeout:.0f} s; its processes' stacks and output:\n"
            f"--- stdout (end)\n{stdout[-6000:]}\n--- stderr (end)\n{stderr[-20000:]}"
        ) from None
    _signal_group(process.pid, signal.SIGKILL)  # a worker left behind by the launcher
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def read_losses(out_dir: Path) -> dict[int, float]:
    lines = (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def train_cli(*argv: str) -> int:
    """``diffattn train ARGV --quiet`` through the command module; returns the exit code."""
    import argparse

    from diffattn.commands import train as train_command

    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    return train_command.run(parser.parse_args([*argv, "--quiet"]))


FAULT_SCRIPT = Path(__file__).with_name("fault_train.py")


def fault_env(
    marker: Path, at: str, rank: int, step: int, resume_if_checkpointed: bool = True
) -> dict[str, str]:
    """The environment of ``fault_train.py``: rank ``rank`` dies once at ``step`` (``at``:
    ``after-step``, ``mid-save`` or ``in-flight``), recorded in ``marker``."""
    env = {"FAULT_MARKER": str(marker), "FAULT_AT": at, "FAULT_RANK": str(rank)}
    env["FAULT_STEP"] = str(step)
    if resume_if_checkpointed:
        env["FAULT_RESUME_IF_CHECKPOINTED"] = "1"
    return env


def launch_with_faults(
    recipe: Path,
    out: Path,
    extra: list[str],
    env: dict[str, str],
    restarts: int,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``torchrun --max-restarts RESTARTS tests/fault_train.py RECIPE --out OUT`` on two CPU
    processes (the fault comes from ``env``: see ``fault_train.py``)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--nnodes=1",
        f"--max-restarts={restarts}",
        # c10d rendezvous: each restart gets a fresh store (the static one keeps stale keys)
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=faults",
        str(FAULT_SCRIPT),
        str(recipe),
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]
    return run_launcher(command, timeout, {**subprocess_env(), **env})
