"""Dex adapter files: safetensors + JSON, exact reload onto a fresh model, clear mismatches."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from diffattn import dex
from diffattn.dex.io import CONFIG_NAME, WEIGHTS_NAME
from helpers import TINY_VOCAB as VOCAB
from helpers import tiny_diffattn, tiny_hf

transformers = pytest.importorskip("transformers")

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
