"""Sharded (DCP) checkpoints, FSDP2 mixed precision and selective activation checkpointing,
on CPU with gloo (torchrun, two processes).

- Each rank writes its own shards; a 2-process FSDP2 run resumes exactly on 2 processes, and
  continues within rounding on 1 process and on FSDP2 × TP; consolidation gives the model.
- An asynchronous save killed in flight (``kill -9`` before the rename) is never taken as
  complete: the restarted group resumes from the previous checkpoint and reproduces the
  uninterrupted losses.
- The mixed-precision policy computes in bf16 and reduces in fp32; its losses stay within bf16
  rounding of a single process's.
- Every activation-checkpointing mode gives the gradients of none; ``op`` keeps the matrix
  products (recomputes none of them) and recomputes the element-wise work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from diffattn.checkpoint import CheckpointError, load_model
from diffattn.fileio import is_partial_write
from extras import require_extra

pytestmark = require_extra("train")

from diffattn.train import TrainConfig, load_config, train
from diffattn.train.checkpoint import load_trainer_state
from diffattn.train.sharded import SHARDED_DIRNAME, consolidate, is_sharded
from helpers import ATTENTIONS, TINY_VOCAB, tiny_config
from train_helpers import (
    fault_env,
    fsdp_recipe,
    launch_with_faults,
    tiny_recipe,
    torchrun,
    write_recipe,
)

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

TOLERANCE = 1e-5  # another reduction order (FSDP2 vs one process): see test_train_distributed


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _run(recipe: Path, out: Path, *args: str, nproc: int = 2) -> str:
    """Run ``diffattn.train`` under torchrun with ``--quiet``; returns its stderr."""
    result = torchrun([str(recipe), "--out", str(out), "--quiet", *args], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, data_cache):
    """An uninterrupted 2-process FSDP2 run of 4 steps, and one stopped at step 2."""
    root = tmp_path_factory.mktemp("sharded")
    recipe = fsdp_recipe(data_cache)
    path = write_recipe(root / "fsdp.yaml", recipe)
    _run(path, root / "whole")
    _run(path, root / "half", "--steps", "2")
    return path, recipe, root


def test_each_rank_writes_its_shards_and_no_full_copy(fsdp_runs):
    _, _, root = fsdp_runs
    checkpoint = root / "half" / "checkpoints" / "step-00000002"
    assert is_sharded(checkpoint)
    shards = sorted(p.name for p in (checkpoint / SHARDED_DIRNAME).glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one per rank
    assert not list(checkpoint.glob("*.safetensors"))
    state = load_trainer_state(checkpoint)
    assert state["sharded"] is True and "optimizer" not in state  # it is in the shards
    assert (checkpoint.parent / "latest").resolve() == checkpoint.resolve()
    with pytest.raises(CheckpointError, match="sharded training checkpoint"):
        load_model(checkpoint)


def test_sharded_resume_is_exact_on_the_same_layout(fsdp_runs, tmp_path):
    path, _, root = fsdp_runs
    out = tmp_path / "again"
    shutil.copytree(root / "half", out, symlinks=True)
    stderr = _run(path, out, "--resume")
    assert _losses(out) == _losses(root / "whole")  # bit for bit
    assert "DTensor random operators" not in stderr  # the resumed shards' draw, under --quiet


def test_sharded_checkpoint_resumes_in_one_process(fsdp_runs, tmp_path):
    path, _, root = fsdp_runs
    out = tmp_path / "one"
    shutil.copytree(root / "half", out, symlinks=True)
    config = load_config(path, ["parallel=none", "micro_batch_size=null"])
    resumed = train(config, out, resume=True, progress=False)
    whole = _losses(root / "whole")
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert abs(resumed.losses[step] - whole[step]) <= TOLERANCE


@pytest.mark.slow
def test_sharded_checkpoint_resumes_under_fsdp2_by_tp(fsdp_runs, tmp_path):
    """2 FSDP2 shards read onto a (1 × 2) FSDP2 × TP mesh: the model is split by KV groups."""
    path, _, root = fsdp_runs
    out = tmp_path / "tp"
    shutil.copytree(root / "half", out, symlinks=True)
    _run(path, out, "--resume", "--set", "tp=2")
    whole, got = _losses(root / "whole"), _losses(out)
    assert sorted(got) == [1, 2, 3, 4]
    assert max(abs(got[s] - whole[s]) for s in (3, 4)) <= TOLERANCE


def test_consolidation_writes_the_model_every_command_loads(fsdp_runs, tmp_path):
    from diffattn.cli import main

    _, recipe, root = fsdp_runs
    checkpoint = root / "half" / "checkpoints" / "step-00000002"
    out = consolidate(checkpoint, tmp_path / "model")
    model = load_model(out)
    # the same weights as the shards read into a fresh model in this process
    from diffattn.model import DiffTransformerLM
    from diffattn.train.sharded import load_sharded

    fresh = DiffTransformerLM(TrainConfig.from_dict(recipe).model_config())
    load_sharded(checkpoint, fresh, None)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert (out / "tokenizer.json").is_file() and (out / "train_config.yaml").is_file()
    # the convert command consolidates too, and a run directory names its final checkpoint
    assert main(["convert", str(root / "whole"), str(tmp_path / "cli")]) == 0
    whole_final = root / "whole" / "checkpoints" / "step-00000004"
    assert (
        load_model(tmp_path / "cli").config
        == load_model(consolidate(whole_final, tmp_path / "w")).config
    )


@pytest.mark.slow
def test_async_save_killed_in_flight_resumes_from_the_previous_checkpoint(tmp_path, data_cache):
    recipe = tiny_recipe(
        data_cache, steps=6, checkpoint_every=2, keep_last=None, parallel="fsdp",
        micro_batch_size=2, async_checkpoint=True,
    )  # fmt: skip
    path = write_recipe(tmp_path / "async.yaml", recipe)
    reference = tmp_path / "uninterrupted"
    _run(path, reference)
    out, marker = tmp_path / "run", tmp_path / "fired"
    env = fault_env(marker, "in-flight", 0, 4)
    result = launch_with_faults(path, out, [], env, restarts=1)
    assert marker.is_file(), "the fault never fired"
    assert result.returncode == 0, result.stderr[-4000:]
    assert _losses(out) == _losses(reference)  # resumed from step 2, exactly
    assert not [p for p in out.rglob("*") if is_partial_write(p.name)]
    names = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))
    assert names == ["step-00000002", "step-00000004", "step-00000006"]
    assert all(is_sharded(out / "checkpoints" / n) for n in names)


def test_a_sharded_save_is_refused_where_it_cannot_hold(tmp_path, data_cache):
    from diffattn.train import ConfigError

    with pytest.raises(ConfigError, match="async_checkpoint: needs sharded checkpoints"):
        TrainConfig.from_dict(
            tiny_recipe(data_cache, async_checkpoint=True, checkpoint_format="full")
        )
    checkpoint = tmp_path / "not"
    checkpoint.mkdir()
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        consolidate(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_one_process_sharded_save_and_resume(tmp_path, data_cache, optimizer):
    """``checkpoint_format: sharded`` works without torchrun too (one shard), also for Muon's
    two optimizers (their states are saved and resharded by parameter name)."""
    if optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip(f"torch {torch.__version__} has no torch.optim.Muon")
    recipe = tiny_recipe(
        data_cache, steps=4, checkpoint_every=2, checkpoint_format="sharded",
        optim={"name": optimizer, "lr": 3e-3},
    )  # fmt: skip
    whole = train(TrainConfig.from_dict(recipe), tmp_path / "whole", progress=False)
    train(TrainConfig.from_dict({**recipe, "steps": 2}), tmp_path / "half", progress=False)
    assert is_sharded(tmp_path / "half" / "checkpoints" / "step-00000002")
    resumed = train(TrainConfig.from_dict(recipe), tmp_path / "half", resume=True, progress=False)
    assert resumed.losses == {3: whole.losses[3], 4: whole.losses[4]}


# ----------------------------------------------------------------------------------------
# FSDP2 mixed precision
@pytest.mark.slow
def test_mixed_precision_losses_stay_within_bf16_of_one_process(fsdp_runs, tmp_path):
    path, _, _ = fsdp_runs
    _run(path, tmp_path / "mp", "--set", "dtype=bf16")
    config = load_config(path, ["parallel=none", "micro_batch_size=null", "dtype=bf16"])
    single = train(config, tmp_path / "single", progress=False)
    got = _losses(tmp_path / "mp")
    for step, loss in single.losses.items():
        assert abs(got[step] - loss) <= 2 * torch.finfo(torch.bfloat16).eps * abs(loss)


def test_mixed_precision_policy_computes_in_bf16_and_keeps_fp32_masters(tmp_path):
    worker = Path(__file__).with_name("fsdp_mp_worker.py")
    from train_helpers import torchrun_target

    out = tmp_path / "report.json"
    result = torchrun_target([str(worker), str(out)], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["with_policy"] == {
        "compute": "torch.bfloat16",
        "master": "torch.float32",
        "grad": "torch.float32",
        "optimizer": "torch.float32",
    }
    assert report["without_policy"]["compute"] == "torch.float32"


# ----------------------------------------------------------------------------------------
# selective activation checkpointing
def _grads_and_backward_ops(attention: str, mode: str, selective) -> tuple[dict, dict]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from diffattn.model import DiffTransformerLM
    from diffattn.train.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    model = DiffTransformerLM(tiny_config(attention, n_layers=4))
    apply_activation_checkpointing(model.layers, mode, selective)
    ids = torch.randint(0, TINY_VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids).loss
    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[str(func)] = counts.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, counts


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_checkpointing_mode_gives_the_gradients_of_none(attention):
    reference, plain = _grads_and_backward_ops(attention, "none", "op")
    runs = {
        "full": _grads_and_backward_ops(attention, "full", "op"),
        "every 2nd": _grads_and_backward_ops(attention, "selective", 2),
        "op": _grads_and_backward_ops(attention, "selective", "op"),
    }
    for label, (grads, _) in runs.items():
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-7, msg=f"{label} {name}")
    mm = "aten.mm.default"
    _, full_ops = runs["full"]
    _, op_ops = runs["op"]
    _, half_ops = runs["every 2nd"]
    assert full_ops[mm] > half_ops[mm] > plain[mm]  # 4, 2 and 0 blocks' forwards again
    assert op_ops[mm] == plain[mm]  # op keeps every matrix product ...
    recomputed = "aten.rsqrt.default"  # ... and recomputes the norms
    assert op_ops.get(recomputed, 0) > plain.get(recomputed, 0)


def test_checkpointed_block_choice():
    from diffattn.train.activation_checkpointing import checkpointed_blocks

    assert checkpointed_blocks(6, "none") == []
    assert checkpointed_blocks(6, "full") == list(range(6))
    assert checkpointed_blocks(6, "selective", 2) == [1, 3, 5]
    assert checkpointed_blocks(6, "selective", 4) == [3]
    assert checkpointed_blocks(6, "selective", "op") == list(range(6))
