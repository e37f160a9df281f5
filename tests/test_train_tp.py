"""Tensor parallelism (CPU, gloo, torchrun on 127.0.0.1) against one process.

* TP = 2 forward and backward of all three types (GQA, left and right padding, a KV cache):
  loss, logits and every gathered gradient equal one process (``tp_worker.py``);
* the recipe's ``tp`` is checked before any work; the plans cover the modules they name;
* slow: the backend matrix, FSDP2 × TP on 4 processes (2 × 2) training like one process, an
  exact resume under TP, the checkpoint loading in one process and in Hugging Face, and
  ``from_pretrained(..., tp_plan="auto")`` (``tp_hf_worker.py``).
"""

from __future__ import annotations

import fnmatch
import json

import pytest
import torch

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.attention.common import split_heads
from diffattn.checkpoint import load_model, save_model
from diffattn.train import TrainConfig, train
from diffattn.train.config import ConfigError, check_runtime
from diffattn.train.distributed import DistEnv
from diffattn.train.tensor_parallel import kv_groups, tp_plan, tp_problem
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import REPO, tiny_recipe, torchrun, torchrun_target, write_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

TOLERANCE = 1e-5
ATTENTIONS = ("baseline", "diff_v1", "diff_v2")


def _run_worker(script: str, args: list[str], nproc: int = 2) -> list[dict]:
    result = torchrun_target([str(REPO / "tests" / script), *args], nproc, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _check_equal(results: list[dict], expected: int) -> None:
    assert len(results) == expected, results
    for r in results:
        assert r["missing_grads"] == [], r
        assert r["sharded"] > 0, r
        assert r["loss_diff"] <= TOLERANCE, r
        for key in ("logit_diff", "grad_diff", "cache_diff"):
            assert r[key] <= TOLERANCE, r


def test_tp2_forward_backward_and_cache_equal_one_process_reference_backend():
    _check_equal(_run_worker("tp_worker.py", [",".join(ATTENTIONS), "reference"]), 3)


@pytest.mark.slow
def test_tp2_equal_one_process_on_sdpa_and_fused():
    _check_equal(_run_worker("tp_worker.py", [",".join(ATTENTIONS), "sdpa,fused"]), 6)


# ----------------------------------------------------------------------------------------
# checks before any work
def _tiny(attention: str, **model) -> dict:
    return {"attention": attention, "n_heads": 8, "n_kv_heads": 4, **model}


def test_tp_degree_is_checked_when_the_recipe_is_read(tmp_path):
    cases = [
        ({"tp": 0}, "must be an integer >= 1"),
        ({"tp": "2"}, "expected an integer"),
        ({"tp": 3}, "does not divide the model's 2 KV groups"),  # DIFF V1: 4 half-heads
        ({"tp": 2, "parallel": "ddp"}, "not with ddp"),
        ({"tp": 2, "model": _tiny("baseline", ffn_hidden=33)}, "FFN width 33"),
        ({"tp": 2, "model": _tiny("baseline", vocab_size=513)}, "vocab_size=513"),
        ({"tp": 2, "model": _tiny("baseline", tie_embeddings=True)}, "tied embeddings"),
        ({"tp": 2, "model": _tiny("diff_v2", v2_paired_heads=False)}, "v2_paired_heads"),
        ({"tp": 8, "model": _tiny("diff_v2")}, "does not divide the model's 4 KV groups"),
    ]
    for changes, message in cases:
        recipe = tiny_recipe(tmp_path, model=_tiny("diff_v1"))
        model = changes.pop("model", None)
        if model is not None:
            recipe["model"].update(model)
        with pytest.raises(ConfigError, match=message) as info:
            TrainConfig.from_dict({**recipe, **changes})
        assert info.value.key == "tp", str(info.value)
    TrainConfig.from_dict({**tiny_recipe(tmp_path, model=_tiny("diff_v1")), "tp": 2})


def test_tp_launch_is_checked_before_any_work(tmp_path):
    config = TrainConfig.from_dict({**tiny_recipe(tmp_path, model=_tiny("diff_v1")), "tp": 2})

    def env(world):
        return DistEnv(
            rank=0, world_size=world, local_rank=0, local_world_size=world, launched=True
        )

    cases = [
        (config, DistEnv(), "tp", "needs a distributed launch"),
        (config, env(3), "tp", "does not divide the 3 processes"),
        (config, env(4), "parallel", "parallel is 'none' and tp is 2"),
        (
            config.replace(parallel="fsdp", global_batch_size=6, micro_batch_size=None),
            env(8),
            "global_batch_size",
            "world size 4",  # four data-parallel ranks of two
        ),
    ]
    for cfg, launch, key, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            check_runtime(cfg, launch, cuda_available=False)
        assert info.value.key == key
    check_runtime(config, env(2), cuda_available=False)
    check_runtime(config.replace(parallel="fsdp", micro_batch_size=2), env(4), cuda_available=False)


def test_plans_name_existing_modules_and_groups_divide():
    from diffattn.hf.tp_plan import TP_PLAN

    for attention in ATTENTIONS:
        config = ModelConfig(
            attention=attention,
            vocab_size=64,
            d_model=32,
            n_layers=2,
            n_heads=8,
            n_kv_heads=4,
            head_dim=8,
        )
        with torch.device("meta"):
            model = DiffTransformerLM(config)
        names = [name for name, _ in model.named_modules()]
        for rule in tp_plan(config):
            assert fnmatch.filter(names, rule), (attention, rule)
        hf_names = ["model." + name for name in names]
        matched = {rule for rule in TP_PLAN if fnmatch.filter(hf_names, rule)}
        unmatched = set(TP_PLAN) - matched
        v2_only = {"model.layers.*.attn.lambda_proj"}
        assert unmatched == (set() if attention == "diff_v2" else v2_only)
        assert kv_groups(config) == (2 if attention == "diff_v1" else 4)
        assert tp_problem(config, 2) is None
        assert "KV groups" in tp_problem(config, 8 if attention != "diff_v1" else 4)


def test_split_heads_reads_the_head_count_from_the_width():
    x = torch.randn(2, 3, 4 * 6)
    assert split_heads(x, 6).shape == (2, 4, 3, 6)
    assert split_heads(x[..., :12], 6).shape == (2, 2, 3, 6)  # a shard of whole heads
    with pytest.raises(ValueError, match="not whole heads of width 5"):
        split_heads(x, 5)


# ----------------------------------------------------------------------------------------
# training (slow)
def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _tp_recipe(data_cache, **changes):
    model = {"attention": "diff_v1", "n_heads": 8, "n_kv_heads": 4}
    return tiny_recipe(data_cache, steps=4, eval_every=2, model=model, **changes)


def _close(reference: list[dict], got: list[dict]) -> float:
    assert [r["step"] for r in reference] == [r["step"] for r in got]
    worst = 0.0
    for ref, run in zip(reference, got, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in ref:
                worst = max(worst, abs(ref[key] - run[key]))
        for a, b in zip(ref.get("lambda", []), run.get("lambda", []), strict=True):
            worst = max(worst, abs(a - b))
    assert worst <= TOLERANCE, worst
    return worst


@pytest.mark.slow
def test_fsdp2_by_tp_on_four_processes_equals_one_process(tmp_path, data_cache):
    recipe = _tp_recipe(data_cache)
    reference = tmp_path / "single"
    train(TrainConfig.from_dict(recipe), reference, progress=False)
    path = write_recipe(
        tmp_path / "2d.yaml",
        {**recipe, "parallel": "fsdp", "tp": 2, "micro_batch_size": 2, "checkpoint_format": "full"},
    )
    out = tmp_path / "2d"
    result = torchrun([str(path), "--out", str(out), "--quiet"], nproc=4, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    _close(_records(reference), _records(out))
    two_d = load_model(out / "checkpoints" / "step-00000004").state_dict()
    single = load_model(reference / "checkpoints" / "step-00000004").state_dict()
    for name, value in single.items():  # Adam's 1/sqrt(v) amplifies rounding: see FSDP2's test
        assert torch.allclose(value, two_d[name], atol=1e-4, rtol=0), name


@pytest.mark.extra("hf")
@pytest.mark.slow
def test_tp_resume_is_exact_and_the_checkpoint_loads_alone_and_in_hf(tmp_path, data_cache):
    recipe = {**_tp_recipe(data_cache, checkpoint_every=2), "tp": 2}
    path = write_recipe(tmp_path / "tp.yaml", recipe)
    whole, split = tmp_path / "whole", tmp_path / "split"
    for args in (
        ["--out", str(whole)],
        ["--out", str(split), "--steps", "2"],
        ["--out", str(split), "--resume"],
    ):
        result = torchrun([str(path), *args, "--quiet"])
        assert result.returncode == 0, result.stderr[-3000:]
    uninterrupted, resumed = _records(whole), _records(split)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)

    # the checkpoint is an ordinary model directory: one process and HF load it
    from transformers import AutoModelForCausalLM

    from diffattn.hf import register

    register()
    checkpoint = split / "checkpoints" / "step-00000004"
    model = load_model(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, hf(ids).logits, atol=1e-6)
    whole_state = load_model(whole / "checkpoints" / "step-00000004").state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, whole_state[name]), name


@pytest.mark.slow
def test_hf_tp_plan_auto_gives_the_logits_of_one_process(tmp_path):
    from tp_worker import config_for

    paths = []
    for attention in ATTENTIONS:
        torch.manual_seed(0)
        save_model(DiffTransformerLM(config_for(attention, 2)), tmp_path / attention)
        paths.append(str(tmp_path / attention))
    results = _run_worker("tp_hf_worker.py", paths)
    assert len(results) == 3
    for r in results:
        assert r["sharded"] > 0 and r["same_generation"], r
        assert r["logit_diff"] <= TOLERANCE and r["cache_diff"] <= TOLERANCE, r


def test_static_cache_refuses_the_local_heads_of_a_shard():
    """A slice assignment would broadcast one local KV head into every cached head."""
    from diffattn.cache import StaticCache

    config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    cache = StaticCache(config, batch_size=1, max_len=8)
    local = torch.randn(1, 1, 3, config.dim_per_head)
    with pytest.raises(ValueError, match=r"\(batch, heads\) = \(1, 2\), got keys \(1, 1\)"):
        cache.update(0, local, local)
