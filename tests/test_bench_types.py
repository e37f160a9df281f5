"""``diffattn bench``, ``diffattn backends`` and ``diffattn presets`` ask the attention types'
declarations: a type registered here is timed when ``--models`` names it, on the backend
``auto`` resolves for the entry point it calls; a mixed stack is not a bench row (one error
saying so); the parameter report names each type's heads."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from diffattn import ModelConfig
from diffattn.attention.baseline import Baseline
from diffattn.attention.registry import ENTRY_DIFF, ENTRY_DIFF_V2, ENTRY_SOFTMAX
from diffattn.attention.types import register_attention_type, unregister_attention_type
from diffattn.bench import backends
from diffattn.bench.report import describe_layers
from diffattn.bench.throughput import add_arguments, build_configs, default_types, run

TOY = "toy_softmax"
TINY = ["--seq-len", "16", "--d-model", "128", "--layers", "1", "--vocab", "64"]
TINY += ["--steps", "1", "--warmup", "0", "--no-hf", "--json"]


class ToySoftmax(Baseline):
    name = TOY
    title = "Toy softmax"


@pytest.fixture
def toy():
    declaration = register_attention_type(ToySoftmax())
    yield declaration
    unregister_attention_type(TOY)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_default_rows_are_the_declared_ones(toy):
    # the papers' three say so; a subclass does not inherit it (AttentionType.NOT_INHERITED)
    assert default_types() == ("baseline", "diff_v1", "diff_v2")
    assert list(build_configs(_args(TINY))) == ["baseline", "diff_v1", "diff_v2"]
    configs = build_configs(_args([*TINY, "--models", f"baseline,{TOY}"]))
    assert list(configs) == ["baseline", "diff_v1", "diff_v2", TOY]
    assert configs[TOY] == configs["baseline"].replace(attention=TOY)


def test_a_registered_type_is_timed_when_models_names_it(toy, capsys, one_thread):
    argv = [*TINY, "--mode", "fwd", "--models", f"baseline,{TOY}"]
    assert run(_args(argv)) == 0
    records = json.loads(capsys.readouterr().out)
    rows = {r["attention"]: r for r in records}
    assert set(rows) == {"baseline", TOY}
    assert rows[TOY]["kernel"] == "sdpa" and rows[TOY]["params"] == rows["baseline"]["params"]
    assert rows[TOY]["ratio_reference"] == "baseline"


def test_the_report_names_each_rows_attention(toy, capsys, one_thread):
    argv = [a for a in TINY if a != "--json"] + ["--mode", "fwd", "--models", f"baseline,{TOY}"]
    assert run(_args(argv)) == 0
    out = capsys.readouterr().out
    assert f"attention of {TOY}: layer 0: Toy softmax: 2 query heads, 2 KV heads of width 64" in out


def test_an_ablation_is_a_row_with_its_options_and_one_name_however_spelled(capsys, one_thread):
    shape = ["--d-model", "512", "--kv-heads", "2"]
    argv = [*TINY, *shape, "--mode", "fwd", "--models", "baseline, gda:ratio=1 ,diff_v1,gda"]
    configs = build_configs(_args(argv))
    assert list(configs) == ["baseline", "diff_v1", "diff_v2", "gda:ratio=1", "gda"]
    assert configs["gda:ratio=1"].attention_options == {"gda": {"ratio": 1}}
    assert configs["gda"].attention_options in ({}, None)
    assert run(_args(argv)) == 0
    rows = {r["attention"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"baseline", "diff_v1", "gda:ratio=1", "gda"}
    # a 1:1 GDA is DIFF V1's layer (docs/attention_types.md): same parameters, same kernel
    assert rows["gda:ratio=1"]["params"] == rows["diff_v1"]["params"]
    assert rows["gda:ratio=1"]["kernel"] == rows["diff_v1"]["kernel"]
    assert run(_args([*TINY, *shape, "--models", "baseline,gda:ratio=0"])) == 2
    assert "--models: choose among" in capsys.readouterr().err


def test_a_mixed_stack_is_not_a_bench_row(capsys):
    assert run(_args([*TINY, "--models", "baseline,diff_v1*2"])) == 2
    err = capsys.readouterr().err
    assert "--models" in err and "a stack of mixed types" in err and "is not a row" in err


def test_describe_layers_names_each_run_of_one_type():
    config = ModelConfig(
        vocab_size=64, d_model=64, n_layers=4, n_heads=4, layer_types="diff_v1*2,baseline,diff_v2"
    )
    assert describe_layers(config) == [
        "layers 0-1: DIFF V1: 2 differential heads (Q1, Q2 of width 16), 2 KV groups with V of "
        "width 32",
        "layer 2: Transformer: 4 query heads, 4 KV heads of width 16",
        "layer 3: DIFF V2: 8 query heads of width 16 in 4 pairs, 4 KV heads",
    ]


def test_backends_table_has_the_entry_points_a_type_can_call(toy):
    assert backends.own_kernels(ENTRY_SOFTMAX) == ("sdpa", "flash", "reference")
    assert backends.own_kernels(ENTRY_DIFF) == ("sdpa", "fused", "triton", "flash", "reference")
    assert backends.own_kernels(ENTRY_DIFF_V2) == ("sdpa", "flash", "reference")
    assert backends.auto_choice(toy.entry, "train", "cpu", torch.float32) == "sdpa"


def test_presets_lists_every_registered_type(toy, capsys):
    from diffattn.cli import main

    assert main(["presets", "tiny"]) == 0
    out = capsys.readouterr().out
    assert f"   tiny {TOY:<12}       2,523,776" in out  # the baseline's count
    assert f"{TOY}: Toy softmax: 8 query heads, 8 KV heads of width 16" in out
    assert "diff_v1: DIFF V1: 4 differential heads" in out
