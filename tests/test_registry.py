"""The kernel registry and the run-time backend choice."""

from __future__ import annotations

import logging

import pytest
import torch

from diffattn import DiffTransformerLM, ModelConfig, presets
from diffattn.attention import registry
from diffattn.attention.backends.reference import reference_attention


def _tiny(attention: str, **changes) -> DiffTransformerLM:
    torch.manual_seed(0)
    config = presets.get(
        "tiny",
        attention=attention,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=61,
        **changes,
    )
    return DiffTransformerLM(config).eval()


@pytest.fixture
def plain_backend():
    """A third-party backend with a softmax entry point only."""
    calls = []

    def softmax(q, k, v, mask, scale):
        calls.append(q.shape)
        return reference_attention(q, k, v, mask, scale)[0]

    registry.register_backend(registry.Backend("plain-test", softmax))
    registry._logged.discard(("plain-test", "diff_v1"))
    registry._logged.discard(("plain-test", "diff_v2"))
    yield calls
    registry._BACKENDS.pop("plain-test")


def test_builtin_backends_are_registered():
    assert {"reference", "sdpa", "flash", "auto"} <= set(registry.backend_names())
    assert registry.backend_for_hf("eager") == "reference"
    assert registry.backend_for_hf("sdpa") == "sdpa"
    assert registry.backend_for_hf("flash_attention_2") == "flash"
    assert registry.backend_for_hf("no-such-thing") is None


def test_unknown_backend_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'magic'; choose one of"):
        registry.get_backend("magic")
    with pytest.raises(ValueError, match=r"ModelConfig\.backend"):
        ModelConfig(backend="magic")
    with pytest.raises(ValueError, match="unknown attention backend"):
        _tiny("baseline").set_backend("magic")


def test_registering_twice_needs_replace(plain_backend):
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend(registry.Backend("plain-test", lambda *a: None))
    with pytest.raises(ValueError, match="reserved"):
        registry.register_backend(registry.Backend("auto", lambda *a: None))


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_missing_entry_points_fall_back_visibly_and_exactly(attention, plain_backend, caplog):
    model = _tiny(attention, backend="reference")
    ids = torch.randint(0, 61, (2, 9))
    expected = model(ids).logits
    model.set_backend("plain-test")
    with caplog.at_level(logging.WARNING, logger="diffattn.kernels"):
        got = model(ids).logits
        model(ids)
    assert plain_backend, "the registered softmax was not called"
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    warnings = [r for r in caplog.records if "plain-test" in r.getMessage()]
    assert len(warnings) == (0 if attention == "baseline" else 1)


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_backend_is_a_run_time_choice(attention, tmp_path):
    from diffattn.checkpoint import load_model, save_model

    model = _tiny(attention, backend="reference")
    ids = torch.randint(0, 61, (1, 7))
    reference = model(ids).logits
    assert model.set_backend("sdpa") is model and model.backend == "sdpa"
    assert all(block.attn.backend == "sdpa" for block in model.layers)
    torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)
    assert "backend" not in model.config.to_dict()
    assert model.config == model.config.replace(backend="reference")
    save_model(model, tmp_path / "m")
    assert "backend" not in (tmp_path / "m" / "config.json").read_text()
    assert load_model(tmp_path / "m", backend="reference").backend == "reference"


def test_model_directory_with_a_saved_backend_still_loads(tmp_path):
    import json

    from diffattn.checkpoint import load_model, save_model

    model = _tiny("diff_v1")
    save_model(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["backend"] = "sdpa"  # written by earlier versions
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    loaded = load_model(tmp_path / "m")
    ids = torch.randint(0, 61, (1, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_hf_attn_implementation_chooses_the_backend(attention):
    from diffattn.hf import DiffAttnConfig, DiffAttnForCausalLM

    model = _tiny(attention, backend="reference")
    fresh = DiffAttnForCausalLM(DiffAttnConfig.from_model_config(model.config))
    assert fresh.model.backend == "sdpa"  # HF's default implementation
    wrapper = DiffAttnForCausalLM.from_diffattn(model)
    ids = torch.randint(0, 61, (1, 7))
    wrapper(ids)
    assert model.backend == "reference"  # a wrapped model keeps its backend
    wrapper.set_attn_implementation("sdpa")
    out = wrapper(ids, output_attentions=True)
    assert model.backend == "sdpa"
    wrapper.set_attn_implementation("eager")
    wrapper(ids)
    assert model.backend == "reference"
    with pytest.raises(ValueError, match="flex_attention"):  # HF's own refusal
        wrapper.set_attn_implementation("flex_attention")
    assert model.backend == "reference"  # a refused implementation changes nothing
    maps = out.attention_maps
    assert len(maps) == 2 and (attention == "baseline") == (maps[0].a1 is None)


# --------------------------------------------------------------------------------------
# auto: resolved per call
# --------------------------------------------------------------------------------------
AUTO_CPU = {
    # case: (softmax, diff_v1, diff_v2) on the CPU, with the compiled kernel built
    "train": ("sdpa", "fused", "sdpa"),
    "prefill": ("sdpa", "fused", "sdpa"),
    "decode": ("sdpa", "fused", "sdpa"),
    "train + padding": ("sdpa", "fused", "sdpa"),
    "prefill + padding": ("sdpa", "fused", "sdpa"),
    "decode + padding": ("sdpa", "fused", "sdpa"),
    "custom mask": ("sdpa", "sdpa", "sdpa"),
    "traced": ("sdpa", "sdpa", "sdpa"),
}


def _compiled_kernel_or_skip():
    from diffattn.attention import cpu_kernel

    reason = cpu_kernel.unavailable()
    if reason is not None:
        pytest.skip(f"compiled CPU kernel unavailable: {reason}")


@pytest.fixture
def failed_build(monkeypatch):
    """The compiled CPU kernel's build fails as it would without a compiler."""
    from torch.utils import cpp_extension

    from diffattn.attention import cpu_kernel

    def no_compiler(*args, **kwargs):
        raise RuntimeError("simulated: no C++ compiler found (c++: command not found)")

    from diffattn.attention import auto

    monkeypatch.setattr(cpu_kernel, "_state", {"loaded": False, "error": None})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    for key in [k for k in registry._logged if k[0] in ("auto", "fused")]:
        registry._logged.discard(key)
    auto.forget()
    yield
    auto.forget()
    for key in [k for k in registry._logged if k[0] in ("auto", "fused")]:
        registry._logged.discard(key)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(AUTO_CPU))
def test_auto_resolution_table_on_the_cpu(case, dtype):
    from diffattn.attention.auto import ENTRIES
    from diffattn.bench.backends import DTYPES, auto_choice

    _compiled_kernel_or_skip()
    got = tuple(auto_choice(entry, case, "cpu", DTYPES[dtype]) for entry in ENTRIES)
    assert got == AUTO_CPU[case]


MEASURED = dict(dtype=torch.bfloat16, grad=False, decode=False, padded=False, head_dim=64)


@pytest.mark.parametrize("entry", ["softmax", "diff_v1", "diff_v2"])
@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, ("sdpa", "flash")),  # bf16 prefill, d = 64: measured
        ({"grad": True}, ("sdpa", "flash")),  # training
        ({"head_dim": 128, "grad": True}, ("sdpa", "flash")),
        ({"padded": True}, ("flash", "sdpa")),  # not measured: the earlier order
        ({"decode": True}, ("flash", "sdpa")),
        ({"cached": True}, ("flash", "sdpa")),  # chunked prefill
        ({"traced": True}, ("flash", "sdpa")),
        ({"custom_mask": True}, ("flash", "sdpa")),
        ({"dtype": torch.float16}, ("flash", "sdpa")),
        ({"head_dim": 32}, ("flash", "sdpa")),
        ({"head_dim": 256}, ("flash", "sdpa")),
    ],
)
def test_auto_order_on_cuda_follows_the_measured_table(entry, changes, expected):
    """No GPU is needed to check the order itself; triton is never picked by auto."""
    from diffattn.attention.auto import Call, order

    fields = {**MEASURED, "custom_mask": False, "traced": False, **changes}
    assert order(Call(entry, "cuda", **fields)) == expected


def test_flash_takes_only_calls_its_kernel_computes():
    from diffattn.attention.backends.flash import _accepts
    from diffattn.attention.mask import AttentionMask

    q, k = torch.empty(2, 4, 6, 8), torch.empty(2, 2, 6, 8)
    left = torch.ones(2, 6, dtype=torch.bool)
    left[0, :2] = False
    holes = left.clone()
    holes[1, 3] = False
    assert _accepts(q, k, AttentionMask()) is None
    assert _accepts(q, k, AttentionMask(key_padding=left)) is None
    assert "holes" in _accepts(q, k, AttentionMask(key_padding=holes))
    assert "4-D" in _accepts(q, k, AttentionMask(allowed=torch.ones(1, 1, 6, 6, dtype=bool)))
    offset = AttentionMask(query_offset=torch.tensor(5))
    assert "static cache" in _accepts(q[:, :, :1], k, offset)


def _spy_on(monkeypatch, name: str) -> list:
    """Count the DIFF V1 calls that run on backend ``name``."""
    import dataclasses

    calls = []
    backend = registry._BACKENDS[name]
    inner = backend.diff_v1

    def spy(*args):
        calls.append(args[0].shape)
        return inner(*args)

    monkeypatch.setitem(registry._BACKENDS, name, dataclasses.replace(backend, diff_v1=spy))
    return calls


def test_auto_trains_and_decodes_diff_v1_on_the_compiled_kernel(monkeypatch):
    _compiled_kernel_or_skip()
    fused_calls, sdpa_calls = _spy_on(monkeypatch, "fused"), _spy_on(monkeypatch, "sdpa")
    model = _tiny("diff_v1").train()
    assert model.backend == "auto"
    ids = torch.randint(0, 61, (2, 9))
    model(ids, labels=ids).loss.backward()
    assert len(fused_calls) == 2 and not sdpa_calls  # one call per layer
    with torch.no_grad():
        model.eval()(ids)
    assert len(fused_calls) == 4 and not sdpa_calls


@pytest.mark.parametrize("name", ["sdpa", "reference", "fused"])
def test_an_explicit_backend_overrides_auto(monkeypatch, name):
    fused_calls = _spy_on(monkeypatch, "fused")
    model = _tiny("diff_v1", backend=name)
    ids = torch.randint(0, 61, (2, 9))
    model(ids, labels=ids).loss.backward()
    assert len(fused_calls) == (2 if name == "fused" else 0)


@pytest.mark.parametrize("n", [1, 7, 129])
@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_auto_matches_reference_with_padding_and_gqa(attention, n):
    """A whole model on auto (GQA: 4 heads, 2 KV heads; left padding): logits and every
    parameter's gradient equal the reference backend's."""
    ids = torch.randint(0, 61, (2, n))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, : n // 3] = 0
    weight = torch.randn(2, n, 61)
    results = {}
    for backend in ("reference", "auto"):
        model = _tiny(attention, backend=backend, max_seq_len=256).train()
        loss = (model(ids, attention_mask=mask).logits * weight).sum()
        loss.backward()
        results[backend] = loss, {k: p.grad for k, p in model.named_parameters()}
    (loss_ref, grads_ref), (loss, grads) = results["reference"], results["auto"]
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-4)
    overall = max(float(g.abs().max()) for g in grads_ref.values() if g is not None)
    for key, g_ref in grads_ref.items():
        if g_ref is None:
            continue
        # an exactly-zero reference (one key: the softmax is constant) and λ's vectors, whose
        # gradient is a sum over every output element that can cancel, are judged on the
        # model's gradient scale
        scale = float(g_ref.abs().max())
        scale = max(scale, overall) if "lambda" in key or scale == 0 else scale
        assert float((grads[key] - g_ref).abs().max()) / scale <= 1e-4, key


def test_a_kernel_that_cannot_build_is_passed_over_with_one_warning(failed_build, caplog):
    """No compiler: auto runs DIFF V1 on sdpa, warns once, and stays exact."""
    ids = torch.randint(0, 61, (2, 9))
    reference = _tiny("diff_v1", backend="reference").train()
    ref_loss = reference(ids, labels=ids).loss
    ref_loss.backward()
    model = _tiny("diff_v1").train()
    with caplog.at_level(logging.WARNING, logger="diffattn.kernels"):
        for _ in range(2):
            model.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
        with torch.no_grad():
            model(ids)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "simulated: no C++ compiler" in warnings[0].getMessage()
    assert "sdpa" in warnings[0].getMessage()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (key, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=key)
    from diffattn.attention.auto import ENTRIES
    from diffattn.bench.backends import auto_choice

    picks = {e: auto_choice(e, "train", "cpu", torch.float32) for e in ENTRIES}
    assert picks == {"softmax": "sdpa", "diff_v1": "sdpa", "diff_v2": "sdpa"}


@pytest.mark.slow
def test_no_compiler_on_the_machine_falls_back_in_a_fresh_process(tmp_path):
    """The real thing: a compiler that does not exist and an empty extension cache."""
    import os
    import subprocess
    import sys

    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from diffattn import DiffTransformerLM, presets\n"
        "m = DiffTransformerLM(presets.get('tiny', attention='diff_v1'))\n"
        "ids = torch.randint(0, 100, (2, 9))\n"
        "m(ids, labels=ids).loss.backward(); m(ids, labels=ids).loss.backward()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CXX="/nonexistent/c++", TORCH_EXTENSIONS_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "skipping 'fused'" in warnings[0], done.stderr


def test_each_resolution_is_logged_once_at_info(caplog):
    from diffattn.attention import auto

    auto._announced.clear()
    auto.forget()
    model = _tiny("diff_v2")
    ids = torch.randint(0, 61, (1, 5))
    with caplog.at_level(logging.INFO, logger="diffattn.kernels"):
        model(ids)
        model(ids)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto:")]
    assert lines == ["auto: diff_v2 train on cpu float32 -> sdpa"]


def test_the_backends_command_lists_what_auto_picks(capsys):
    from diffattn.cli import main

    assert main(["backends", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "auto on cpu, fp32, heads of width 64:" in out and "custom mask" in out
    assert "fused" in out and "not usable" in out  # flash and triton on a CPU machine
    assert "  train              two calls, Q/K zero-padded to V's width" in out
    assert "  decode             differential_rows" in out
    assert main(["backends", "--time", "--cases", "nonesuch"]) == 2
    assert "--cases" in capsys.readouterr().err


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_auto_through_caches_equals_the_reference_forward(attention, cache_kind):
    """Chunked prefill and one-token steps on auto (a left-padded row, GQA, both caches)
    give the reference backend's full-sequence logits."""
    from diffattn.cache import DynamicCache, StaticCache

    model = _tiny(attention, backend="reference")
    with torch.no_grad():  # move λ and norms off their init values
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 61, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0
    real = mask.bool()
    full = model(ids, attention_mask=mask).logits
    model.set_backend("auto")
    cache = DynamicCache() if cache_kind == "dynamic" else StaticCache(model.config, 2, 16)
    pieces, start = [], 0
    with torch.no_grad():
        for stop in (5, 9, *range(10, 14)):  # two prefill chunks, then one token at a time
            out = model(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache)
            pieces.append(out.logits)
            start = stop
    stepped = torch.cat(pieces, dim=1)
    scale = float(full[real].abs().max())
    assert float((stepped[real] - full[real]).abs().max()) / scale <= 1e-5


def test_a_stale_build_lock_is_a_reason_to_fall_back_not_a_hang(monkeypatch, tmp_path):
    """An interrupted build leaves its lock file; the next first call must not wait forever."""
    import os
    import time

    from torch.utils import cpp_extension

    from diffattn.attention import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "_state", {"loaded": False, "error": None})
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: tmp_path)
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 2 * cpu_kernel.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    reason = cpu_kernel.unavailable()
    assert reason is not None and "delete it" in reason and str(lock) in reason


class OutOfResources(Exception):
    """Named as Triton's shared-memory error, which is recognised by its class name."""


REFUSALS = {
    "triton": OutOfResources("out of resource: shared memory, Required: 278528, Hardware: 232448"),
    "cudnn": RuntimeError("cuDNN Frontend error: [cudnn_frontend] No valid execution plans built."),
    "sdpa": RuntimeError("No available kernel. Aborting execution."),
}


@pytest.fixture
def refusing_backend():
    """A backend whose every kernel raises ``error[0]`` (default: a Triton refusal), tried
    first by ``auto`` on the CPU; yields ``(calls, error)``."""
    from diffattn.attention import auto

    calls, error = [], [REFUSALS["triton"]]

    def refuse(*args):
        calls.append(args[0].shape)
        raise error[0]

    registry.register_backend(registry.Backend("refusing-test", refuse, refuse, refuse))
    auto.forget()
    yield calls, error
    registry._BACKENDS.pop("refusing-test")
    auto.forget()


def _prefer(monkeypatch, name: str) -> None:
    from diffattn.attention import auto

    inner = auto.order
    monkeypatch.setattr(auto, "order", lambda call: (name, *inner(call)))


def _diff_v1_call(backend: str, n: int = 6):
    from diffattn.attention import kernels
    from diffattn.attention.mask import AttentionMask

    torch.manual_seed(1)
    q1, q2, k1, k2 = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(4))
    v = torch.randn(1, 2, n, 16, requires_grad=True)
    lam = torch.tensor(0.4)
    out, _ = kernels.differential_attention(q1, q2, k1, k2, v, lam, AttentionMask(), 0.3, backend)
    expected, _ = kernels.differential_attention(
        q1, q2, k1, k2, v, lam, AttentionMask(), 0.3, "reference"
    )
    return out, expected


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_gpu_refusal_moves_auto_to_its_next_choice_once(
    monkeypatch, refusing_backend, caplog, kind
):
    calls, error = refusing_backend
    error[0] = REFUSALS[kind]
    _prefer(monkeypatch, "refusing-test")
    with caplog.at_level("WARNING", logger="diffattn.kernels"):
        for _ in range(3):
            out, expected = _diff_v1_call("auto")
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            out.sum().backward()
    assert len(calls) == 1  # remembered for this kind of call: not tried again
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "'refusing-test'" in warnings[0] and str(REFUSALS[kind]).split(":")[0] in warnings[0]
    assert "'fused'" in warnings[0] or "'sdpa'" in warnings[0]  # where the calls run now
    _diff_v1_call("auto", n=9)  # another length, the same kind of call
    assert len(calls) == 1
    with torch.no_grad():  # another kind of call (a prefill) tries it again
        _diff_v1_call("auto")
    assert len(calls) == 2


def test_an_explicit_backend_refused_by_the_gpu_runs_where_auto_would(refusing_backend, caplog):
    """Never a crash: the named backend's refused calls run on auto's choice, one warning."""
    calls, _ = refusing_backend
    with caplog.at_level("WARNING", logger="diffattn.kernels"):
        for _ in range(2):
            out, expected = _diff_v1_call("refusing-test")
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1 and len(caplog.records) == 1
    assert "'refusing-test'" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("The size of tensor a (6) must match the size of tensor b (7)"),
        ValueError("q1 and k1 must have the same head width"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
)
def test_a_programming_error_is_not_a_refusal(monkeypatch, refusing_backend, error):
    from diffattn.attention import auto

    calls, raised = refusing_backend
    raised[0] = error
    _prefer(monkeypatch, "refusing-test")
    for backend in ("auto", "refusing-test"):
        with pytest.raises(type(error), match=str(error).split(" (")[0][:20]):
            _diff_v1_call(backend)
    assert len(calls) == 2 and not auto.any_refused()


def test_gpu_refusal_recognises_gpu_refusals_only():
    assert registry.gpu_refusal(REFUSALS["triton"]).startswith("OutOfResources: out of")
    assert "No valid execution plans" in registry.gpu_refusal(REFUSALS["cudnn"])
    assert registry.gpu_refusal(REFUSALS["sdpa"]) == (
        "RuntimeError: No available kernel. Aborting execution."
    )
    assert registry.gpu_refusal(RuntimeError("expected scalar type Float")) is None
    assert registry.gpu_refusal(KeyError("no available kernel")) is None  # not a RuntimeError
