"""Compiled decoder blocks (``DiffTransformerLM.compile_blocks``, the trainer's ``compile``):
each block is one graph, and a compiled training step gives eager's loss, logits and
gradients in fp32, for the baseline, DIFF V1 and DIFF V2, with left padding and GQA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from diffattn.attention import auto
from diffattn.train.parallel import apply_compile
from helpers import ATTENTIONS, TINY_VOCAB, tiny_diffattn

LENGTHS = (1, 7, 129)


def _batch(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, a mask whose first row is left-padded (when there is room) and labels."""
    ids = torch.randint(0, TINY_VOCAB, (2, length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, : length // 3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _step(model, ids, mask, labels):
    """Loss, logits and gradients of one training step (a one-token batch has no next token
    to predict, so its loss is the mean squared logit)."""
    out = model(ids, attention_mask=mask, labels=labels)
    loss = out.loss if ids.shape[1] > 1 else out.logits.square().mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), out.logits.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _compiled_step_matches_eager(
    compiled, eager, lengths=LENGTHS, tolerance=1e-5, lambda_tolerance=None
):
    """Train-mode steps of both models at every length: equal loss, logits and gradients.

    ``lambda_tolerance`` (default ``tolerance``) bounds DIFF V1's λ gradients: each is a sum
    over every position and head of terms that largely cancel (it ends orders of magnitude
    below its terms), so a kernel that sums in another order moves its low digits most."""
    lambda_tolerance = lambda_tolerance or tolerance
    compiled.train(), eager.train()
    for length in lengths:
        batch = _batch(length)
        got, want = _step(compiled, *batch), _step(eager, *batch)
        assert _rel(got[0], want[0]) <= tolerance, f"loss at N={length}"
        real = batch[1].bool()
        assert _rel(got[1][real], want[1][real]) <= tolerance, f"logits at N={length}"
        assert got[2].keys() == want[2].keys()
        for name, grad in want[2].items():
            bound = lambda_tolerance if ".lambda_" in name else tolerance
            assert _rel(got[2][name], grad) <= bound, f"d/d {name} at N={length}"


def _pair(attention: str, backend: str, **overrides):
    eager = tiny_diffattn(attention, backend=backend, **overrides)
    return copy.deepcopy(eager), eager


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_block_compiles_whole_and_trains_like_eager(attention, backend):
    """``fullgraph=True`` (a graph break raises); ``sdpa`` is what ``auto`` runs traced calls
    on, on the CPU."""
    compiled, eager = _pair(attention, backend)
    counter = CompileCounter()
    compiled.compile_blocks(backend=counter, fullgraph=True)
    lengths = LENGTHS if backend == "sdpa" else (7,)
    # λ's gradients in fp32: 1.5e-5 apart at N = 7 on an AMD EPYC CPU (the shape-generic graph
    # after N = 1 orders its sums otherwise); the float64 test below shows the same math
    _compiled_step_matches_eager(compiled, eager, lengths, lambda_tolerance=5e-5)
    assert counter.frame_count >= 1  # the blocks did go through Dynamo
    assert dict(counters["graph_break"]) == {}


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_compiled_blocks_compute_eagers_numbers_in_float64(attention):
    """In float64 the compiled blocks (on ``sdpa``, through N = 1, 7, 129) give eager's loss,
    logits and every gradient, λ's included, to 1e-12: what separates them in fp32 is the
    order of the sums, not the computation."""
    compiled, eager = _pair(attention, "sdpa")
    compiled.double(), eager.double()
    compiled.compile_blocks(backend=CompileCounter(), fullgraph=True)
    _compiled_step_matches_eager(compiled, eager, LENGTHS, tolerance=1e-12)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_compiled_blocks_on_auto_match_eager_and_settle(attention):
    """``auto`` (the default backend), from a fresh resolver: every block one whole graph
    (``fullgraph=True``), eager's numbers, and after the first steps no block is compiled
    again. On the CPU, eager DIFF V1 runs the ``fused`` kernel and traced calls run ``sdpa``,
    so λ's gradient differs in the fifth digit."""
    auto.forget()
    auto._announced.clear()
    compiled, eager = _pair(attention, "auto")
    compiled.compile_blocks(backend="aot_eager", fullgraph=True)
    _compiled_step_matches_eager(compiled, eager, lengths=(7,), lambda_tolerance=2e-4)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _compiled_step_matches_eager(compiled, eager, lengths=(7,), lambda_tolerance=2e-4)


def test_kernel_log_calls_do_not_split_the_graph():
    """The attention backends log on ``diffattn.kernels``; compiled, those calls are
    dropped. A logger call elsewhere still breaks the graph (the check can fail)."""
    import logging

    kernels, other = logging.getLogger("diffattn.kernels"), logging.getLogger("elsewhere")

    def announce(logger, x):
        logger.info("announced")
        return x * 2

    tiny_diffattn().compile_blocks(backend="eager")  # registers the kernel logger
    assert torch.compile(announce, backend="eager", fullgraph=True)(kernels, torch.ones(2))[0] == 2
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(announce, backend="eager", fullgraph=True)(other, torch.ones(2))


@pytest.mark.slow
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_inductor_blocks_train_like_eager(attention):
    """The generated C++ (what the trainer's ``compile: true`` runs): fused kernels, eager's
    numbers."""
    compiled, eager = _pair(attention, "sdpa")
    compiled.compile_blocks(fullgraph=True)
    _compiled_step_matches_eager(
        compiled, eager, lengths=(7, 129), tolerance=1e-4, lambda_tolerance=1e-3
    )


def test_the_trainer_compiles_through_compile_blocks():
    model = tiny_diffattn("diff_v1", backend="sdpa")
    apply_compile(model)
    assert all(block._compiled_call_impl is not None for block in model.layers)
    assert list(model.state_dict()) == list(tiny_diffattn("diff_v1").state_dict())


def test_compile_blocks_refuses_unknown_options():
    model = tiny_diffattn()
    with pytest.raises(ValueError, match="mode must be one of"):
        model.compile_blocks(mode="fastest")
    with pytest.raises(ValueError, match="backend must be"):
        model.compile_blocks(backend="")
    assert all(block._compiled_call_impl is None for block in model.layers)
