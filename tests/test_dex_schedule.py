"""λ-annealing (Dex paper Eq.4), the step buffer and the two training callbacks."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn import dex, lambda_init_schedule
from extras import require_extra
from helpers import tiny_hf

pytestmark = require_extra("hf")

import transformers


def eq4(t: int, big_t: int, lam_init: float, lam_learn: float) -> float:
    """Eq.4 written out: λ(t) = (1 − α)[(t/T) λ_init] + α λ_learn, α = min(1, t/T)."""
    alpha = min(1.0, t / big_t)
    return (1 - alpha) * (t / big_t * lam_init) + alpha * lam_learn


@pytest.mark.parametrize("t", [0, 1, 25, 50, 75, 99, 100, 101, 500])
def test_formula(t):
    got = dex.lambda_schedule(t, 100, 0.8, 0.3)
    assert got == pytest.approx(eq4(t, 100, 0.8, 0.3), abs=1e-15)
    tensor = dex.lambda_schedule(torch.tensor(t), torch.tensor(100), 0.8, torch.tensor(0.3))
    assert float(tensor) == pytest.approx(eq4(t, 100, 0.8, 0.3), abs=1e-6)


def test_shape_of_the_schedule():
    assert dex.lambda_schedule(0, 100, 0.8, 0.3) == 0.0  # starts at the pretrained model
    # the annealed λ_init term peaks at T/2 with λ_init/4 and vanishes at T
    assert dex.lambda_schedule(50, 100, 0.8, 0.0) == pytest.approx(0.2)
    assert dex.lambda_schedule(100, 100, 0.8, 0.0) == 0.0
    assert dex.lambda_schedule(100, 100, 0.8, 0.3) == pytest.approx(0.3)
    assert dex.lambda_schedule(7, 0, 0.8, 0.3) == pytest.approx(0.3)  # T = 0: no annealing
    assert float(dex.lambda_schedule(torch.tensor(0), torch.tensor(0), 0.8, 0.3)) == (
        pytest.approx(0.3)
    )


def test_model_lambda_follows_eq4_and_is_differentiable():
    model = tiny_hf("llama")
    dex.apply(model, {0: [0], 1: [1, 2]}, anneal_steps=10)
    with torch.no_grad():
        for layer in dex.dex_layers(model).values():
            layer.lambda_learn.fill_(0.1)
    for t in (0, 3, 10, 12):
        dex.set_step(model, t)
        for index, value in dex.lambdas(model).items():
            assert value == pytest.approx(eq4(t, 10, lambda_init_schedule(index), 0.1), abs=1e-6)
    dex.set_step(model, 4)
    layer = dex.dex_layers(model)[0]
    layer.lam().backward()
    assert float(layer.lambda_learn.grad) == pytest.approx(0.4)  # ∂λ/∂λ_learn = α = t/T


def test_step_controls():
    model = tiny_hf("llama")
    with pytest.raises(ValueError, match="no Dex layers"):
        dex.step(model)
    dex.apply(model, "all", anneal_steps=5)
    assert dex.get_step(model) == 0
    assert dex.step(model) == 1
    assert dex.step(model, 3) == 4
    dex.set_step(model, 9)
    assert dex.get_step(model) == 9
    with pytest.raises(ValueError, match="non-negative integer"):
        dex.set_step(model, -1)
    dex.dex_layers(model)[0].step.fill_(2)
    with pytest.raises(ValueError, match="disagree"):
        dex.get_step(model)


def test_diffattn_trainer_callback():
    from diffattn.train import StepState

    model = tiny_hf("llama")
    dex.apply(model, "all", anneal_steps=4)
    callback = dex.trainer_callback(model)
    for step in (1, 2, 3):
        state = StepState(step, 1.0, 1e-4, 1.0, 0, model, None, None)
        callback(state)
        assert dex.get_step(model) == step
        expected = [eq4(step, 4, lambda_init_schedule(i), 0.0) for i in range(2)]
        assert state.metrics["dex_lambda"] == pytest.approx(sum(expected) / 2, abs=1e-6)
    # a resumed run: the trainer's step wins; without it the callback counts by itself
    callback(StepState(10, 1.0, 1e-4, 1.0, 0, model, None, None))
    assert dex.get_step(model) == 10
    counting = dex.trainer_callback(use_trainer_step=False)
    counting(StepState(99, 1.0, 1e-4, 1.0, 0, model, None, None))  # model from the state
    assert dex.get_step(model) == 11


def test_hf_trainer_callback_in_a_real_trainer(tmp_path):
    from torch.utils.data import Dataset

    assert isinstance(dex.DexCallback(), transformers.TrainerCallback)

    class Tokens(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.arange(12) * (i + 1) % 128
            return {"input_ids": ids, "labels": ids}

    model = tiny_hf("llama")
    model.train()
    dex.apply(model, "all", anneal_steps=3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[dex.DexCallback()]
    )
    trainer.train()
    assert dex.get_step(model) == 2  # one per optimizer step, not per micro batch
    assert dex.lambdas(model)[0] == pytest.approx(eq4(2, 3, 0.2, 0.0), abs=1e-3)
    assert not math.isnan(dex.lambdas(model)[1])


def test_cached_lambda_follows_every_change_of_its_buffers():
    """λ(t) is computed from cached schedule coefficients; stepping, reloading the buffers or
    moving the module gives the value and gradient of Eq.4 evaluated afresh."""
    from diffattn.dex.layer import DexHeads
    from diffattn.dex.schedule import lambda_schedule

    heads = DexHeads(0, 4, 8, [1, 2], lambda_init=0.3, anneal_steps=10, lambda_learn_init=0.6)

    def fresh():
        return lambda_schedule(heads.step, heads.anneal_steps, heads.lambda_init, 0.6)

    for _ in range(12):
        assert torch.allclose(heads.lam(), fresh(), rtol=0, atol=1e-7)
        heads.step += 1
    heads.load_state_dict({**heads.state_dict(), "step": torch.tensor(3)})
    assert torch.allclose(heads.lam(), fresh(), rtol=0, atol=1e-7)
    heads.anneal_steps.fill_(0)  # no annealing: λ = λ_learn
    assert heads.lam().item() == pytest.approx(0.6)
    heads.to(torch.float64)  # new buffer tensors
    assert heads.lam().item() == pytest.approx(0.6)
    heads.lam().backward()
    assert heads.lambda_learn.grad.item() == pytest.approx(1.0)
