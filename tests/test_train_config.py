"""Training recipes: validation before any work, overrides, the paper's hyperparameters."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from diffattn import DiffTransformerLM, count_parameters
from diffattn.commands import train as train_command
from diffattn.train import (
    ConfigError,
    DistEnv,
    LRSchedule,
    TrainConfig,
    apply_overrides,
    check_runtime,
    load_config,
    parameter_groups,
    read_env,
)
from diffattn.train.config import ScheduleSection
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import REPO, tiny_recipe, write_recipe

CONFIGS = REPO / "configs"
PAPER_SCALING = {  # DIFF V1 App. E, Table 10: size -> (d_model, layers, DIFF heads, lr)
    "830m": (1536, 24, 8, 1.5e-4),
    "1.4b": (2048, 24, 8, 1.5e-4),
    "2.8b": (2560, 32, 10, 1.5e-4),
    "6.8b": (4096, 32, 16, 7.5e-5),
    "13.1b": (5120, 40, 20, 7.5e-5),
}


def _error(data, key: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(data)
    assert info.value.key == key, str(info.value)
    assert str(info.value).startswith(f"{key}: ")
    return info.value


# ----------------------------------------------------------------------------------------
# recipes
def test_tiny_recipe_loads_and_is_a_cpu_run():
    config = load_config(CONFIGS / "tiny.yaml")
    assert config.device == "cpu" and config.parallel == "none"
    assert config.model_config().attention == "diff_v1"
    assert config.schedule.total_steps is not None  # --steps stops early on the same schedule


def test_paper_3b_recipe_matches_table_9():
    config = load_config(CONFIGS / "paper-3b.yaml")
    model = config.model_config()
    assert (model.d_model, model.n_layers, model.ffn_dim, model.vocab_size) == (
        3072,
        28,
        8192,
        100_288,
    )
    assert model.n_heads // 2 == 12 and model.dim_per_head == 128  # 12 DIFF heads of d=128
    assert config.seq_len == 4096
    assert config.global_batch_size * config.seq_len == 4 * 2**20  # 4M tokens
    assert config.optim.betas == (0.9, 0.95) and config.optim.weight_decay == 0.1
    assert config.optim.lr == pytest.approx(3.2e-4)
    assert config.schedule.warmup_steps == 1000 and config.schedule.decay == "linear"
    assert config.schedule.min_lr == pytest.approx(1.28e-5)
    assert config.data["tokenizer"] == "tiktoken:cl100k_base"
    assert config.parallel == "fsdp" and config.dtype == "bf16"


@pytest.mark.parametrize("size", sorted(PAPER_SCALING))
def test_paper_scaling_recipes_match_appendix_e(size):
    d_model, layers, heads, lr = PAPER_SCALING[size]
    config = load_config(CONFIGS / f"paper-{size}.yaml")
    model = config.model_config()
    assert (model.d_model, model.n_layers, model.n_heads // 2) == (d_model, layers, heads)
    assert config.seq_len == 2048 and config.global_batch_size * 2048 == 2**18  # 0.25M
    assert config.steps == 40_000 and config.schedule.warmup_steps == 375
    assert config.optim.betas == (0.9, 0.98) and config.optim.weight_decay == 0.05
    assert config.optim.lr == pytest.approx(lr)
    assert config.schedule.decay == "linear"


def test_every_recipe_validates_and_builds_on_meta():
    recipes = sorted(CONFIGS.glob("*.yaml"))
    assert len(recipes) >= 7
    for path in recipes:
        config = load_config(path)
        with torch.device("meta"):
            model = DiffTransformerLM(config.model_config())
        assert model.num_parameters() > 0
        assert config.seq_len <= config.model_config().max_seq_len


def test_paper_13b_is_about_13_billion_parameters():
    config = load_config(CONFIGS / "paper-13.1b.yaml")
    # the paper's size names count the parameters without the input embedding
    assert count_parameters(config.model_config(), exclude_embeddings=True) / 1e9 == (
        pytest.approx(13.1, abs=0.05)
    )


# ----------------------------------------------------------------------------------------
# one error naming the key
@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"stepz": 3}, "stepz"),
        ({"optim": {"lr": 1e-3, "momentum": 0.9}}, "optim.momentum"),
        ({"schedule": {"warmup": 3}}, "schedule.warmup"),
        ({"model": {"preset": "tiny", "n_layerz": 3}}, "model.n_layerz"),
        ({"data": {"sourcez": ["stdlib"]}}, "data.sourcez"),
        ({"steps": "many"}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"compile": "yes"}, "compile"),
        ({"optim": {"lr": "fast"}}, "optim.lr"),
        ({"optim": {"betas": [0.9]}}, "optim.betas"),
        ({"optim": {"betas": [0.9, 1.5]}}, "optim.betas"),
        ({"optim": {"lr": -1.0}}, "optim.lr"),
        ({"parallel": "zero3"}, "parallel"),
        ({"schedule": {"decay": "step"}}, "schedule.decay"),
        ({"global_batch_size": 10, "micro_batch_size": 4}, "global_batch_size"),
        ({"global_batch_size": 4, "micro_batch_size": 8}, "micro_batch_size"),
        (
            {"steps": 10, "schedule": {"warmup_steps": 20, "total_steps": None}},
            "schedule.warmup_steps",
        ),
        ({"schedule": {"min_lr": 1.0}}, "schedule.min_lr"),
        ({"seq_len": 128}, "seq_len"),
        ({"model": {"preset": "7B"}}, "model.preset"),
        ({"model": {"preset": "tiny", "attention": "diff_v3"}}, "model.attention"),
        ({"model": {"preset": "tiny", "n_heads": 3}}, "model.n_heads"),
        ({"model": {"preset": "tiny", "match_params": True}}, "model.match_params"),
        ({"model": {"preset": "tiny", "match_multiple_of": 0}}, "model.match_multiple_of"),
        ({"model": {"preset": "tiny", "match_multiple_of": "64"}}, "model.match_multiple_of"),
        ({"data": {"tokenizer": "bpe:12"}}, "data.tokenizer"),
        ({"keep_last": 0}, "keep_last"),
        ({"spike_factor": 0.5}, "spike_factor"),
        ({"fsdp_init": "sharded"}, "fsdp_init"),
        ({"selective_ac": 2}, "selective_ac"),  # activation_checkpointing: none
        ({"activation_checkpointing": "full", "selective_ac": 2}, "selective_ac"),
        ({"activation_checkpointing": True, "selective_ac": 2}, "selective_ac"),
    ],
)
def test_invalid_setting_is_one_error_naming_the_key(tmp_path, changes, key):
    _error(tiny_recipe(tmp_path, **changes), key)


def test_yaml_exponent_without_dot_reads_as_a_number(tmp_path):
    path = tmp_path / "r.yaml"
    write_recipe(path, tiny_recipe(tmp_path))
    path.write_text(path.read_text() + "\n", encoding="utf-8")
    config = load_config(path, ["optim.lr=3e-4"])  # YAML 1.1 reads 3e-4 as a string
    assert config.optim.lr == pytest.approx(3e-4)


def test_overrides_parse_yaml_scalars_and_reach_every_section(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path))
    config = load_config(
        path,
        [
            "optim.betas=[0.9, 0.98]",
            "model.n_layers=3",
            "model.attention=diff_v2",
            "data.max_bytes=200000",
            "schedule.decay=cosine",
            "keep_last=null",
            "compile=true",
        ],
    )
    assert config.optim.betas == (0.9, 0.98)
    assert config.model_config().n_layers == 3 and config.model.attention == "diff_v2"
    assert config.data["max_bytes"] == 200_000
    assert config.schedule.decay == "cosine" and config.keep_last is None and config.compile


@pytest.mark.parametrize(
    ("override", "key"),
    [("steps", "--set"), ("=3", "--set"), ("steps.sub=3", "steps"), ("optim.lr=[1", "optim.lr")],
)
def test_bad_override_is_named(tmp_path, override, key):
    with pytest.raises(ConfigError) as info:
        apply_overrides({"steps": 3}, [override])
    assert info.value.key == key


def test_missing_and_malformed_recipe_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_round_trip_through_dict(tmp_path):
    config = TrainConfig.from_dict(tiny_recipe(tmp_path))
    again = TrainConfig.from_dict(config.to_dict())
    assert again == config


# ----------------------------------------------------------------------------------------
# launch-dependent checks
def test_runtime_checks_name_the_key(tmp_path):
    base = TrainConfig.from_dict(tiny_recipe(tmp_path))
    single = DistEnv()
    two = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, launched=True)
    cases = [
        (base.replace(parallel="fsdp"), single, "parallel"),
        (base.replace(parallel="ddp"), single, "parallel"),
        (base, two, "parallel"),
        (base.replace(parallel="ddp", global_batch_size=12), two, "global_batch_size"),
        (base.replace(parallel="ddp", micro_batch_size=8), two, "global_batch_size"),
        (base.replace(device="cuda"), single, "device"),
        (base.replace(wandb=True), single, "wandb"),
    ]
    import importlib.util

    wandb_installed = importlib.util.find_spec("wandb") is not None
    for config, env, key in cases:
        if key == "wandb" and wandb_installed:
            continue  # the case under test is a missing wandb
        with pytest.raises(ConfigError) as info:
            check_runtime(config, env, cuda_available=False)
        assert info.value.key == key, str(info.value)
    check_runtime(base.replace(parallel="ddp"), two, cuda_available=False)
    check_runtime(base.replace(parallel="fsdp", micro_batch_size=2), two, cuda_available=False)


def test_the_batch_is_split_over_data_parallel_ranks_only_under_context_parallelism():
    """Context-parallel ranks read the same rows (as a tensor-parallel group does), so the batch
    needs to divide by world / (tp · cp), the trainer's data-parallel ranks, not by the world."""
    base = TrainConfig(steps=2, global_batch_size=4, micro_batch_size=None, seq_len=16)
    eight = DistEnv(rank=0, world_size=8, local_rank=0, local_world_size=8, launched=True)
    six = DistEnv(rank=0, world_size=6, local_rank=0, local_world_size=6, launched=True)
    check_runtime(base.replace(parallel="ddp", cp=8), eight, cuda_available=False)
    check_runtime(base.replace(parallel="fsdp", cp=2, tp=2), eight, cuda_available=False)
    with pytest.raises(ConfigError) as info:  # 8 data-parallel ranks for 4 rows
        check_runtime(base.replace(parallel="ddp"), eight, cuda_available=False)
    assert info.value.key == "global_batch_size"
    with pytest.raises(ConfigError) as info:
        check_runtime(base.replace(parallel="ddp", cp=4), six, cuda_available=False)
    assert info.value.key == "cp" and "4 does not divide the 6 processes" in str(info.value)


def test_read_env_is_the_one_place_for_torchrun_variables():
    assert read_env({}) == DistEnv()
    env = read_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.launched, env.is_main) == (
        3,
        4,
        1,
        True,
        False,
    )
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        read_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


# ----------------------------------------------------------------------------------------
# the command: one error, exit code 2, nothing written
def _args(config: Path, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    return parser.parse_args([str(config), "--out", str(out), "--quiet", *extra])


def test_command_rejects_bad_settings_with_exit_2_and_writes_nothing(tmp_path, capsys):
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "cache"))
    out = tmp_path / "out"
    for extra, key in [
        (["--set", "optim.lr=abc"], "optim.lr"),
        (["--set", "bogus=1"], "bogus"),
        (["--steps", "0"], "steps"),
        (["--set", "schedule.warmup_steps=80"], "schedule.warmup_steps"),
        (["--set", "parallel=fsdp"], "parallel"),
        (["--set", "selective_ac=2"], "selective_ac"),
        (["--set", "model=null"], "model"),
    ]:
        assert train_command.run(_args(path, out, *extra)) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and f"error: {key}: " in err, err
    assert not out.exists()
    assert not (tmp_path / "cache").exists()  # not even the data cache


# ----------------------------------------------------------------------------------------
# optimizer and schedule
def test_linear_schedule_is_the_papers_warmup_then_linear_decay_to_the_floor():
    # DIFF V1 §3.1: 1000 warmup steps to 3.2e-4, then linear decay to 1.28e-5.
    schedule = LRSchedule(
        3.2e-4, ScheduleSection(warmup_steps=1000, decay="linear", min_lr=1.28e-5), 250_000
    )
    assert schedule(1) == pytest.approx(3.2e-7)
    assert schedule(500) == pytest.approx(1.6e-4)
    assert schedule(1000) == pytest.approx(3.2e-4)
    middle = 1000 + (250_000 - 1000) // 2
    assert schedule(middle) == pytest.approx((3.2e-4 + 1.28e-5) / 2, rel=1e-4)
    assert schedule(250_000) == pytest.approx(1.28e-5)
    assert schedule(260_000) == pytest.approx(1.28e-5)  # held after the horizon


def test_cosine_and_constant_schedules():
    cosine = LRSchedule(1.0, ScheduleSection(warmup_steps=10, decay="cosine", min_lr=0.1), 110)
    assert cosine(10) == pytest.approx(1.0)
    assert cosine(60) == pytest.approx(0.55)
    assert cosine(110) == pytest.approx(0.1)
    constant = LRSchedule(1.0, ScheduleSection(warmup_steps=0, decay="constant"), 100)
    assert constant(1) == constant(100) == 1.0
    assert math.isclose(LRSchedule(2.0, ScheduleSection(), 4)(2), 1.0)


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_no_weight_decay_on_norms_and_lambda_vectors(attention):
    from diffattn import ModelConfig

    model = DiffTransformerLM(
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, attention=attention)
    )
    names = {id(p): n for n, p in model.named_parameters()}
    for decay_embeddings in (True, False):
        groups = parameter_groups(model, 0.1, decay_embeddings)
        decayed = {names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
        plain = {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
        assert decayed | plain == set(names.values()) and not decayed & plain
        assert all("norm" in n or "lambda_" in n or n == "embed_tokens.weight" for n in plain)
        assert ("embed_tokens.weight" in decayed) == decay_embeddings
        assert "lm_head.weight" in decayed and "layers.0.attn.q_proj.weight" in decayed
        if attention == "diff_v1":
            assert "layers.1.attn.lambda_q1" in plain and "layers.0.attn.lambda_k2" in plain


def test_a_missing_data_source_is_a_data_error(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path / "cache", data={"sources": [str(tmp_path / "no-such-dir")]})
    path = write_recipe(tmp_path / "r.yaml", recipe)
    assert train_command.run(_args(path, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "error: data: " in err and "no-such-dir" in err, err
    assert not (tmp_path / "out").exists()


def test_match_multiple_of_sets_the_step_of_the_matched_width(tmp_path):
    recipe = tiny_recipe(tmp_path)
    recipe["model"] = {"preset": "tiny", "attention": "diff_v2", "match_params": True}
    path = write_recipe(tmp_path / "r.yaml", recipe)
    # tiny: 384 − (8·16 + 8)/3 = 338.67 hidden units match; 320 is the nearest multiple of 64
    assert load_config(path).model_config().ffn_dim == 320
    unit = load_config(path, ["model.match_multiple_of=1"])
    assert unit.model_config().ffn_dim == 339
    assert unit.to_dict()["model"]["match_multiple_of"] == 1
    assert "match_multiple_of" not in load_config(path).to_dict()["model"]
    # read only by a matched run: without match_params the SwiGLU keeps its full width
    base = load_config(path, ["model.match_multiple_of=1", "model.match_params=false"])
    assert base.model_config().ffn_dim == 384


def test_shipped_recipes_by_name(tmp_path, capsys, monkeypatch):
    """``diffattn train tiny`` reads the recipe shipped in the package (a wheel has no
    ``configs/``); a path still works; an unknown name lists the shipped ones."""
    from diffattn.recipes import resolve_recipe, shipped_names
    from diffattn.train.cli import main

    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert resolve_recipe("tiny").name == "tiny.yaml"
    assert resolve_recipe("paper-3b.yaml").name == "paper-3b.yaml"
    assert resolve_recipe("smollm2", kind="configs/dex").parent.name == "dex"
    assert {"tiny", "paper-base", "paper-13.1b", "compare-100m"} <= set(shipped_names())
    assert load_config(resolve_recipe("paper-3b")).model_config().n_layers == 28
    own = tmp_path / "tiny.yaml"
    own.write_text("steps: 3\n")
    assert resolve_recipe("tiny.yaml").resolve() == own  # an existing path wins over a name
    assert main(["nonesuch", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "error: config: nonesuch: no such file, nor a shipped recipe" in err
    assert "tiny" in err and not (tmp_path / "run").exists()


def test_the_compare_recipe_trains_without_its_retrieval_section(tmp_path):
    """compare.yaml is a training recipe plus diffattn compare's retrieval: section: training
    loads it leaving that section out, with a note; the config itself refuses the key."""
    import diffattn.recipes
    from diffattn.train import ConfigError, TrainConfig, load_config

    recipe = Path(diffattn.recipes.__file__).parent / "compare.yaml"
    notes: list[str] = []
    config = load_config(recipe, ["retrieval.steps=3", "steps=70"], notes)
    assert config.steps == 70
    assert notes == [
        "the recipe's retrieval: section is diffattn compare's retrieval experiment; "
        "training leaves it out"
    ]
    with pytest.warns(UserWarning, match="retrieval: section is diffattn compare's"):
        assert load_config(recipe).to_dict() == load_config(recipe, (), []).to_dict()
    with pytest.raises(ConfigError, match="retrieval: unknown key"):
        TrainConfig.from_dict({"retrieval": {"steps": 3}})
