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

from diffattn import ModelConfig, count_parameters, flops, presets
from diffattn.bench.throughput import (
    RECORD_FIELDS,
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
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
OURS = {"baseline", "diff_v1", "diff_v2"}
HF_ROWS = {"hf_diffllama", "hf_llama"} if HAS_HF else set()
DEX_ROWS = {"dex_unmerged", "dex_merged"} if HAS_HF else set()
MODES = ("fwd", "fwd+bwd", "decode")


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
    argv = [*TINY, "--json", "--new-tokens", "3", "--kv-heads", "2"]
    with contextlib.redirect_stdout(stdout):
        assert run(_args(argv + (["--dex"] if HAS_HF else []))) == 0
    return json.loads(stdout.getvalue())


def test_json_records_cover_every_model_and_mode(records):
    expected = OURS | HF_ROWS | DEX_ROWS
    seen = {(r["attention"], r["mode"]) for r in records}
    assert seen == {(a, m) for a in expected for m in MODES}
    assert len(records) == len(seen)
    for r in records:
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 and r["params"] > 0
        assert r["ratio_to_baseline"] > 0
        assert (r["seq_len"], r["d_model"], r["layers"], r["batch"]) == (16, 128, 1, 1)
        assert (r["device"], r["dtype"], r["backend"]) == ("cpu", "fp32", "auto")


def test_json_records_follow_the_schema(records):
    rows = {(r["attention"], r["mode"]): r for r in records}
    for r in records:
        assert set(r) == set(RECORD_FIELDS)
        for key, kind in RECORD_FIELDS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert (r["n_heads"], r["n_kv_heads"]) == (2, 2)
        assert r["mfu"] is None and r["peak_tflops"] is None  # no peak known for a CPU
        assert r["flops_per_token"] > 0
        if r["attention"] == "diff_v2":
            # Its SwiGLU is the multiple of 64 nearest the parameter match (320, 20.67 units
            # below it), so at N = 16 it can compute fewer FLOPs than the baseline: bound > 1.
            base = rows["baseline", r["mode"]]
            expected = base["flops_per_token"] / r["flops_per_token"]
            assert r["flop_bound"] == pytest.approx(expected)
        else:
            assert 0 < r["flop_bound"] <= 1.0 + 1e-9
        assert len(r["seconds"]) == 1 and r["threads"] == 1
        decode = r["mode"] == "decode"
        assert (r["prompt_len"], r["new_tokens"]) == ((16, 3) if decode else (None, None))
        assert r["cache"] == (None if not decode else "static")  # HF rows: HF's StaticCache
        assert r["mem_seq_len"] == 16


def test_dex_rows_take_their_ratio_against_hf_llama(records):
    if not HAS_HF:
        pytest.skip("transformers is not installed")
    rows = {(r["attention"], r["mode"]): r for r in records}
    for mode in MODES:
        merged, unmerged = rows["dex_merged", mode], rows["dex_unmerged", mode]
        base = rows["hf_llama", mode]
        assert merged["ratio_reference"] == unmerged["ratio_reference"] == "hf_llama"
        assert merged["params"] == base["params"]  # folded into W_O: a plain Llama again
        # one head of width 64 adapted in the single layer: W_D (64×64) plus λ_learn
        assert unmerged["params"] == base["params"] + 64 * 64 + 1
        assert merged["flops_per_token"] == base["flops_per_token"]
        assert unmerged["flops_per_token"] > base["flops_per_token"]


def test_reference_rows_have_ratio_one(records):
    for r in records:
        if r["attention"] in ("baseline", "hf_llama"):
            assert r["ratio_to_baseline"] == pytest.approx(1.0)
            assert r["best_ratio_to_baseline"] == pytest.approx(1.0)
            assert r["paired_ratio_to_baseline"] == pytest.approx(1.0)


def test_parameter_counts_are_matched(records):
    params = {r["attention"]: r["params"] for r in records}
    # DIFF V1 adds the four λ vectors (4d) and the head-norm weight (2d) per layer.
    assert params["diff_v1"] - params["baseline"] == 6 * 64
    # DIFF V2 (2 heads of 64, one layer) adds 128·2·64 + 128·2 = 16,640 and its SwiGLU gives
    # back (384 − 320)·3·128 = 24,576: 340.67 units would match, 320 is the nearest multiple
    # of 64.
    assert params["diff_v2"] - params["baseline"] == 16_640 - 24_576
    if HAS_HF:
        assert params["hf_llama"] == params["baseline"]
        assert params["hf_diffllama"] == params["diff_v1"] - 2 * 64  # no head-norm weight


def test_json_mode_prints_only_json(capsys):
    assert run(_args([*TINY, "--json", "--no-hf", "--mode", "fwd"])) == 0
    out = capsys.readouterr().out
    assert {r["attention"] for r in json.loads(out)} == {"baseline", "diff_v1", "diff_v2"}


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--seq-len", "0"], "--seq-len"),
        (["--d-model", "100"], "--d-model"),
        (["--d-model", "192"], "--d-model"),
        (["--head-dim", "3"], "--head-dim"),
        (["--head-dim", "128"], "--d-model"),
        (["--layers", "0"], "--layers"),
        (["--batch", "0"], "--batch"),
        (["--steps", "0"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
        (["--new-tokens", "0"], "--new-tokens"),
        (["--prompt-len", "0"], "--prompt-len"),
        (["--mem-seq-len", "1"], "--mem-seq-len"),
        (["--kv-heads", "3"], "--kv-heads"),
        (["--kv-heads", "1"], "--kv-heads"),
        (["--sweep", "1,16"], "--sweep"),
        (["--peak-tflops", "0"], "--peak-tflops"),
        (["--plot", "/no/such/folder/x.png"], "--plot"),
        (["--plot", "throughput.svg"], "--plot"),
        (["--backend", "nonesuch"], "--backend"),
        (["--backend", "flash"], "--backend"),
        (["--dex", "--no-hf"], "--dex"),
        (["--models", "diff_v1"], "--models"),
        (["--models", "baseline,gpt2"], "--models"),
        (["--models", "baseline,hf_llama", "--no-hf"], "--models"),
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
    # 1408 − 4·(512·8·64 + 512·8) / (3·512·4) = 1408 − 520/3 = 1234.67 -> 1216 (18.67 below;
    # 1280 is 45.33 above), a multiple of 64 like every GEMM dimension of the bench's models
    per_unit = 3 * base.d_model * base.n_layers
    assert base.ffn_dim == 1408 and v2.ffn_dim == 1216
    exact = base.ffn_dim - presets.v2_extra_parameters(v2) / per_unit
    assert count_parameters(v2) - count_parameters(base) == round((1216 - exact) * per_unit)
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
    assert flops.throughput_bound(v1, base, 2048, "v_once") == 1.0
    assert flops.v1_form_for_kernel("fused") == "v_once"


def test_flop_counts_match_the_design_formula():
    base, v1 = _paper_configs(1365)
    d, n, d_ff = 512, 2048, 1365
    linear = 2 * (4 * d * d + 3 * d * d_ff)
    head = 2 * d * 8192
    assert flops.flops_per_token(base, n).forward == 4 * (linear + 2 * n * d) + head
    assert flops.flops_per_token(v1, n).forward == 4 * (linear + 3 * n * d) + head
    assert flops.flops_per_token(v1, n, "two_call").forward == 4 * (linear + 4 * n * d) + head
    assert flops.flops_per_token(v1, n, "v_once").forward == 4 * (linear + 2 * n * d) + head
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


def _run_json(argv: list[str], capsys) -> list[dict]:
    assert run(_args([*TINY, "--json", "--no-hf", *argv])) == 0
    return json.loads(capsys.readouterr().out)


def test_mode_selects_what_is_timed(capsys):
    records = _run_json(["--mode", "decode", "--new-tokens", "2", "--prompt-len", "5"], capsys)
    assert {r["mode"] for r in records} == {"decode"}
    assert all((r["seq_len"], r["prompt_len"], r["new_tokens"]) == (5, 5, 2) for r in records)
    records = _run_json(["--mode", "fwd+bwd", "--mem-seq-len", "24"], capsys)
    assert {r["mode"] for r in records} == {"fwd+bwd"}
    assert all(r["mem_seq_len"] == 24 and r["seq_len"] == 16 for r in records)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compile_times_compiled_blocks_in_fwd_bwd(backend, capsys, monkeypatch):
    """``--compile``: every model of ours has its blocks compiled (as the trainer does), the
    warmup covers the compilations, and the table prints each model's ratio. Fast through
    Dynamo alone (backend ``eager``); slow through the generated code the bench runs."""
    from diffattn.model import DiffTransformerLM

    compiled = []
    original = DiffTransformerLM.compile_blocks

    def compile_blocks(self, **options):
        compiled.append(self.config.attention)
        return original(self, **{**options, "backend": backend})

    monkeypatch.setattr(DiffTransformerLM, "compile_blocks", compile_blocks)
    argv = [*TINY, "--no-hf", "--mode", "fwd+bwd", "--compile", "--head-dim", "32"]
    assert run(_args(argv)) == 0
    out = capsys.readouterr().out
    assert sorted(compiled) == sorted(OURS)
    assert "heads 4x32" in out and "after 2 warmup" in out
    assert "N=16; ours: compiled blocks ==" in out
    rows = [
        line.split() for line in out.splitlines() if line.split()[:1] in (["diff_v1"], ["diff_v2"])
    ]
    assert len(rows) == 2 and all(float(row[5]) > 0 for row in rows)  # the 'x ref' ratios


def test_the_mode_option_refuses_other_values(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _args(["--mode", "train"])
    assert exit_info.value.code == 2 and "--mode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args(["--sweep", "512,long"])


def test_mfu_from_a_given_peak(capsys):
    records = _run_json(["--mode", "fwd", "--peak-tflops", "2.5"], capsys)
    for r in records:
        assert r["peak_tflops"] == 2.5
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 2.5e12)
    rows = {r["attention"]: r for r in records}
    base = build_configs(_args(TINY))["baseline"]
    assert rows["baseline"]["flops_per_token"] == flops.flops_per_token(base, 16).forward


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_sweep_writes_one_record_per_length_and_a_png(tmp_path, capsys):
    png = tmp_path / "throughput.png"
    argv = ["--sweep", "8,16", "--plot", str(png), "--mode", "decode"]
    records = _run_json([*argv, "--new-tokens", "2"], capsys)
    assert {(r["attention"], r["seq_len"]) for r in records} == {
        (a, n) for a in OURS for n in (8, 16)
    }
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_alone_sweeps_the_device_default():
    from diffattn.bench.throughput import DEFAULT_SWEEP, lengths_of

    assert lengths_of(_args([*TINY, "--plot", "x.png"])) == list(DEFAULT_SWEEP["cpu"])
    assert lengths_of(_args([*TINY, "--sweep", "64 32,32"])) == [32, 64]
    assert lengths_of(_args(TINY)) == [16]
    assert max(DEFAULT_SWEEP["cuda"]) == 8192 and min(DEFAULT_SWEEP["cuda"]) == 512


def test_decode_flops_average_the_keys_each_step_reads():
    base, v1 = _paper_configs(1365)
    d = 512
    linear = 2 * (4 * d * d + 3 * d * 1365)
    head = 2 * d * 8192
    # steps read 1025, 1026, 1027 keys: mean 1026; QKᵀ and AV cost 2·d per key and head
    assert flops.decode_flops_per_token(base, 1024, 3) == 4 * (linear + 4 * d * 1026) + head
    assert flops.decode_flops_per_token(v1, 1024, 3) == 4 * (linear + 6 * d * 1026) + head
    with pytest.raises(ValueError, match="new_tokens"):
        flops.decode_flops_per_token(base, 1024, 0)


def test_peak_table_and_override():
    from diffattn.hardware import mfu, peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.0)
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5)
    assert peak_tflops("cpu", "fp32") is None
    assert peak_tflops("cpu", "fp32", override=1.5) == 1.5
    assert mfu(1e9, 1e3, None) is None and mfu(1e9, 1e3, 1.0) == pytest.approx(1.0)


def test_models_selects_rows(capsys):
    records = _run_json(["--mode", "fwd", "--models", "baseline,diff_v2"], capsys)
    assert {r["attention"] for r in records} == {"baseline", "diff_v2"}


def test_cross_ratios_compare_ours_with_the_hf_rows(records):
    from diffattn.bench.throughput import cross_ratios

    lines = cross_ratios(records)
    if not HAS_HF:
        assert lines == []
        return
    assert len(lines) == len(MODES)
    rows = {(r["attention"], r["mode"]): r for r in records}
    ratio = rows["baseline", "fwd"]["tokens_per_s"] / rows["hf_llama", "fwd"]["tokens_per_s"]
    assert f"baseline / hf_llama {ratio:.3f}" in next(line for line in lines if " fwd N" in line)


def test_paired_ratio_cancels_a_drift_of_load():
    """Both models slow down alike over the run: the paired ratio sees the constant 2×."""
    from diffattn.bench.throughput import paired_ratio

    ref = [1.0, 2.0, 4.0, 8.0, 16.0]
    slow = [2 * t for t in ref]
    assert paired_ratio(slow, ref) == pytest.approx(0.5)
    assert paired_ratio(ref, ref) == 1.0


def test_default_run_reports_what_auto_runs_in_each_mode(records):
    """No --backend: every row of ours says the kernel its calls resolved to in that mode,
    and the FLOP bound follows it (DIFF V1 on the compiled kernel does the baseline's
    attention FLOPs)."""
    from diffattn.attention import cpu_kernel

    expected_v1 = "fused" if cpu_kernel.unavailable() is None else "sdpa"
    for r in records:
        if r["attention"] not in OURS:
            continue
        assert r["backend"] == "auto"
        assert r["kernel"] == (expected_v1 if r["attention"] == "diff_v1" else "sdpa"), r
        if r["attention"] == "diff_v1" and expected_v1 == "fused":
            assert r["flop_bound"] == pytest.approx(1.0, abs=1e-3)
