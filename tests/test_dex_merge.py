"""Merging Dex into W_O: exact, plain, loadable by stock transformers; wrong folds are caught."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from diffattn import dex
from diffattn.dex.merge import fold_into_o_proj
from extras import require_extra
from helpers import TINY_VOCAB as VOCAB
from helpers import tiny_model as make

pytestmark = require_extra("hf")


IDS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
TOL = 1e-4


def trained_dex(kind: str, t: int = 30) -> nn.Module:
    """A Dex model past annealing with random, non-symmetric W_D and a non-trivial λ."""
    model = make(kind)
    dex.apply(model, {0: [0, 2], 1: [1, 2, 3]}, anneal_steps=20)
    dex.set_step(model, t)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in dex.dex_layers(model).values():
            layer.w_d.add_(0.5 * torch.randn(layer.w_d.shape, generator=g))
            layer.lambda_learn.fill_(0.6)
        for site in dex.find_attention(model):  # make W_O matter at the logits
            site.o_proj.weight.mul_(20)
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("kind", ("llama", "qwen2", "mistral", "diffattn"))
@pytest.mark.parametrize("t", (30, 10))
def test_merge_is_exact_and_plain(kind, t):
    model = trained_dex(kind, t)
    expected = logits(model)
    baseline = make(kind)
    with torch.no_grad():
        for site in dex.find_attention(baseline):
            site.o_proj.weight.mul_(20)
    assert (expected - logits(baseline)).abs().max() > 1e-2  # Dex changes the model
    n_before = sum(p.numel() for p in baseline.parameters())
    merged = dex.merge(copy.deepcopy(model))
    assert type(merged) is type(model)
    assert not dex.is_dex(merged)
    assert sum(p.numel() for p in merged.parameters()) == n_before  # zero extra parameters
    assert set(merged.state_dict()) == set(baseline.state_dict())
    assert all(not site.o_proj._forward_pre_hooks for site in dex.find_attention(merged))
    assert all(p.requires_grad for p in merged.parameters())
    error = (logits(merged) - expected).abs().max().item()
    assert error <= TOL, error
    # the unmerged original is untouched and still Dex
    assert dex.is_dex(model) and torch.equal(logits(model), expected)


def test_wrong_transpose_is_detected():
    """Negative control: folding M_h instead of M_hᵀ (or λ of the wrong step) is caught."""
    model = trained_dex("llama")
    expected = logits(model)
    wrong = copy.deepcopy(model)
    wrong_wd = copy.deepcopy(model)
    for victim, transform in ((wrong, "transpose"), (wrong_wd, "lambda")):
        with torch.no_grad():
            layers = dex.dex_layers(victim)
            for site in dex.find_attention(victim):
                layer = layers[site.index]
                w_d = layer.w_d.transpose(-1, -2) if transform == "transpose" else layer.w_d
                lam = float(layer.lam()) * (1.0 if transform == "transpose" else 0.5)
                site.o_proj.weight.copy_(
                    fold_into_o_proj(site.o_proj.weight, layer.selected, w_d, lam)
                )
        dex.adapter.remove_hooks(victim)
        assert (logits(victim) - expected).abs().max() > 100 * TOL, transform


def test_fold_formula_on_one_head():
    weight = torch.randn(6, 8, dtype=torch.float64)
    w_d = torch.randn(1, 4, 4, dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    x_dex = x.clone()
    x_dex[:, 4:] = x[:, 4:] - 0.3 * x[:, 4:] @ w_d[0]  # head 1 of width 4
    merged = fold_into_o_proj(weight, [1], w_d, 0.3)
    torch.testing.assert_close(x @ merged.T, x_dex @ weight.T)
    assert torch.equal(merged[:, :4], weight[:, :4])


def test_bf16_merge_stays_close():
    model = trained_dex("llama").to(torch.bfloat16)
    expected = logits(model).float()
    merged = dex.merge(copy.deepcopy(model))
    assert merged.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    scale = expected.abs().max()
    assert ((logits(merged).float() - expected).abs().max() / scale) < 0.05


def test_non_linear_w_o_is_refused():
    class QuantLinear(nn.Linear):  # a subclass stands for a quantized W_O
        pass

    model = trained_dex("llama")
    site = dex.find_attention(model)[1]
    old = site.o_proj
    new = QuantLinear(old.in_features, old.out_features, bias=False)
    new.load_state_dict(old.state_dict())
    new._forward_pre_hooks.update(old._forward_pre_hooks)
    new._forward_pre_hooks_with_kwargs.update(old._forward_pre_hooks_with_kwargs)
    site.module.o_proj = new
    before = model.model.layers[0].self_attn.o_proj.weight.clone()
    with pytest.raises(ValueError, match=r"QuantLinear, not a plain nn\.Linear"):
        dex.merge(model)
    assert dex.is_dex(model)  # nothing was folded
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, before)
    with pytest.raises(ValueError, match="no Dex layers"):
        dex.merge(make("llama"))


def test_merged_checkpoint_loads_in_stock_transformers(tmp_path):
    model = trained_dex("qwen2")
    expected = logits(model)
    merged = dex.merge(model)
    merged.save_pretrained(tmp_path / "merged")
    torch.save({"ids": IDS, "logits": expected}, tmp_path / "expected.pt")
    code = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "merged")!r}).eval()
        ref = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            out = model(ref["ids"]).logits
        assert "diffattn" not in sys.modules, "diffattn was imported"
        print(type(model).__name__, (out - ref["logits"]).abs().max().item())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    name, error = result.stdout.split()[-2:]
    assert name == "Qwen2ForCausalLM"
    assert float(error) <= TOL


def test_generation_with_cache_matches_the_merged_model():
    """The hook acts on every call, so cached decoding of a Dex model is the merged model's."""
    model = trained_dex("llama")
    merged = dex.merge(copy.deepcopy(model))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(IDS, **kwargs), merged.generate(IDS, **kwargs))
