"""The training and validation losses are the mean over every target of the global batch, so
neither they nor any gradient depend on how the batch is split: micro-batch size, gradient
accumulation, number of ranks, or a resume on another number of ranks.

Rows that hold different numbers of targets are what makes a mean of per-micro-batch means
wrong: document masking drops the target that crosses each boundary, and padding and ignored
labels count nothing (``ragged_targets_train.py`` adds both to the trainer's rows).
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from diffattn.model import labels_within_documents, next_token_loss
from diffattn.train import TrainConfig, Trainer, evaluation, train
from diffattn.train import trainer as trainer_module
from diffattn.train.targets import target_count
from extras import require_extra

pytestmark = require_extra("train")

import ragged_targets_train
from train_helpers import (
    REPO,
    run_launcher,
    short_documents_recipe,
    subprocess_env,
    torchrun,
    torchrun_target,
    write_recipe,
)

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

TOLERANCE = 1e-6
"""Relative, in fp32. A mean of per-micro-batch means misses it by 3e-5 (loss) and 1e-2 (the
largest gradient entry) at micro-batch 2 against 8 with these documents."""
RAGGED_SCRIPT = str(REPO / "tests" / "ragged_targets_train.py")


def test_target_count_is_what_the_loss_averages():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 50, (3, 11), generator=generator)
    labels[0, 4:7] = -100
    labels[2, -3:] = -100
    documents = torch.tensor([[0] * 8 + [1] * 3, [0] * 11, [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3]])
    logits = torch.randn(3, 11, 50, generator=generator)
    within = labels_within_documents(labels, documents)
    summed = next_token_loss(logits, within, reduction="sum")
    mean = next_token_loss(logits, within)
    count = target_count({"labels": labels, "document_ids": documents})
    assert count == 3 * 10 - 3 - 3 - 1 - 3  # ignored, ignored, one boundary, three boundaries
    assert float(summed / mean) == pytest.approx(count, rel=1e-6)
    assert target_count({"labels": labels}) == 3 * 10 - 3 - 3


def _one_step(tmp_path, recipe, micro):
    """The loss, the gradients and the validation loss of the first step with ``micro``."""
    config = TrainConfig.from_dict({**recipe, "micro_batch_size": micro})
    trainer = Trainer(config, tmp_path / f"micro-{micro}", progress=False).build()
    try:
        local, targets = trainer.forward_backward_step(trainer._next_batch(1))
        loss, _ = trainer._agree(local, targets, 1)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        validation = trainer.evaluate().loss
    finally:
        trainer.close()
    return loss, grads, validation


@pytest.mark.parametrize("rows", ["documents", "documents+padding+ignored"])
def test_micro_batch_size_changes_neither_the_loss_nor_a_gradient(
    tmp_path, data_cache, monkeypatch, rows
):
    if "padding" in rows:
        monkeypatch.setattr(trainer_module, "model_inputs", ragged_targets_train.ragged_inputs)
        monkeypatch.setattr(evaluation, "model_inputs", ragged_targets_train.ragged_inputs)
    recipe = short_documents_recipe(
        tmp_path, data_cache, steps=1, document_masking=True, eval_batches=1
    )
    whole = _one_step(tmp_path, recipe, 8)  # one micro batch: the model's own mean
    for micro in (1, 2):
        loss, grads, validation = _one_step(tmp_path, recipe, micro)
        # relative: fp32 sums over rows of another batch size round differently (~1e-7)
        assert abs(loss - whole[0]) <= TOLERANCE * whole[0], (micro, loss, whole[0])
        assert abs(validation - whole[2]) <= TOLERANCE * whole[2], (micro, validation, whole[2])
        for name, grad in grads.items():
            reference = whole[1][name]
            scale = float(reference.abs().max())
            worst = float((grad - reference).abs().max())
            assert worst <= TOLERANCE * max(scale, 1e-3), (micro, name, worst, scale)


def _records(out):
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _assert_same_run(reference, got, keys=("loss", "grad_norm", "val_loss"), tolerance=TOLERANCE):
    assert [r["step"] for r in reference] == [r["step"] for r in got]
    for ref, record in zip(reference, got, strict=True):
        for key in keys:
            if key in ref:
                assert abs(ref[key] - record[key]) <= tolerance * max(1.0, abs(ref[key])), (
                    record["step"],
                    key,
                    ref[key],
                    record[key],
                )


def test_two_processes_equal_one_with_documents_padding_and_ignored_labels(tmp_path, data_cache):
    recipe = short_documents_recipe(
        tmp_path, data_cache, steps=3, eval_every=3, document_masking=True, micro_batch_size=2
    )
    path = write_recipe(tmp_path / "ragged.yaml", recipe)
    command = [sys.executable, RAGGED_SCRIPT, str(path), "--out", str(tmp_path / "one")]
    single = run_launcher([*command, "--quiet"], 240, subprocess_env())
    assert single.returncode == 0, single.stderr[-3000:]
    for parallel in ("ddp", "fsdp"):
        path = write_recipe(tmp_path / f"{parallel}.yaml", {**recipe, "parallel": parallel})
        out = tmp_path / parallel
        result = torchrun_target([RAGGED_SCRIPT, str(path), "--out", str(out), "--quiet"])
        assert result.returncode == 0, result.stderr[-3000:]
        _assert_same_run(_records(tmp_path / "one"), _records(out))


def test_a_sharded_two_process_run_resumes_on_one_process_exactly(tmp_path, data_cache):
    """FSDP2 on two processes (sharded checkpoints) with document masking, stopped at step 2
    and resumed on one process, continues as one process trained from the start."""
    recipe = short_documents_recipe(
        tmp_path, data_cache, steps=4, document_masking=True, micro_batch_size=2
    )
    reference = train(TrainConfig.from_dict(recipe), tmp_path / "one", progress=False)
    sharded = {**recipe, "parallel": "fsdp", "checkpoint_every": 2}
    path = write_recipe(tmp_path / "fsdp.yaml", sharded)
    out = tmp_path / "fsdp"
    result = torchrun([str(path), "--out", str(out), "--steps", "2", "--quiet"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "checkpoints" / "step-00000002" / "sharded" / ".metadata").is_file()
    moved = tmp_path / "resumed"
    shutil.copytree(out, moved)
    resumed = train(TrainConfig.from_dict(recipe), moved, resume=True, progress=False)
    assert sorted(resumed.losses) == [3, 4]
    for step in (1, 2, 3, 4):
        got = resumed.losses.get(step) or _records(out)[step - 1]["loss"]
        assert abs(got - reference.losses[step]) <= TOLERANCE, (step, got, reference.losses)
