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
    with pytest.raises(ValueError, match="not available for diffattn"):
        wrapper.set_attn_implementation("flex_attention")
    maps = out.attention_maps
    assert len(maps) == 2 and (attention == "baseline") == (maps[0].a1 is None)
