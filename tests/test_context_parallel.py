"""Context parallelism (:mod:`diffattn.attention.context_parallel`,
:mod:`diffattn.train.context_parallel`): the load-balanced layout, the types' declarations, and
(CPU, gloo, torchrun on 127.0.0.1, ``cp_worker.py``) the loss, the logits gathered back and every
parameter gradient of 2 and 4 ranks against one process."""

from __future__ import annotations

import json

import pytest
import torch

from diffattn import ModelConfig
from diffattn.attention.context_parallel import ChunkLayout, layout_problem
from diffattn.attention.types import AttentionType, attention_type, attention_type_names
from diffattn.checkpoint import load_model
from diffattn.train import TrainConfig, train
from diffattn.train.config import ConfigError
from diffattn.train.context_parallel import model_problem
from extras import require_extra

pytestmark = [require_extra("train"), pytest.mark.usefixtures("one_thread")]

from train_helpers import REPO, tiny_recipe, torchrun, torchrun_target, write_recipe

WORKER = str(REPO / "tests" / "cp_worker.py")
TYPES_BY_HEADS = [f"{t}:{kv}:{docs}" for t in ("baseline", "diff_v1", "diff_v2")
                  for kv in ("gqa", "mha") for docs in ("plain", "packed")]  # fmt: skip
OTHERS = ["gda:gqa:packed", "gated_diff:gqa:packed", "diff_v1:gqa:padded"]


def _run(nproc: int, dtype: str, backend: str, cases: list[str]) -> list[dict]:
    result = torchrun_target([WORKER, dtype, backend, ",".join(cases)], nproc, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases) + (2 if "refusals" in cases else 0), result.stdout
    return rows


def _check(rows: list[dict], nproc: int, dtype: str) -> None:
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    for row in rows:
        if "refusal" in row:
            continue
        assert row["world"] == nproc, row
        assert row["grad_failures"] == [], row
        for key in ("loss_diff", "logit_diff"):
            assert row[key] <= tolerance, row
        if dtype == "float64":
            assert row["grad_diff"] <= tolerance, row


# --- the layout ---------------------------------------------------------------------------
@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_every_rank_holds_two_chunks_and_reads_the_same_number_of_keys(degree):
    n = 2 * degree * 5
    layouts = [ChunkLayout(n, degree, r) for r in range(degree)]
    held = torch.cat([layout.positions() for layout in layouts])
    assert sorted(held.tolist()) == list(range(n))  # every position on exactly one rank
    keys = {sum((i + 1) * layout.chunk for i in layout.chunks) for layout in layouts}
    assert keys == {(2 * degree + 1) * 5}  # causal work balanced
    order = layouts[0].global_order()
    assert torch.equal(held[order], torch.arange(n))


def test_shard_keeps_the_rank_s_chunks_in_local_order():
    layout = ChunkLayout(16, 2, 1)  # chunks 1 and 2 of four chunks of 4
    row = torch.arange(100, 116)[None]
    assert layout.shard(row).tolist() == [[104, 105, 106, 107, 108, 109, 110, 111]]
    assert ChunkLayout(16, 2, 0).shard(row).tolist() == [[100, 101, 102, 103, 112, 113, 114, 115]]


@pytest.mark.parametrize("n", [0, 7, 12])
def test_a_length_that_does_not_cut_into_two_chunks_a_rank_is_refused(n):
    why = layout_problem(n, 4)
    assert why is not None and "multiple of 8" in why and f"got {n}" in why
    with pytest.raises(ValueError, match="multiple of 8"):
        ChunkLayout(n, 4, 0)
    assert layout_problem(16, 4) is None


# --- the declarations ---------------------------------------------------------------------
def test_built_in_types_declare_whether_they_split():
    reasons = {
        name: attention_type(name).context_parallel_reason for name in attention_type_names()
    }
    assert {name for name, why in reasons.items() if why is None} >= {
        "baseline", "diff_v1", "diff_v2", "gated_diff", "gda"
    }  # fmt: skip
    assert "earlier query rows" in reasons["dint"]


def test_a_subclass_does_not_inherit_the_claim_that_it_splits():
    class Derived(type(attention_type("baseline"))):
        name = "derived_for_cp"

    assert "no context-parallel split is declared" in Derived().context_parallel_reason
    assert AttentionType.context_parallel_reason is not None


def test_a_model_with_a_type_that_cannot_split_is_refused_by_its_reason():
    dint = ModelConfig(attention="dint", n_heads=4, n_kv_heads=2)
    assert "'dint' cannot split the sequence" in model_problem(dint, 2)
    assert model_problem(dint, 1) is None
    assert model_problem(ModelConfig(attention="diff_v2"), 4) is None


# --- against one process (torchrun) -------------------------------------------------------
def test_two_ranks_equal_one_process_in_float64_and_refuse_bad_input():
    cases = ["diff_v1:gqa:packed", "diff_v2:gqa:plain", "baseline:mha:padded", "refusals"]
    rows = _run(2, "float64", "sdpa", cases)
    _check(rows, 2, "float64")
    refusals = {row["refusal"]: row["error"] for row in rows if "refusal" in row}
    assert "multiple of 4, got 6" in refusals["length"]
    assert "'dint' cannot split the sequence" in refusals["dint"]
    assert "takes a 2-D attention_mask shaped as input_ids" in refusals["mask"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize(
    ("dtype", "backend"), [("float64", "sdpa"), ("float32", "reference"), ("float32", "fused")]
)
def test_ranks_equal_one_process_for_every_type_heads_and_documents(nproc, dtype, backend):
    rows = _run(nproc, dtype, backend, TYPES_BY_HEADS + OTHERS)
    _check(rows, nproc, dtype)


@pytest.mark.slow
def test_checkpointed_blocks_gather_again_in_backward():
    cases = ["diff_v1:gqa:packed", "diff_v2:mha:padded", "gated_diff:gqa:plain"]
    _check(_run(4, "float32", "sdpa+ckpt", cases), 4, "float32")


# --- the trainer (recipe key cp) ----------------------------------------------------------
def _cp_recipe(data_cache, **changes):
    model = {"attention": "diff_v2", "n_heads": 4, "n_kv_heads": 2}
    return tiny_recipe(data_cache, steps=4, eval_every=2, model=model, **changes)


def test_cp_recipe_key_is_checked_when_the_recipe_is_read(tmp_path):
    dint = {"attention": "dint", "n_heads": 4, "n_kv_heads": 2}
    cases = [
        ({"cp": 0}, "must be an integer >= 1"),
        ({"cp": 2}, "combines with parallel: ddp or fsdp"),
        ({"cp": 3, "parallel": "ddp"}, "multiple of 6, got 32"),
        ({"cp": 2, "parallel": "ddp", "model": dint}, "'dint' cannot split the sequence"),
        (
            {"cp": 2, "parallel": "ddp", "document_masking": True, "model": {"backend": "flash"}},
            "backend 'flash' takes packed documents only without a query offset",
        ),
    ]
    for changes, message in cases:
        recipe = _cp_recipe(tmp_path)
        recipe["model"].update(changes.pop("model", {}))
        with pytest.raises(ConfigError, match=message) as info:
            TrainConfig.from_dict({**recipe, **changes})
        assert info.value.key == "cp", str(info.value)
    TrainConfig.from_dict({**_cp_recipe(tmp_path), "cp": 2, "parallel": "fsdp"})
    TrainConfig.from_dict({**_cp_recipe(tmp_path), "cp": 2, "parallel": "fsdp", "tp": 2})


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _worst_relative(reference: list[dict], got: list[dict]) -> float:
    """The largest relative difference of the logged loss, validation loss and gradient norm."""
    assert [r["step"] for r in reference] == [r["step"] for r in got]
    pairs = zip(reference, got, strict=True)
    keys = ("loss", "val_loss", "grad_norm")
    return max(abs(a[k] - b[k]) / abs(a[k]) for a, b in pairs for k in keys if k in a)


@pytest.mark.parametrize(
    ("parallel", "nproc", "checkpointing", "tp"),
    [
        pytest.param("ddp", 2, "full", 1, marks=pytest.mark.slow),
        ("fsdp", 4, "selective", 1),  # CP x FSDP2 on 4 processes: in the default suite
        pytest.param("fsdp", 4, "none", 2, marks=pytest.mark.slow),
    ],
)
def test_cp_training_equals_one_process(tmp_path, data_cache, parallel, nproc, checkpointing, tp):
    """cp: 2 alone (DDP over the two ranks of one row), with FSDP2 over 2 data-parallel x
    2 context-parallel ranks, blocks checkpointed (recomputed with their K/V gather in
    backward), and with tp: 2 (FSDP2 over the 2 cp ranks of each tp rank): the losses,
    gradient norms and validation losses of one process (packed documents), and a checkpoint
    that loads and runs without context parallelism."""
    recipe = _cp_recipe(data_cache, document_masking=True)
    reference = tmp_path / "single"
    train(TrainConfig.from_dict(recipe), reference, progress=False)
    changes = {"parallel": parallel, "cp": 2, "micro_batch_size": 2, "checkpoint_format": "full"}
    changes.update(activation_checkpointing=checkpointing, tp=tp)
    path = write_recipe(tmp_path / "cp.yaml", {**recipe, **changes, "checkpoint_every": 4})
    out = tmp_path / "cp"
    result = torchrun([str(path), "--out", str(out), "--quiet"], nproc=nproc, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _worst_relative(_records(reference), _records(out)) <= 1e-5
    model = load_model(out / "checkpoints" / "step-00000004")
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.slow
def test_cp_that_does_not_divide_the_launch_stops_with_one_line(tmp_path, data_cache):
    recipe = {**_cp_recipe(data_cache), "parallel": "ddp", "cp": 2, "global_batch_size": 6}
    path = write_recipe(tmp_path / "cp.yaml", {**recipe, "micro_batch_size": 2})
    result = torchrun([str(path), "--out", str(tmp_path / "out"), "--quiet"], nproc=3)
    assert result.returncode != 0
    assert "cp: 2 does not divide the 3 processes of the launch" in result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def _launch(tmp_path, recipe: dict, nproc: int, out, *args: str) -> None:
    """``diffattn train`` of ``recipe`` on ``nproc`` processes (torchrun), or in this one."""
    if nproc == 1:
        steps = {"steps": int(args[1])} if args[:1] == ("--steps",) else {}
        resume = "--resume" in args
        train(TrainConfig.from_dict({**recipe, **steps}), out, resume=resume, progress=False)
        return
    path = write_recipe(tmp_path / f"cp-{nproc}.yaml", recipe)
    result = torchrun([str(path), "--out", str(out), *args, "--quiet"], nproc=nproc, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("first", "then"),
    [
        # cp 2 (full checkpoint) -> one process
        pytest.param(("ddp", 2, 2), ("none", 1, 1), marks=pytest.mark.slow),
        # FSDP2 x cp 2 (sharded) -> FSDP2 alone: in the default suite
        (("fsdp", 2, 4), ("fsdp", 1, 2)),
    ],
)
def test_a_run_resumes_under_another_cp_degree_and_continues_exactly(
    tmp_path, data_cache, first, then
):
    """2 steps under ``first`` (parallel, cp, processes), steps 3-4 resumed under ``then``: the
    losses and gradient norms of an uninterrupted one-process run."""
    recipe = {**_cp_recipe(data_cache, document_masking=True, checkpoint_every=2), "eval_every": 0}
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(TrainConfig.from_dict(recipe), whole, progress=False)
    for (parallel, cp, nproc), args in ((first, ("--steps", "2")), (then, ("--resume",))):
        changes = {"parallel": parallel, "cp": cp, "micro_batch_size": 2}
        _launch(tmp_path, {**recipe, **changes}, nproc, split, *args)
    resumed = _records(split)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert _worst_relative(_records(whole), resumed) <= 1e-5


@pytest.mark.slow
def test_compiled_blocks_split_exactly():
    """``compile_blocks`` (inductor, the trainer's ``compile: true``) under context
    parallelism: loss, logits and gradients of one process."""
    _check(_run(2, "float32", "sdpa+compile", ["diff_v2:gqa:packed"]), 2, "float32")
