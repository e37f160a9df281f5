"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules.

Weight decay (DIFF V1 Table 9: 0.1 for 3B; App. E: 0.05 for the scaling sizes) applies to the
projection matrices and the LM head. It never applies to RMSNorm weights (including DIFF V1's
per-head norm) or to DIFF V1's λ vectors λ_q1, λ_k1, λ_q2, λ_k2 (Eq.2): decaying them would pull
λ towards λ_init + exp(0) − exp(0) = λ_init for no modelling reason. The token embedding is
decayed unless ``decay_embeddings`` is false.

Schedule (DIFF V1 §3.1): linear warmup to the peak over ``warmup_steps``, then linear decay to
``min_lr`` at the decay horizon (3.2e-4 → 1.28e-5 over 1T tokens at 3B); ``cosine`` is offered
as the common alternative.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diffattn.train.config import OptimSection, ScheduleSection

EMBEDDING_NAME = "embed_tokens.weight"


def is_decayed(name: str, param: torch.Tensor, decay_embeddings: bool) -> bool:
    """Whether parameter ``name`` gets weight decay (see module docstring)."""
    if param.ndim < 2:  # norms, λ vectors, biases
        return False
    return decay_embeddings or not name.endswith(EMBEDDING_NAME)


def parameter_groups(
    model: nn.Module, weight_decay: float, decay_embeddings: bool = True
) -> list[dict]:
    """Two AdamW groups (decayed, not decayed) over the trainable parameters of ``model``.

    Each group carries ``lr_scale`` (1.0): the schedule sets ``lr = schedule(step) · lr_scale``,
    so a caller may add groups with their own scale.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if is_decayed(name, param, decay_embeddings) else no_decay).append(param)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0})
    if not groups:
        raise ValueError("the model has no trainable parameters")
    return groups


def build_optimizer(model: nn.Module, optim: OptimSection) -> torch.optim.AdamW:
    """AdamW over :func:`parameter_groups` of ``model`` with the settings of ``optim``."""
    groups = parameter_groups(model, optim.weight_decay, optim.decay_embeddings)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)


class LRSchedule:
    """``lr(step)`` for the 1-based optimizer step about to be taken.

    Warmup: ``peak · step / warmup_steps`` for ``step <= warmup_steps``. Then, with
    ``p = (step − warmup) / (horizon − warmup)`` clamped to [0, 1]:

    * ``linear``: ``peak − (peak − min_lr)·p``;
    * ``cosine``: ``min_lr + (peak − min_lr)·(1 + cos πp)/2``;
    * ``constant``: ``peak``.

    A pure function of the step, so resuming needs only the step.
    """

    def __init__(self, peak: float, schedule: ScheduleSection, horizon: int) -> None:
        self.peak = float(peak)
        self.warmup = int(schedule.warmup_steps)
        self.decay = schedule.decay
        self.min_lr = float(schedule.min_lr)
        self.horizon = int(horizon)

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"optimizer steps count from 1, got {step}")
        if self.warmup and step <= self.warmup:
            return self.peak * step / self.warmup
        if self.decay == "constant":
            return self.peak
        span = max(1, self.horizon - self.warmup)
        progress = min(1.0, max(0.0, (step - self.warmup) / span))
        if self.decay == "linear":
            return self.peak - (self.peak - self.min_lr) * progress
        return self.min_lr + (self.peak - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every group's learning rate for ``step``; returns the base rate."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr

    def state_dict(self) -> dict:
        return {
            "peak": self.peak,
            "warmup": self.warmup,
            "decay": self.decay,
            "min_lr": self.min_lr,
            "horizon": self.horizon,
        }

    def describe_changes(self, saved: dict) -> list[str]:
        """Entries of a saved :meth:`state_dict` that differ from this schedule."""
        now = self.state_dict()
        return [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k]]
