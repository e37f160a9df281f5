"""The λ-annealing schedule of Dex (Eq.4) and the training step that drives it.

Dex paper §3.3, Eq.4::

    λ(t) = (1 − α)·[(t / T)·λ_init] + α·λ_learn,      α = min(1, t / T)

``t`` is the optimizer step, ``T`` the annealing duration, ``λ_init`` a constant per layer and
``λ_learn`` a learnable scalar per layer initialised around zero. λ(0) = 0, so the adapted
model starts as the pretrained one. For 0 < t < T the first term is (1 − t/T)(t/T)·λ_init: it
rises from 0, peaks at λ_init / 4 at t = T/2 and returns to 0 at t = T, feeding the
differential map W_D a learning signal, while α hands control to λ_learn; for t ≥ T,
λ(t) = λ_learn. ``T = 0`` means no annealing: λ(t) = λ_learn from the start.

λ_init is ``"exp"``, the DIFF V1 depth schedule 0.8 − 0.6·exp(−0.3·(l − 1))
(:func:`diffattn.config.lambda_init_schedule`, the Dex default, App. B.3 / Tab. 5), or a
constant such as 0.8, 0.5 or 0.3 (the ablation of Tab. 5).

The step lives in a buffer of every adapted layer, so it is saved with ``state_dict()`` and
checkpoints. Advance it after each optimizer step with :func:`step`, or let a callback do it:
:class:`DexCallback` for the Hugging Face ``Trainer`` and :func:`trainer_callback` for
:func:`diffattn.train.train`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from diffattn.config import lambda_init_schedule
from diffattn.dex.annealing import lambda_schedule, schedule_coefficients  # noqa: F401 (re-exported)
from diffattn.dex.layer import DexHeads

LambdaInit = str | float


def resolve_lambda_init(spec: LambdaInit, layer_index: int) -> float:
    """λ_init of one layer (0-based index): the DIFF depth schedule for ``"exp"``, else the
    constant. One clear ``ValueError`` for anything else."""
    if isinstance(spec, str):
        if spec != "exp":
            raise ValueError(f"lambda_init must be 'exp' or a number, got {spec!r}")
        return lambda_init_schedule(layer_index)
    if isinstance(spec, bool) or not isinstance(spec, int | float) or not math.isfinite(spec):
        raise ValueError(f"lambda_init must be 'exp' or a finite number, got {spec!r}")
    return float(spec)


def _layers(model: nn.Module) -> list[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, DexHeads)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no Dex layers; call diffattn.dex.apply(model, ...) first"
        )
    return found


@torch.no_grad()
def set_step(model: nn.Module, t: int) -> None:
    """Set the annealing step ``t`` of every adapted layer (e.g. when resuming a run)."""
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(f"the Dex step must be a non-negative integer, got {t!r}")
    for layer in _layers(model):
        layer.step.fill_(t)


@torch.no_grad()
def step(model: nn.Module, n: int = 1) -> int:
    """Advance the annealing step by ``n`` (call once after each optimizer step); returns t."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    t = get_step(model) + n
    set_step(model, t)
    return t


def get_step(model: nn.Module) -> int:
    """The current step t (the same in every adapted layer; a mismatch is an error)."""
    values = {int(layer.step) for layer in _layers(model)}
    if len(values) != 1:
        raise ValueError(f"Dex layers disagree on the step t: {sorted(values)}; use set_step")
    return values.pop()


def lambdas(model: nn.Module) -> dict[int, float]:
    """λ(t) of every adapted layer at the current step, keyed by layer index."""
    with torch.no_grad():
        return {layer.layer_index: float(layer.lam()) for layer in _layers(model)}


def trainer_callback(
    model: nn.Module | None = None, use_trainer_step: bool = True
) -> Callable[[Any], None]:
    """A step callback for :func:`diffattn.train.train` (``callbacks=[...]``).

    Called after each optimizer step with a :class:`~diffattn.train.StepState`. With
    ``use_trainer_step`` the Dex step is set to ``state.step`` (the number of completed
    optimizer steps, which also holds on resume); otherwise it advances by one. ``model``
    defaults to ``state.model``. The mean λ(t) over layers is logged as ``dex_lambda``.
    """

    def callback(state: Any) -> None:
        target = model if model is not None else state.model
        if use_trainer_step:
            set_step(target, int(state.step))
        else:
            step(target)
        values = list(lambdas(target).values())
        state.metrics["dex_lambda"] = sum(values) / len(values)

    return callback


_CALLBACK_CLASS: type | None = None


def _callback_class() -> type:
    """Build :class:`DexCallback` on first use, so ``transformers`` is imported lazily."""
    global _CALLBACK_CLASS
    if _CALLBACK_CLASS is not None:
        return _CALLBACK_CLASS
    from transformers import TrainerCallback

    class DexCallback(TrainerCallback):
        """Hugging Face ``Trainer`` callback that advances the Dex step (Eq.4's t).

        ``on_step_end`` runs after every optimizer step (not every micro batch). With
        ``use_trainer_step`` the Dex step is set to ``state.global_step``, which stays right
        when a run resumes from a checkpoint; otherwise it advances by one. ``model``
        defaults to the model the trainer passes in.
        """

        def __init__(self, model: nn.Module | None = None, use_trainer_step: bool = True):
            self.model = model
            self.use_trainer_step = use_trainer_step

        def on_step_end(self, args, state, control, **kwargs):
            target = self.model if self.model is not None else kwargs.get("model")
            if target is None:
                raise ValueError("DexCallback needs a model: pass DexCallback(model)")
            if self.use_trainer_step:
                set_step(target, int(state.global_step))
            else:
                step(target)
            return control

    DexCallback.__qualname__ = "DexCallback"
    _CALLBACK_CLASS = DexCallback
    return DexCallback


def __getattr__(name: str) -> Any:
    if name == "DexCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
