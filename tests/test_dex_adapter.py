"""Dex adapter (paper §3, Eq.3–5): exactness at t = 0, the per-head map, errors, trainable set."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from diffattn import dex
from extras import require_extra
from helpers import TINY_VOCAB as VOCAB
from helpers import tiny_diffattn, tiny_hf
from helpers import tiny_model as make

pytestmark = require_extra("hf")


KINDS = ("llama", "qwen2", "mistral", "diffattn")
IDS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def randomise(model: nn.Module, t: int, seed: int = 0) -> None:
    """Move every Dex layer past annealing with a non-trivial W_D and λ_learn."""
    g = torch.Generator().manual_seed(seed)
    dex.set_step(model, t)
    with torch.no_grad():
        for layer in dex.dex_layers(model).values():
            layer.w_d.add_(0.3 * torch.randn(layer.w_d.shape, generator=g))
            layer.lambda_learn.fill_(0.2 + 0.5 * torch.rand((), generator=g).item())


@pytest.mark.parametrize("kind", KINDS)
def test_step_zero_is_exactly_the_pretrained_model(kind):
    model = make(kind)
    before = logits(model)
    dex.apply(model, {0: [1, 3], 1: [0]}, anneal_steps=10)
    assert dex.is_dex(model)
    assert torch.equal(logits(model), before)  # λ(0) = 0 exactly
    dex.set_step(model, 5)
    assert not torch.allclose(logits(model), before, atol=1e-4)  # identity W_D now acts


@pytest.mark.parametrize("kind", ("llama", "diffattn"))
def test_map_matches_per_head_definition(kind):
    """O'_h = O_h − λ O_h W_D,h on selected heads only, checked on the o_proj input."""
    model = make(kind)
    dex.apply(model, {0: [2]}, anneal_steps=4)
    randomise(model, t=2)
    layer = dex.dex_layers(model)[0]
    site = dex.find_attention(model)[0]
    seen = {}
    pre = site.o_proj.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("o", a[0].clone()), prepend=True
    )
    post = site.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o2", a[0].clone()))
    logits(model)
    pre.remove()
    post.remove()
    d = site.head_dim
    o, o2 = seen["o"].view(2, 10, 4, d), seen["o2"].view(2, 10, 4, d)
    lam = (1 - 0.5) * 0.5 * layer.lambda_init + 0.5 * layer.lambda_learn  # Eq.4 at t/T = 1/2
    expected = o[:, :, 2] - lam * o[:, :, 2] @ layer.w_d[0]
    torch.testing.assert_close(o2[:, :, 2], expected.detach(), atol=1e-6, rtol=1e-5)
    for h in (0, 1, 3):
        assert torch.equal(o2[:, :, h], o[:, :, h])


def test_all_heads_and_layers_from_selection():
    model = tiny_hf("llama")
    dex.apply(model, "all", anneal_steps=3)
    sel = dex.selected_heads(model)
    assert sel.heads == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}
    assert sel.n_heads == [4, 4]
    layer = dex.dex_layers(model)[1]
    assert layer.w_d.shape == (4, 16, 16)
    assert torch.equal(layer.w_d[0], torch.eye(16))  # identity initialisation


def test_lambda_init_exp_and_constant():
    model = tiny_hf("llama")
    dex.apply(model, "all", anneal_steps=3)
    inits = [float(layer.lambda_init) for layer in dex.dex_layers(model).values()]
    assert inits == pytest.approx([0.2, 0.8 - 0.6 * torch.exp(torch.tensor(-0.3)).item()])
    model = tiny_hf("llama")
    dex.apply(model, "all", anneal_steps=3, lambda_init=0.5)
    assert [float(x.lambda_init) for x in dex.dex_layers(model).values()] == [0.5, 0.5]


def test_errors_are_clear():
    model = tiny_hf("llama")
    with pytest.raises(ValueError, match="layer 2 does not exist: the model has 2 attention"):
        dex.apply(model, {2: [0]}, anneal_steps=1)
    with pytest.raises(ValueError, match="layer 0: head 4 is out of range; the layer has 4"):
        dex.apply(model, {0: [4]}, anneal_steps=1)
    with pytest.raises(ValueError, match="layer 1: 5 heads selected but the layer has 4"):
        dex.apply(model, {1: [0, 1, 2, 3, 0]}, anneal_steps=1)
    with pytest.raises(ValueError, match="selected twice"):
        dex.apply(model, {1: [0, 0]}, anneal_steps=1)
    with pytest.raises(ValueError, match="no heads selected"):
        dex.apply(model, {0: []}, anneal_steps=1)
    with pytest.raises(ValueError, match="anneal_steps"):
        dex.apply(model, "all", anneal_steps=-1)
    with pytest.raises(ValueError, match="lambda_init"):
        dex.apply(model, "all", anneal_steps=1, lambda_init="linear")
    with pytest.raises(ValueError, match="w_d_init"):
        dex.apply(model, "all", anneal_steps=1, w_d_init="random")
    assert not dex.is_dex(model)  # nothing was changed by the failed calls
    dex.apply(model, "all", anneal_steps=1)
    with pytest.raises(ValueError, match="already has Dex applied"):
        dex.apply(model, "all", anneal_steps=1)


def test_unsupported_models():
    with pytest.raises(ValueError, match=r"no supported attention modules.*LlamaForCausalLM"):
        dex.apply(nn.Sequential(nn.Linear(4, 4)), "all", anneal_steps=1)
    for attention in ("diff_v1", "diff_v2", "gda", "dint", "gated_diff"):  # every declared one
        with pytest.raises(ValueError, match="already differential attention"):
            dex.apply(tiny_diffattn(attention), "all", anneal_steps=1)

    class Conv1x1(nn.Module):  # an o_proj that is not an nn.Linear
        def forward(self, x):
            return x

    model = tiny_hf("llama")
    model.model.layers[0].self_attn.o_proj = Conv1x1()
    with pytest.raises(ValueError, match=r"o_proj is a Conv1x1, not an nn.Linear"):
        dex.apply(model, "all", anneal_steps=1)


def test_state_dict_holds_the_schedule_and_deepcopy_keeps_hooks():
    model = tiny_hf("llama")
    dex.apply(model, {0: [0, 1]}, anneal_steps=8)
    dex.step(model)
    dex.step(model, 2)
    state = model.state_dict()
    prefix = "model.layers.0.self_attn.dex."
    assert int(state[prefix + "step"]) == 3
    assert int(state[prefix + "anneal_steps"]) == 8
    assert {prefix + k for k in ("w_d", "lambda_learn", "lambda_init", "heads")} <= set(state)
    assert "model.layers.0.self_attn.o_proj.weight" in state  # pretrained names unchanged
    twin = copy.deepcopy(model)
    dex.set_step(model, 0)  # the copy has its own schedule and hooks
    assert dex.get_step(twin) == 3
    randomise(twin, t=10)
    fresh = tiny_hf("llama")
    dex.apply(fresh, {0: [0, 1]}, anneal_steps=8)
    fresh.load_state_dict(twin.state_dict())
    assert dex.get_step(fresh) == 10
    torch.testing.assert_close(logits(fresh), logits(twin), atol=0, rtol=0)


def test_identity_init_gives_lambda_a_gradient_zero_init_does_not():
    """The W_D initialisation choice: with W_D = 0, ∂L/∂λ_learn = 0 at the start."""
    grads = {}
    for init in ("identity", "zeros", 0.5):
        model = tiny_hf("llama")
        dex.apply(model, "all", anneal_steps=4, w_d_init=init)
        dex.set_step(model, 2)
        model(IDS, labels=IDS).loss.backward()
        layer = dex.dex_layers(model)[1]
        grads[init] = (float(layer.lambda_learn.grad), float(layer.w_d.grad.abs().sum()))
    assert grads["identity"][0] != 0.0 and grads["identity"][1] > 0
    assert grads["zeros"][0] == 0.0 and grads["zeros"][1] > 0  # W_D learns only through λ(t)
    assert grads[0.5][0] != 0.0


@pytest.mark.parametrize("kind", ("qwen2", "diffattn"))
def test_freeze_and_train_only_the_dex_set(kind):
    model = make(kind)
    model.train()
    dex.apply(model, {0: [0, 1], 1: [2, 3]}, anneal_steps=3)
    trainable = dict(dex.named_trainable_parameters(model))
    names = set(trainable)
    assert all(p.requires_grad for p in trainable.values())
    for name, param in model.named_parameters():
        assert param.requires_grad == (name in names), name
    biased = ("k_proj", "v_proj") if kind == "qwen2" else ()  # Qwen2: biases on q, k, v
    for key in ("k_proj", "v_proj", "o_proj", "dex.w_d", "dex.lambda_learn"):
        assert sum(key in n for n in names) == 2 * (2 if key in biased else 1), key
    assert not any("q_proj" in n or "mlp" in n or "ffn" in n or "norm" in n for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # every parameter is handed to AdamW (with decay): freezing alone must protect the rest
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dex.step(model)
    for name, param in model.named_parameters():
        if name in names:
            assert not torch.equal(param, before[name]), f"{name} did not train"
        else:
            assert torch.equal(param, before[name]), f"{name} changed although frozen"
    assert dex.get_step(model) == 5


def test_attention_all_trains_every_layer():
    model = tiny_hf("llama")
    dex.apply(model, {1: [0]}, anneal_steps=3)
    adapted = {n for n, _ in dex.named_trainable_parameters(model)}
    assert not any("layers.0." in n for n in adapted)
    dex.freeze(model, attention="all")
    every = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.self_attn.k_proj.weight" in every
    assert "model.layers.0.self_attn.q_proj.weight" not in every
    model = tiny_hf("llama")
    dex.apply(model, "all", anneal_steps=3, freeze=False)
    assert all(p.requires_grad for p in model.parameters())


def test_transform_allocates_nothing_larger_than_its_input():
    """W_D is applied as one batched product over the selected heads: no copy of W_D per
    token (a broadcast matmul would make one of (tokens, k, d, d))."""
    from diffattn.dex.layer import DexHeads
    from helpers import LargestTensor

    heads = DexHeads(0, 4, 8, [0, 2], lambda_init=0.3, anneal_steps=0, lambda_learn_init=0.5)
    x = torch.randn(2, 64, 32)
    expected = x.clone()
    expected.view(2, 64, 4, 8)[..., [0, 2], :] -= 0.5 * (
        x.view(2, 64, 4, 8)[..., [0, 2], :].unsqueeze(-2) @ heads.w_d
    ).squeeze(-2)
    with torch.no_grad(), LargestTensor() as seen:
        out = heads.transform(x)
    assert seen.largest <= x.numel()
    torch.testing.assert_close(out, expected)
