"""Dex adapter files: safetensors + JSON, exact reload onto a fresh model, clear mismatches."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffattn import dex
from diffattn.dex.io import CONFIG_NAME, WEIGHTS_NAME, AdapterError
from extras import require_extra
from helpers import TINY_VOCAB as VOCAB
from helpers import tiny_diffattn, tiny_hf

pytestmark = require_extra("hf")


IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def train_a_little(model, steps: int = 3) -> None:
    model.train()
    optimizer = torch.optim.AdamW(dex.trainable_parameters(model), lr=1e-2)
    for _ in range(steps):
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dex.step(model)
    model.eval()


def test_roundtrip_after_training_is_exact(tmp_path):
    model = tiny_hf("llama")
    dex.apply(model, {0: [1, 3], 1: [0]}, anneal_steps=2, lambda_init=0.5)
    train_a_little(model)
    expected = logits(model)
    dex.save_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / CONFIG_NAME).read_text())
    assert config["step"] == 3 and config["anneal_steps"] == 2
    assert [layer["heads"] for layer in config["layers"]] == [[1, 3], [0]]
    assert [layer["lambda_init"] for layer in config["layers"]] == [0.5, 0.5]
    tensors = load_file(str(tmp_path / "adapter" / WEIGHTS_NAME))
    assert tensors["dex.0.w_d"].shape == (2, 16, 16)
    assert "model.model.layers.0.self_attn.k_proj.weight" in tensors
    assert not any("q_proj" in k or "mlp" in k for k in tensors)  # only the trained set

    fresh = dex.load_adapter(tiny_hf("llama"), tmp_path / "adapter")
    assert dex.get_step(fresh) == 3
    assert torch.equal(logits(fresh), expected)
    trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in dex.named_trainable_parameters(fresh)}
    assert dex.lambdas(fresh) == dex.lambdas(model)
    # negative control: W_D and λ alone do not reproduce a model whose K, V, O trained
    dex.save_adapter(model, tmp_path / "small", include_trained_weights=False)
    partial = dex.load_adapter(tiny_hf("llama"), tmp_path / "small")
    assert (logits(partial) - expected).abs().max() > 1e-4


def test_diffattn_roundtrip(tmp_path):
    model = tiny_diffattn()
    dex.apply(model, "all", anneal_steps=0)
    train_a_little(model, 2)
    dex.save_adapter(model, tmp_path)
    assert torch.equal(logits(dex.load_adapter(tiny_diffattn(), tmp_path)), logits(model))


def test_mismatches_are_clear(tmp_path):
    model = tiny_hf("llama")
    dex.apply(model, {0: [0]}, anneal_steps=2)
    dex.save_adapter(model, tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"heads per layer = \[4, 4\], the model has \[8, 8\]"):
        dex.load_adapter(tiny_hf("llama", num_attention_heads=8), tmp_path / "adapter")
    with pytest.raises(ValueError, match="already has Dex applied"):
        dex.load_adapter(model, tmp_path / "adapter")
    with pytest.raises(ValueError, match="not a Dex adapter directory"):
        dex.load_adapter(tiny_hf("llama"), tmp_path)
    config_path = tmp_path / "adapter" / CONFIG_NAME
    config = json.loads(config_path.read_text())
    config["trained_weights"].append("model.layers.0.self_attn.extra.weight")
    config_path.write_text(json.dumps(config))
    fresh = tiny_hf("llama")
    with pytest.raises(ValueError, match="which this model does not have"):
        dex.load_adapter(fresh, tmp_path / "adapter")
    assert not dex.is_dex(fresh)
    config["format"] = "other"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is not a version-1 diffattn-dex adapter"):
        dex.load_adapter(fresh, tmp_path / "adapter")


# ----------------------------------------------------------------------------------------
# damaged adapter files: one error naming the file, the model untouched
def _saved_adapter(tmp_path):
    model = tiny_hf("llama")
    dex.apply(model, {0: [1, 3], 1: [0]}, anneal_steps=2, lambda_init=0.5)
    return dex.save_adapter(model, tmp_path / "adapter")


def _refused(directory, match):
    fresh = tiny_hf("llama")
    with pytest.raises(AdapterError, match=match) as error:
        dex.load_adapter(fresh, directory)
    assert "\n" not in str(error.value)
    assert not dex.is_dex(fresh)
    return error.value


def test_truncated_or_corrupt_weights_name_the_file(tmp_path):
    adapter = _saved_adapter(tmp_path)
    weights = adapter / WEIGHTS_NAME
    data = weights.read_bytes()
    for size in (0, 7, 60, len(data) // 2, len(data) - 1):
        weights.write_bytes(data[:size])
        _refused(adapter, rf"{WEIGHTS_NAME}: not a readable safetensors file")
    weights.unlink()
    _refused(adapter, rf"{WEIGHTS_NAME}: missing")
    tensors = {k: v.clone() for k, v in load_file_bytes(data).items()}
    tensors["dex.0.lambda_learn"] = torch.tensor(float("nan"))
    save_file(tensors, str(weights))
    _refused(adapter, rf"{WEIGHTS_NAME}: dex\.0\.lambda_learn holds non-finite values")
    tensors["dex.0.lambda_learn"] = torch.tensor(1)
    save_file(tensors, str(weights))
    _refused(adapter, rf"{WEIGHTS_NAME}: dex\.0\.lambda_learn holds torch\.int64 values")
    del tensors["dex.0.lambda_learn"]
    save_file(tensors, str(weights))
    _refused(adapter, rf"{WEIGHTS_NAME}: lacks dex\.0\.lambda_learn, which {CONFIG_NAME} lists")


def load_file_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


MALFORMED = {
    "truncated JSON": lambda c: json.dumps(c)[:40],
    "not an object": lambda c: "[1, 2]",
    "no layers": lambda c: {k: v for k, v in c.items() if k != "layers"},
    "layers a string": lambda c: {**c, "layers": "all"},
    "layer without heads": lambda c: {**c, "layers": [{"index": 0, "lambda_init": 0.5}]},
    "layer index out of range": lambda c: {
        **c,
        "layers": [{"index": 9, "heads": [0], "lambda_init": 0.5}],
    },
    "head out of range": lambda c: {
        **c,
        "layers": [{"index": 0, "heads": [0, 4], "lambda_init": 0.5}],
    },
    "lambda_init a string": lambda c: {
        **c,
        "layers": [{**layer, "lambda_init": "x"} for layer in c["layers"]],
    },
    "no n_layers": lambda c: {k: v for k, v in c.items() if k != "n_layers"},
    "head_dim too short": lambda c: {**c, "head_dim": [16]},
    "trained_weights null": lambda c: {**c, "trained_weights": None},
    "step negative": lambda c: {**c, "step": -1},
    "w_d_init unknown": lambda c: {**c, "w_d_init": "random"},
    "attention unknown": lambda c: {**c, "attention": "some"},
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_config_names_the_file(tmp_path, case):
    adapter = _saved_adapter(tmp_path)
    path = adapter / CONFIG_NAME
    changed = MALFORMED[case](json.loads(path.read_text()))
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    error = _refused(adapter, rf"{CONFIG_NAME}: ")
    assert str(path) in str(error)


@pytest.fixture
def no_progress_bars():
    """transformers' weight-loading progress bar off, so stderr holds only our lines."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    yield
    if enabled:
        hf_logging.enable_progress_bar()


def test_dex_merge_with_a_damaged_adapter_exits_2_with_one_line(tmp_path, capsys, no_progress_bars):
    from diffattn.cli import main

    base = tiny_hf("llama")
    base.save_pretrained(tmp_path / "model")
    model = tiny_hf("llama")
    model.load_state_dict(base.state_dict())
    dex.apply(model, {0: [1]}, anneal_steps=2)
    adapter = dex.save_adapter(model, tmp_path / "adapter")
    weights = adapter / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    out = tmp_path / "merged"
    argv = ["dex", "merge", str(adapter), str(tmp_path / "model"), "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffattn dex: error: "), err
    assert str(weights) in err[0] and not out.exists()

    weights.write_bytes(data)
    config = adapter / CONFIG_NAME
    config.write_text(config.read_text()[:-30])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(config) in err[0] and "not valid JSON" in err[0], err
    assert not out.exists()
    config.write_text(json.dumps({**json.loads(data_config(model)), "layers": [{"index": 0}]}))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "malformed Dex adapter config: layers[0].heads" in err[0], err
    assert not out.exists()


def data_config(model) -> str:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        return (dex.save_adapter(model, Path(tmp)) / CONFIG_NAME).read_text()
