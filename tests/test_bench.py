"""``diffattn bench``: JSON records on a tiny size, bad input, the FLOP bound, peak tracking.

Performance is measured by the benchmark, never asserted here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch
from torch import nn

from diffattn import ModelConfig, count_parameters, presets
from diffattn.bench import flops
from diffattn.bench.throughput import (
    LiveTensorBytes,
    add_arguments,
    build_configs,
    matched_v2,
    run,
)

TINY = [
    "--seq-len",
    "16",
    "--d-model",
    "128",
    "--layers",
    "1",
    "--vocab",
    "64",
    "--steps",
    "1",
    "--warmup",
    "0",
]
HAS_HF = importlib.util.find_spec("transformers") is not None
KEYS = {
    "attention",
    "mode",
    "seq_len",
    "tokens_per_s",
    "peak_mem_bytes",
    "params",
    "ratio_to_baseline",
    "d_model",
    "layers",
    "batch",
    "device",
    "dtype",
    "backend",
}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny ops run fastest on one thread (and do not fight other processes for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    """One tiny run with HF rows (when transformers is importable), parsed from stdout."""
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert run(_args([*TINY, "--json"])) == 0
    return json.loads(stdout.getvalue())


def test_json_records_cover_every_model_and_mode(records):
    expected = {"baseline", "diff_v1", "diff_v2"} | (
        {"hf_diffllama", "hf_llama"} if HAS_HF else set()
    )
    seen = {(r["attention"], r["mode"]) for r in records}
    assert seen == {(a, m) for a in expected for m in ("fwd", "fwd+bwd")}
    assert len(records) == len(seen)
    for r in records:
        assert KEYS.issubset(r)
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 and r["params"] > 0
        assert r["ratio_to_baseline"] > 0
        assert (r["seq_len"], r["d_model"], r["layers"], r["batch"]) == (16, 128, 1, 1)
        assert (r["device"], r["dtype"], r["backend"]) == ("cpu", "fp32", "auto")


def test_reference_rows_have_ratio_one(records):
    for r in records:
        if r["attention"] in ("baseline", "hf_llama"):
            assert r["ratio_to_baseline"] == pytest.approx(1.0)


def test_parameter_counts_are_matched(records):
    params = {r["attention"]: r["params"] for r in records}
    # DIFF V1 adds the four λ vectors (4d) and the head-norm weight (2d) per layer.
    assert params["diff_v1"] - params["baseline"] == 6 * 64
    assert abs(params["diff_v2"] - params["baseline"]) <= 1.5 * 128
    if HAS_HF:
        assert params["hf_llama"] == params["baseline"]
        assert params["hf_diffllama"] == params["diff_v1"] - 2 * 64  # no head-norm weight


def test_json_mode_prints_only_json(capsys):
    assert run(_args([*TINY, "--json", "--no-hf"])) == 0
    out = capsys.readouterr().out
    assert {r["attention"] for r in json.loads(out)} == {"baseline", "diff_v1", "diff_v2"}


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--seq-len", "0"], "--seq-len"),
        (["--d-model", "100"], "--d-model"),
        (["--d-model", "192"], "--d-model"),
        (["--layers", "0"], "--layers"),
        (["--batch", "0"], "--batch"),
        (["--steps", "0"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
    ],
)
def test_bad_input_exits_2_naming_the_option(argv, option, capsys):
    assert run(_args([*TINY, *argv])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert option in captured.err and "error" in captured.err


def test_v2_is_narrowed_like_presets():
    configs = build_configs(_args(["--d-model", "512", "--layers", "4"]))
    base, v2 = configs["baseline"], configs["diff_v2"]
    assert v2.attention == "diff_v2" and v2.ffn_dim < base.ffn_dim
    per_unit = 3 * base.d_model * base.n_layers
    assert abs(count_parameters(v2) - count_parameters(base)) <= per_unit / 2
    assert v2.ffn_dim == base.ffn_dim - round(presets.v2_extra_parameters(v2) / per_unit)
    assert matched_v2(base).replace(attention="baseline", ffn_hidden=None) == base


def _paper_configs(d_ff: int) -> tuple[ModelConfig, ModelConfig]:
    kw = dict(
        vocab_size=8192, d_model=512, n_layers=4, n_heads=8, max_seq_len=2048, ffn_hidden=d_ff
    )
    return ModelConfig(**kw), ModelConfig(**kw, attention="diff_v1")


def test_flop_bound_v1_over_baseline():
    base, v1 = _paper_configs(1365)
    assert flops.throughput_bound(v1, base, 2048, "qk_once") == pytest.approx(0.91, abs=0.01)
    assert flops.throughput_bound(v1, base, 2048, "two_call") == pytest.approx(0.83, abs=0.01)


def test_flop_counts_match_the_design_formula():
    base, v1 = _paper_configs(1365)
    d, n, d_ff = 512, 2048, 1365
    linear = 2 * (4 * d * d + 3 * d * d_ff)
    head = 2 * d * 8192
    assert flops.flops_per_token(base, n).forward == 4 * (linear + 2 * n * d) + head
    assert flops.flops_per_token(v1, n).forward == 4 * (linear + 3 * n * d) + head
    assert flops.flops_per_token(v1, n, "two_call").forward == 4 * (linear + 4 * n * d) + head
    count = flops.flops_per_token(base, n)
    assert count.training == pytest.approx(3 * count.forward)


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_linear_flops_follow_the_module_shapes(attention):
    from diffattn import DiffTransformerLM

    config = ModelConfig(
        vocab_size=64,
        d_model=256,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        attention=attention,
    )
    with torch.device("meta"):
        model = DiffTransformerLM(config)
    weights = sum(m.weight.numel() for m in model.layers[0].modules() if isinstance(m, nn.Linear))
    assert flops.linear_flops_per_layer(config) == 2 * weights


def test_live_tensor_bytes_tracks_allocations_and_frees():
    x = torch.ones(1000)
    with LiveTensorBytes() as tracker:
        y = x.exp()
        z = y * 2
        del y
        w = z.view(10, 100) + 1
        del z, w
    assert tracker.peak == 2 * 4000
    assert tracker.live == 0
