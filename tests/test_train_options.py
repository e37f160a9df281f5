"""Trainer options: optimizers by name (torch.optim classes, Muon + AdamW), the WSD schedule,
and recipe inheritance (``base:``), each with its errors and through ``diffattn train``."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import nn

from extras import require_extra

pytestmark = require_extra("train")

import yaml

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.train import ConfigError, LRSchedule, TrainConfig, load_config, parameter_groups
from diffattn.train.config import OptimSection, ScheduleSection, dump_config, read_recipe
from diffattn.train.optim import CombinedOptimizer, build_optimizer, hidden_matrices
from train_helpers import REPO, read_losses, tiny_recipe, train_cli, write_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

CONFIGS = REPO / "configs"


def _model(attention: str = "diff_v1") -> DiffTransformerLM:
    torch.manual_seed(0)
    return DiffTransformerLM(
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, attention=attention)
    )


def _optim(**settings) -> OptimSection:
    return TrainConfig.from_dict({"optim": settings}).optim


def _error(data, key: str, *fragments: str) -> str:
    """``TrainConfig.from_dict(data)`` raises one ConfigError for ``key`` saying ``fragments``."""
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(data)
    message = str(info.value)
    assert info.value.key == key and message.startswith(f"{key}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _one_step(model: nn.Module, optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


# ----------------------------------------------------------------------------------------
# optimizers by name
def test_default_is_the_adamw_of_before():
    model, twin = _model(), _model()
    optimizer = build_optimizer(model, OptimSection())
    assert type(optimizer) is torch.optim.AdamW
    groups = parameter_groups(twin, 0.1, True)
    before = torch.optim.AdamW(groups, lr=3.2e-4, betas=(0.9, 0.95), eps=1e-8)
    assert len(optimizer.param_groups) == len(before.param_groups) == 2
    for ours, theirs in zip(optimizer.param_groups, before.param_groups, strict=True):
        assert {k: v for k, v in ours.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"
        }
        assert [p.shape for p in ours["params"]] == [p.shape for p in theirs["params"]]
    for seed in range(3):
        _one_step(model, optimizer, seed)
        _one_step(twin, before, seed)
    assert _same_weights(model, twin)


@pytest.mark.parametrize(
    ("name", "cls"),
    [("sgd", "SGD"), ("SGD", "SGD"), ("Sgd", "SGD"), ("adam", "Adam"), ("rmsprop", "RMSprop")],
)
def test_torch_optimizers_by_name_case_insensitive(name, cls):
    optimizer = build_optimizer(_model(), _optim(name=name))
    assert type(optimizer) is getattr(torch.optim, cls)
    decayed, kept = optimizer.param_groups
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.1, 0.0)
    assert decayed["lr_scale"] == kept["lr_scale"] == 1.0


def test_betas_eps_and_kwargs_reach_the_class():
    adam = build_optimizer(_model(), _optim(name="adam", betas=[0.8, 0.9], eps=1e-6))
    assert adam.defaults["betas"] == (0.8, 0.9) and adam.defaults["eps"] == 1e-6
    sgd = build_optimizer(_model(), _optim(name="sgd", kwargs={"momentum": 0.9, "nesterov": True}))
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"] is True
    assert "betas" not in sgd.defaults and "eps" not in sgd.defaults  # SGD takes neither
    # a list in kwargs is passed as a tuple (YAML has no tuples)
    factor = _optim(name="adafactor", kwargs={"eps": [None, 1e-3]})
    assert build_optimizer(_model(), factor).defaults["eps"] == (None, 1e-3)


def test_a_class_without_weight_decay_runs_with_weight_decay_zero():
    optimizer = build_optimizer(_model(), _optim(name="rprop", weight_decay=0))
    assert type(optimizer) is torch.optim.Rprop
    assert all("weight_decay" not in group for group in optimizer.param_groups)


@pytest.mark.parametrize(
    ("optim", "key", "fragments"),
    [
        ({"name": "nope"}, "optim.name", ["unknown optimizer 'nope'", "muon", "sgd", "adamw"]),
        ({"name": "lbfgs"}, "optim.name", ["LBFGS needs a closure"]),
        ({"name": "SparseAdam"}, "optim.name", ["SparseAdam takes sparse gradients only"]),
        ({"name": "sgd", "betas": [0.9, 0.98]}, "optim.betas", ["SGD takes no betas", "momentum"]),
        ({"name": "sgd", "eps": 1e-6}, "optim.eps", ["SGD takes no eps; remove optim.eps"]),
        ({"name": "adafactor", "eps": 1e-6}, "optim.eps", ["not a number", "optim.kwargs.eps"]),
        ({"name": "rprop"}, "optim.weight_decay", ["Rprop takes no weight_decay", ": 0"]),
        ({"name": "sgd", "muon_lr_scale": 2}, "optim.muon_lr_scale", ["only applies to"]),
        ({"name": "muon", "muon_lr_scale": 0}, "optim.muon_lr_scale", ["positive finite"]),
        ({"kwargs": [1]}, "optim.kwargs", ["expected a mapping"]),
        ({"name": "sgd", "kwargs": {"foo": 1}}, "optim.kwargs.foo", ["no argument 'foo'"]),
        ({"kwargs": {"amsgrad": True, "bar": 1}}, "optim.kwargs.bar", ["AdamW takes no"]),
        ({"kwargs": {"lr": 1.0}}, "optim.kwargs.lr", ["passes lr itself; set optim.lr"]),
        ({"kwargs": {"betas": [0, 0]}}, "optim.kwargs.betas", ["set optim.betas instead"]),
        ({"kwargs": {"eps": 1.0}}, "optim.kwargs.eps", ["set optim.eps instead"]),
        ({"kwargs": {"weight_decay": 0}}, "optim.kwargs.weight_decay", ["optim.weight_decay"]),
        ({"kwargs": {"params": []}}, "optim.kwargs.params", ["passes params itself"]),
        ({"name": "muon", "kwargs": {"betas": [0.9, 0.9]}}, "optim.kwargs.betas", ["Muon takes"]),
        ({"name": "sgd", "kwargs": {"momentum": -1}}, "optim.kwargs.momentum", ["refuses"]),
        (
            {"name": "sgd", "kwargs": {"momentum": 0.9, "nesterov": True, "dampening": 0.5}},
            "optim.kwargs.dampening",
            ["SGD refuses it: Nesterov"],
        ),
        (
            {"name": "muon", "kwargs": {"eps": 1e-6, "adjust_lr_fn": "bad"}},
            "optim.kwargs.adjust_lr_fn",
            ["Muon refuses it", "bad"],
        ),
    ],
)
def test_bad_optimizer_settings_are_one_error_naming_the_key(optim, key, fragments):
    _error({"optim": optim}, key, *fragments)


def test_muon_without_torch_muon_names_the_torch_version(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    _error({"optim": {"name": "muon"}}, "optim.name", "torch.optim.Muon", torch.__version__)


# ----------------------------------------------------------------------------------------
# Muon + AdamW
@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(attention):
    model = _model(attention)
    optimizer = build_optimizer(model, _optim(name="Muon", muon_lr_scale=20.0))
    assert isinstance(optimizer, CombinedOptimizer)
    muon, adamw = optimizer
    assert (type(muon), type(adamw)) == (torch.optim.Muon, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon | in_adamw == set(names.values()) and not in_muon & in_adamw
    leaves = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if attention == "diff_v2":
        leaves.add("lambda_proj")
    assert {n.split(".")[-2] for n in in_muon} == leaves
    assert all(model.get_parameter(n).ndim == 2 for n in in_muon)
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= in_adamw
    assert [n for n, _ in hidden_matrices(model)] == sorted(in_muon, key=list(names.values()).index)
    # the schedule reaches every group through lr_scale: Muon's at 20 × the base rate
    LRSchedule(0.01, ScheduleSection(decay="constant"), 10).apply(optimizer, 1)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.2, 0.01, 0.01])
    assert muon.param_groups[0]["weight_decay"] == 0.1
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]


def test_muon_passes_kwargs_and_adamw_keeps_betas_and_eps():
    optim = _optim(name="muon", betas=[0.8, 0.9], eps=1e-6, kwargs={"momentum": 0.9, "eps": 1e-5})
    muon, adamw = build_optimizer(_model(), optim)
    assert muon.defaults["momentum"] == 0.9 and muon.defaults["eps"] == 1e-5
    assert adamw.defaults["betas"] == (0.8, 0.9) and adamw.defaults["eps"] == 1e-6


def test_muon_needs_a_hidden_matrix():
    model = nn.Sequential(nn.Embedding(8, 4))
    with pytest.raises(ConfigError) as info:
        build_optimizer(model, _optim(name="muon"))
    assert info.value.key == "optim.name" and "no hidden matrices" in str(info.value)


def test_the_combined_optimizer_state_dict_continues_exactly():
    model, twin = _model(), _model()
    optimizer = build_optimizer(model, _optim(name="muon"))
    for seed in range(2):
        _one_step(model, optimizer, seed)
    state = optimizer.state_dict()
    assert set(state) == {"state", "param_groups"}
    ids = [i for g in state["param_groups"] for i in g["params"]]
    assert ids == list(range(len(list(model.parameters()))))
    assert len(optimizer.state) == len(ids)
    twin.load_state_dict(model.state_dict())
    other = build_optimizer(twin, _optim(name="muon"))
    other.load_state_dict(copy.deepcopy(state))  # a state read back from disk shares nothing
    for seed in (2, 3):
        _one_step(model, optimizer, seed)
        _one_step(twin, other, seed)
    assert _same_weights(model, twin)
    with pytest.raises(ValueError, match="parameter groups"):
        other.load_state_dict({"state": {}, "param_groups": state["param_groups"][:1]})


def test_the_combined_optimizer_goes_through_torch_distributed_checkpoint():
    from diffattn.train.parallel import full_optimizer_state, load_full_optimizer_state

    model, twin = _model(), _model()
    optimizer = build_optimizer(model, _optim(name="muon"))
    _one_step(model, optimizer, 0)
    state = full_optimizer_state(model, optimizer)
    assert "momentum_buffer" in state["state"]["layers.0.attn.q_proj.weight"]
    assert "exp_avg" in state["state"]["embed_tokens.weight"]
    twin.load_state_dict(model.state_dict())
    other = build_optimizer(twin, _optim(name="muon"))
    load_full_optimizer_state(twin, other, copy.deepcopy(state))
    _one_step(model, optimizer, 1)
    _one_step(twin, other, 1)
    assert _same_weights(model, twin)


def test_the_combined_optimizer_step_evaluates_a_closure_once():
    model = _model()
    optimizer = build_optimizer(model, _optim(name="muon"))
    calls = []

    def closure():
        calls.append(1)
        ids = torch.arange(8).view(1, 8)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss

    assert torch.isfinite(optimizer.step(closure)) and calls == [1]
    assert "Muon, AdamW" in repr(optimizer)


# ----------------------------------------------------------------------------------------
# the WSD schedule
def _wsd(shape: str = "linear", **settings) -> LRSchedule:
    section = {"warmup_steps": 10, "decay": "wsd", "min_lr": 0.1, "decay_shape": shape}
    section.update(settings or {"decay_steps": 20})
    return LRSchedule(1.0, ScheduleSection(**section), 100)


@pytest.mark.parametrize(
    ("shape", "middle", "first"),
    [
        ("linear", 0.1 + 0.9 * 0.5, 0.1 + 0.9 * (1 - 1 / 20)),
        ("cosine", 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 20))),
        ("sqrt", 0.1 + 0.9 * (1 - math.sqrt(0.5)), 0.1 + 0.9 * (1 - math.sqrt(1 / 20))),
    ],
)
def test_wsd_values_at_the_boundaries(shape, middle, first):
    schedule = _wsd(shape)  # warmup 10, stable 11..80, decay 81..100 to 0.1
    assert schedule(1) == pytest.approx(0.1)
    assert schedule(10) == 1.0  # end of warmup
    assert schedule(11) == schedule(50) == schedule(80) == 1.0  # stable: the peak
    assert schedule(81) == pytest.approx(first)  # first step of the decay
    assert schedule(90) == pytest.approx(middle)  # half way
    assert schedule(100) == pytest.approx(0.1)  # end of the decay: the floor
    assert schedule(101) == schedule(500) == pytest.approx(0.1)  # held after the horizon
    values = [schedule(s) for s in range(80, 101)]
    assert all(a > b for a, b in itertools.pairwise(values))


def test_wsd_is_a_pure_function_of_the_step():
    forward = _wsd("sqrt")
    values = {s: forward(s) for s in range(1, 120)}
    backward = _wsd("sqrt")
    assert {s: backward(s) for s in reversed(range(1, 120))} == values
    assert forward(85) == values[85]  # calling again changes nothing


def test_wsd_decay_fraction_is_rounded_to_the_nearest_step():
    assert _wsd(decay_fraction=0.2).decay_steps == 20
    assert [_wsd(decay_fraction=0.2)(s) for s in range(1, 101)] == [
        _wsd()(s) for s in range(1, 101)
    ]
    assert _wsd(decay_fraction=0.125).decay_steps == 13  # 12.5: halves up
    assert _wsd(decay_fraction=0.114).decay_steps == 11  # 11.4


def test_wsd_without_warmup_and_over_the_whole_horizon_is_the_linear_schedule():
    wsd = LRSchedule(1.0, ScheduleSection(decay="wsd", decay_steps=50, min_lr=0.1), 50)
    linear = LRSchedule(1.0, ScheduleSection(decay="linear", min_lr=0.1), 50)
    assert [wsd(s) for s in range(1, 60)] == pytest.approx([linear(s) for s in range(1, 60)])


def test_wsd_state_dict_names_its_decay_and_other_schedules_keep_theirs():
    assert _wsd("cosine").state_dict()["decay_steps"] == 20
    assert _wsd("cosine").describe_changes(_wsd("sqrt").state_dict()) == [
        "decay_shape: 'sqrt' -> 'cosine'"
    ]
    linear = LRSchedule(1.0, ScheduleSection(warmup_steps=2), 10).state_dict()
    assert set(linear) == {"peak", "warmup", "decay", "min_lr", "horizon"}


def _schedule_error(section: dict, key: str, *fragments: str) -> None:
    _error({"steps": 100, "schedule": section}, key, *fragments)


@pytest.mark.parametrize(
    ("section", "key", "fragments"),
    [
        ({"decay": "wsd"}, "schedule.decay_steps", ["needs decay_steps or decay_fraction"]),
        (
            {"decay": "wsd", "decay_steps": 5, "decay_fraction": 0.1},
            "schedule.decay_fraction",
            ["not both"],
        ),
        ({"decay": "wsd", "decay_steps": 0}, "schedule.decay_steps", ["must be >= 1, got 0"]),
        ({"decay": "wsd", "decay_fraction": 0}, "schedule.decay_fraction", ["(0, 1], got 0"]),
        ({"decay": "wsd", "decay_fraction": 1.5}, "schedule.decay_fraction", ["(0, 1]"]),
        (
            {"decay": "wsd", "decay_fraction": 0.001},
            "schedule.decay_fraction",
            ["0.001 of the 100 steps of the schedule is 0 steps"],
        ),
        (
            {"decay": "wsd", "decay_steps": 95, "warmup_steps": 10},
            "schedule.decay_steps",
            ["95 steps overlaps the warmup", "leave 90"],
        ),
        ({"decay": "linear", "decay_steps": 5}, "schedule.decay_steps", ["only applies to"]),
        ({"decay": "cosine", "decay_fraction": 0.1}, "schedule.decay_fraction", ["wsd"]),
        ({"decay_shape": "sqrt"}, "schedule.decay_shape", ["only applies to decay: wsd"]),
        (
            {"decay": "wsd", "decay_steps": 5, "decay_shape": "exp"},
            "schedule.decay_shape",
            ["'linear', 'cosine', 'sqrt'"],
        ),
        ({"decay": "wsdx"}, "schedule.decay", ["'wsd'"]),
    ],
)
def test_bad_wsd_settings_are_one_error_naming_the_key(section, key, fragments):
    _schedule_error(section, key, *fragments)


# ----------------------------------------------------------------------------------------
# recipe inheritance
def _write(path, data) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return str(path)


def test_a_child_merges_over_its_base(tmp_path):
    base = {
        "model": {"preset": "tiny", "attention": "diff_v1", "n_layers": 4},
        "data": {"sources": ["stdlib", "a.jsonl"], "tokenizer": "bpe:512"},
        "optim": {"lr": 1e-3, "betas": [0.9, 0.98]},
        "schedule": {"warmup_steps": 5, "total_steps": 50},
        "steps": 20,
    }
    _write(tmp_path / "base.yaml", base)
    child = {
        "base": "base.yaml",
        "model": {"n_layers": 2},  # a nested key replaces, its siblings stay
        "data": {"sources": ["b.jsonl"]},  # a list replaces the whole list
        "schedule": {"total_steps": None},  # null replaces too
        "steps": 30,
    }
    merged = read_recipe(_write(tmp_path / "child.yaml", child))
    assert merged == {
        "model": {"preset": "tiny", "attention": "diff_v1", "n_layers": 2},
        "data": {"sources": ["b.jsonl"], "tokenizer": "bpe:512"},
        "optim": {"lr": 1e-3, "betas": [0.9, 0.98]},
        "schedule": {"warmup_steps": 5, "total_steps": None},
        "steps": 30,
    }


def test_a_section_left_empty_keeps_the_base_section(tmp_path):
    base = {
        "model": {"preset": "tiny", "attention": "diff_v1", "n_layers": 3},
        "data": {"sources": ["stdlib"], "tokenizer": "bpe:512"},
        "optim": {"lr": 1e-3, "betas": [0.9, 0.98]},
        "schedule": {"warmup_steps": 5, "total_steps": 50},
        "steps": 20,
    }
    _write(tmp_path / "base.yaml", base)
    child = tmp_path / "child.yaml"
    child.write_text(
        "base: base.yaml\n"
        "model:\n  # attention: diff_v2\n  # n_layers: 2\n"
        "data:\n  # sources: [other.jsonl]\n"
        "optim:\n"
        "schedule: {}\n"
        "steps: 30\n",
        encoding="utf-8",
    )
    assert read_recipe(child) == {**base, "steps": 30}
    config = load_config(child)
    assert config.model.attention == "diff_v1" and config.model_config().n_layers == 3
    assert config.optim.betas == (0.9, 0.98) and config.schedule.total_steps == 50
    assert config.data["tokenizer"] == "bpe:512"


def test_empty_sections_alone_are_the_defaults(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model:\ndata:\noptim:\nschedule:\n", encoding="utf-8")
    assert load_config(path).to_dict() == TrainConfig().to_dict()


def test_set_merges_into_a_section_and_refuses_to_empty_one(tmp_path):
    base = {"model": {"preset": "tiny", "attention": "diff_v1"}, "steps": 5}
    path = _write(tmp_path / "r.yaml", base)
    config = load_config(path, ["model={n_layers: 3}"])
    assert config.model.attention == "diff_v1" and config.model_config().n_layers == 3
    for value in ("null", "{}"):
        _load_error(path, "model", "would change nothing", overrides=[f"model={value}"])


def test_bases_chain_and_resolve_from_each_recipe_directory(tmp_path, monkeypatch):
    _write(tmp_path / "shared" / "root.yaml", {"steps": 10, "seed": 1, "seq_len": 64})
    _write(tmp_path / "shared" / "mid.yaml", {"base": "root.yaml", "seed": 2})
    leaf = _write(tmp_path / "runs" / "leaf.yaml", {"base": "../shared/mid.yaml", "steps": 12})
    monkeypatch.chdir(tmp_path / "shared" / "..")  # the working directory plays no part
    config = load_config(leaf, ["seed=3"])  # --set applies after the merge
    assert (config.steps, config.seed, config.seq_len) == (12, 3, 64)
    absolute = _write(tmp_path / "abs.yaml", {"base": str(tmp_path / "shared" / "mid.yaml")})
    assert load_config(absolute).seed == 2


def test_the_dumped_config_is_the_merged_recipe_without_base(tmp_path):
    _write(tmp_path / "base.yaml", {"optim": {"lr": 1e-3, "weight_decay": 0.05}, "steps": 5})
    child = _write(tmp_path / "c.yaml", {"base": "base.yaml", "optim": {"lr": 2e-3}})
    dumped = yaml.safe_load(dump_config(load_config(child)))
    assert "base" not in dumped
    assert (dumped["optim"]["lr"], dumped["optim"]["weight_decay"], dumped["steps"]) == (
        2e-3,
        0.05,
        5,
    )


def _load_error(path, key: str, *fragments: str, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert info.value.key == key and message.startswith(f"{key}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_cycle_of_bases_is_one_error_listing_the_chain(tmp_path):
    a = _write(tmp_path / "a.yaml", {"base": "b.yaml"})
    _write(tmp_path / "b.yaml", {"base": "c.yaml"})
    _write(tmp_path / "c.yaml", {"base": "a.yaml"})
    chain = " -> ".join(str(tmp_path / f"{n}.yaml") for n in "abca")
    _load_error(a, "base", f"the recipes' bases form a cycle: {chain}")
    itself = _write(tmp_path / "self.yaml", {"base": "./self.yaml"})
    _load_error(itself, "base", f"cycle: {itself} -> {itself}")


def test_a_missing_base_names_the_file_and_the_recipe_that_asked(tmp_path):
    _write(tmp_path / "mid.yaml", {"base": "gone.yaml"})
    child = _write(tmp_path / "child.yaml", {"base": "mid.yaml"})
    _load_error(
        child,
        "base",
        f"{tmp_path / 'mid.yaml'} names base: gone.yaml, but {tmp_path / 'gone.yaml'} does not",
    )


@pytest.mark.parametrize("value", [["a.yaml", "b.yaml"], 3, "", None, {"path": "a.yaml"}])
def test_a_base_that_is_not_a_file_name_is_an_error(tmp_path, value):
    path = _write(tmp_path / "r.yaml", {"base": value})
    _load_error(path, "base", "expected the file name of a recipe", repr(value))


def test_errors_in_a_base_file_name_that_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("steps: [1,\n", encoding="utf-8")
    child = _write(tmp_path / "c.yaml", {"base": "bad.yaml"})
    _load_error(child, "config", f"{tmp_path / 'bad.yaml'}: not valid YAML")
    (tmp_path / "list.yaml").write_text("- 1\n", encoding="utf-8")
    other = _write(tmp_path / "d.yaml", {"base": "list.yaml"})
    _load_error(other, "config", "list.yaml: expected a mapping at the top level")
    merged_error = _write(tmp_path / "e.yaml", {"base": "c2.yaml"})
    _write(tmp_path / "c2.yaml", {"stepz": 3})  # a key error from the base still names the key
    _load_error(merged_error, "stepz", "unknown key")


def test_set_cannot_change_the_base(tmp_path):
    path = _write(tmp_path / "r.yaml", {"steps": 3})
    _load_error(path, "base", "--set cannot change it", overrides=["base=other.yaml"])


# the recipes configs/paper-*.yaml before they were rewritten on paper-base.yaml (comments left
# out): each must still resolve to the same TrainConfig
_SCALING = """\
model: {{preset: {preset}, attention: diff_v1}}
data: {{sources: [data/corpus], tokenizer: 'tiktoken:cl100k_base', valid_fraction: 0.001,
  max_bytes: null}}
optim: {{lr: {lr}, betas: [0.9, 0.98], eps: 1.0e-08, weight_decay: 0.05, clip: 1.0}}
schedule: {{warmup_steps: 375, decay: linear, min_lr: 0.0}}
steps: 40000
global_batch_size: 128
micro_batch_size: {micro}
seq_len: 2048
seed: 0
device: cuda
dtype: bf16
parallel: fsdp
activation_checkpointing: {ac}
compile: false
log_every: 10
eval_every: 1000
eval_batches: 50
checkpoint_every: 2000
keep_last: 3
tensorboard: false
"""
OLD_PAPER_RECIPES = {
    "830m": _SCALING.format(preset="830M", lr=0.00015, micro=8, ac="false"),
    "1.4b": _SCALING.format(preset="1.4B", lr=0.00015, micro=8, ac="false"),
    "2.8b": _SCALING.format(preset="2.8B", lr=0.00015, micro=4, ac="true"),
    "6.8b": _SCALING.format(preset="6.8B", lr=7.5e-05, micro=4, ac="true"),
    "13.1b": _SCALING.format(preset="13.1B", lr=7.5e-05, micro=2, ac="true"),
    "3b": """\
model: {preset: 3B, attention: diff_v1}
data: {sources: [data/corpus], tokenizer: 'tiktoken:cl100k_base', valid_fraction: 0.001,
  max_bytes: null}
optim: {lr: 0.00032, betas: [0.9, 0.95], eps: 1.0e-08, weight_decay: 0.1, clip: 1.0}
schedule: {warmup_steps: 1000, decay: linear, min_lr: 1.28e-05}
steps: 250000
global_batch_size: 1024
micro_batch_size: 4
seq_len: 4096
seed: 0
device: cuda
dtype: bf16
parallel: fsdp
activation_checkpointing: true
compile: false
log_every: 10
eval_every: 1000
eval_batches: 50
checkpoint_every: 1000
keep_last: 3
tensorboard: false
""",
}


@pytest.mark.parametrize("size", sorted(OLD_PAPER_RECIPES))
def test_paper_recipes_resolve_as_before_their_rewrite(size):
    path = CONFIGS / f"paper-{size}.yaml"
    assert yaml.safe_load(path.read_text(encoding="utf-8"))["base"] == "paper-base.yaml"
    before = TrainConfig.from_dict(yaml.safe_load(OLD_PAPER_RECIPES[size])).to_dict()
    assert load_config(path).to_dict() == before


def test_the_paper_base_alone_is_the_830m_recipe():
    assert load_config(CONFIGS / "paper-base.yaml") == load_config(CONFIGS / "paper-830m.yaml")


# ----------------------------------------------------------------------------------------
# through `diffattn train`
def test_muon_resume_repeats_the_uninterrupted_losses(tmp_path, data_cache):
    """``--set optim.name=muon``: 8 steps vs 4 then ``--resume`` to 8, loss for loss."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_recipe(data_cache))
    muon = ["--set", "optim.name=muon", "--set", "optim.muon_lr_scale=5"]
    a, b = tmp_path / "A", tmp_path / "B"
    assert train_cli(str(recipe), "--steps", "8", "--out", str(a), *muon) == 0
    assert train_cli(str(recipe), "--steps", "4", "--out", str(b), *muon) == 0
    assert train_cli(str(recipe), "--steps", "8", "--out", str(b), "--resume", *muon) == 0
    full, resumed = read_losses(a), read_losses(b)
    assert sorted(resumed) == list(range(1, 9))
    assert max(abs(full[s] - resumed[s]) for s in range(5, 9)) <= 1e-6
    assert yaml.safe_load((a / "config.yaml").read_text())["optim"]["name"] == "muon"
    from diffattn.train.checkpoint import load_trainer_state

    state = load_trainer_state(a / "checkpoints" / "step-00000008")["optimizer"]["state"]
    assert "momentum_buffer" in state["layers.0.attn.q_proj.weight"]
    assert "exp_avg" in state["embed_tokens.weight"]


def test_wsd_and_base_through_the_cli(tmp_path, data_cache, capsys):
    recipe = tiny_recipe(data_cache, steps=6, schedule={"warmup_steps": 1, "total_steps": 6})
    (tmp_path / "recipes").mkdir()
    write_recipe(tmp_path / "recipes" / "tiny.yaml", recipe)
    child = _write(
        tmp_path / "recipes" / "wsd.yaml",
        {"base": "tiny.yaml", "optim": {"name": "sgd", "kwargs": {"momentum": 0.9}}},
    )
    out = tmp_path / "run"
    sets = ["--set", "schedule.decay=wsd", "--set", "schedule.decay_steps=2"]
    assert train_cli(child, "--out", str(out), "--set", "schedule.min_lr=3e-4", *sets) == 0
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    lrs = [yaml.safe_load(line)["lr"] for line in lines]
    assert lrs == pytest.approx([3e-3, 3e-3, 3e-3, 3e-3, 3e-4 + 2.7e-3 / 2, 3e-4])
    written = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
    assert "base" not in written and written["optim"]["name"] == "sgd"
    assert written["schedule"]["decay"] == "wsd" and written["model"]["d_model"] == 32
    assert len(read_losses(out)) == 6
    # a bad setting is exit code 2 with the one error, nothing trained
    bad = ["--set", "schedule.decay=wsd"]
    assert train_cli(child, "--out", str(tmp_path / "bad"), *bad) == 2
    assert "error: schedule.decay_steps: decay: wsd needs" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
