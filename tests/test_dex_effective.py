"""Effective attention of Dex heads (paper App. F.3) and the attention-to-answer share."""

from __future__ import annotations

import pytest
import torch

from diffattn import dex
from extras import require_extra
from helpers import tiny_diffattn

pytestmark = require_extra("hf")

import transformers

VOCAB = 128


def dex_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        intermediate_size=128,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    dex.apply(model, {0: [1, 3], 1: [2]}, anneal_steps=10)
    dex.set_step(model, 10)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for layer in dex.dex_layers(model).values():
            layer.w_d.add_(0.2 * torch.randn(layer.w_d.shape, generator=g))
            layer.lambda_learn.fill_(0.3)
    return model


def exact_target(t) -> torch.Tensor:
    """O' = A V (I − λ W_D) in float64 from the captured tensors (the fp32 capture agrees to
    rounding, see test_captured_tensors_reproduce_the_head)."""
    m = torch.eye(t.values.shape[-1], dtype=torch.float64) - t.lam * t.w_d.double()
    return t.attn.double() @ t.values.double() @ m


def ids(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("head", [1, 2, 3])
def test_captured_tensors_reproduce_the_head(head):
    """A·V is the head's output (GQA group of head h: h // 2) and A·V·M what W_O reads."""
    model = dex_llama()
    t = dex.head_tensors(model, ids(10), 0, head)
    assert t.attn.shape == (2, 10, 10) and t.values.shape == (2, 10, 16)
    torch.testing.assert_close(t.attn @ t.values, t.output, atol=1e-5, rtol=1e-4)
    if head == 2:  # not adapted: W_O reads O unchanged
        assert t.w_d is None and t.lam == 0.0 and torch.equal(t.output, t.dex_output)
    else:
        assert t.lam == pytest.approx(0.3)
        m = torch.eye(16) - t.lam * t.w_d
        torch.testing.assert_close(t.output @ m, t.dex_output, atol=1e-5, rtol=1e-4)


def test_few_keys_give_one_least_squares_solution():
    """S <= d: V has full row rank, the least-squares X is unique (X V = O' need not hold)."""
    model = dex_llama()
    t = dex.head_tensors(model, ids(10), 0, 1)  # S = 10 keys <= d = 16
    x = dex.effective_attention_pinv(t.attn, t.values, t.w_d, t.lam)
    v, target = t.values.double(), exact_target(t)
    normal = (x @ v - target) @ v.transpose(-1, -2)  # normal equations of min ||XV − O'||
    assert normal.abs().max() < 1e-10
    nearest = dex.effective_attention_nearest(t.attn, t.values, t.w_d, t.lam)
    assert dex.agreement(nearest, x)["rel_frobenius"] < 1e-8
    via_model = dex.effective_attention(model, ids(10), 0, 1)
    torch.testing.assert_close(via_model, x)


def test_many_keys_pinv_is_exact_and_differs_from_nearest_by_the_invisible_part():
    model = dex_llama()
    t = dex.head_tensors(model, ids(24), 0, 3)  # S = 24 > d = 16: many exact solutions
    v, target = t.values.double(), exact_target(t)
    pinv = dex.effective_attention_pinv(t.attn, t.values, t.w_d, t.lam)
    nearest = dex.effective_attention_nearest(t.attn, t.values, t.w_d, t.lam)
    for x in (pinv, nearest):
        assert ((x @ v - target).norm() / target.norm()) < 1e-8
    invisible = t.attn.double() @ (torch.eye(24, dtype=torch.float64) - v @ torch.linalg.pinv(v))
    torch.testing.assert_close(nearest - pinv, invisible)
    assert dex.agreement(pinv, nearest)["rel_frobenius"] > 0.1
    # gradient descent never changes the invisible part, so it heads for `nearest`
    sgd = dex.effective_attention_optim(t.attn, t.values, t.w_d, t.lam, optimizer="sgd")
    torch.testing.assert_close(sgd - sgd @ v @ torch.linalg.pinv(v), invisible)
    # the paper's setting (100 Adam steps, lr 1e-3) moves from A towards O'
    short = dex.effective_attention_optim(t.attn, t.values, t.w_d, t.lam)
    assert (short @ v - target).norm() < (t.attn.double() @ v - target).norm()
    with pytest.raises(ValueError, match="optimizer must be"):
        dex.effective_attention_optim(t.attn, t.values, t.w_d, t.lam, optimizer="lbfgs")


def test_gradient_descent_converges_to_the_solution_nearest_to_a():
    g = torch.Generator().manual_seed(7)
    attn = torch.softmax(torch.randn(2, 64, 64, generator=g), -1)
    values = torch.randn(2, 64, 8, generator=g, dtype=torch.float64)
    w_d = torch.eye(8) + 0.3 * torch.randn(8, 8, generator=g)
    lr = 0.5 / float(torch.linalg.matrix_norm(values, ord=2).max() ** 2)
    x = dex.effective_attention_optim(attn, values, w_d, 0.4, lr=lr, optimizer="sgd")
    nearest = dex.effective_attention_nearest(attn, values, w_d, 0.4)
    assert dex.agreement(x, nearest)["rel_frobenius"] < 1e-6
    pinv = dex.effective_attention_pinv(attn, values, w_d, 0.4)
    assert dex.agreement(x, pinv)["rel_frobenius"] > 0.5


def test_without_dex_effective_attention_is_the_softmax_map():
    model = tiny_diffattn()
    t = dex.head_tensors(model, ids(8), 1, 0)
    torch.testing.assert_close(t.attn @ t.values, t.output, atol=1e-5, rtol=1e-4)
    x = dex.effective_attention(model, ids(8), 1, 0, method="nearest")
    torch.testing.assert_close(x, t.attn.double(), atol=1e-8, rtol=1e-6)


def test_attention_to_answer():
    a = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    assert float(dex.attention_to_answer(a, [2])) == pytest.approx(0.8)
    assert float(dex.attention_to_answer(a, slice(0, 2))) == pytest.approx(0.2)
    mask = torch.tensor([True, False, False])
    assert dex.attention_to_answer(a, mask, query="all").tolist() == pytest.approx([0.5, 0.1])
    assert float(dex.attention_to_answer(a, [0], query=0)) == pytest.approx(0.5)
    x = torch.tensor([[0.0, 0.0, 0.0], [-0.5, 0.5, 1.0]])  # negative effective attention
    assert float(dex.attention_to_answer(x, [2])) == pytest.approx(0.5)
    assert float(dex.attention_to_answer(x, [2], normalize="sum")) == pytest.approx(1.0)
    assert float(dex.attention_to_answer(x, [0], normalize="none")) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="out of range"):
        dex.attention_to_answer(a, [3])
    with pytest.raises(ValueError, match="query must be"):
        dex.attention_to_answer(a, [0], query="first")
    with pytest.raises(ValueError, match="normalize must be"):
        dex.attention_to_answer(a, [0], normalize="max")


def test_agreement_metrics():
    x = torch.randn(3, 5, 5, dtype=torch.float64)
    same = dex.agreement(x, x)
    assert same["rel_frobenius"] == 0.0 and same["row_cosine_min"] == pytest.approx(1.0)
    flipped = dex.agreement(-x, x)
    assert flipped["rel_frobenius"] == pytest.approx(2.0)
    assert flipped["row_cosine_mean"] == pytest.approx(-1.0)
