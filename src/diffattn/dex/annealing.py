"""λ(t) of Dex's Eq.4, the annealing formula the adapted layers compute.

Dex paper §3.3, Eq.4::

    λ(t) = (1 − α)·[(t / T)·λ_init] + α·λ_learn,      α = min(1, t / T)

The schedule around it (λ_init per layer, the step counter, the callbacks) is
:mod:`diffattn.dex.schedule`, which re-exports these functions.
"""

from __future__ import annotations

from typing import Any

import torch


def lambda_schedule(t: Any, anneal_steps: Any, lambda_init: Any, lambda_learn: Any) -> Any:
    """λ(t) of Eq.4 for Python numbers or tensors (differentiable in ``lambda_learn``).

    ``anneal_steps`` (T) of 0 gives α = 1, i.e. λ(t) = λ_learn for every t.
    """
    if isinstance(t, torch.Tensor) or isinstance(anneal_steps, torch.Tensor):
        offset, alpha = schedule_coefficients(t, anneal_steps, lambda_init)
        return offset + alpha * lambda_learn
    ratio = 1.0 if anneal_steps == 0 else t / anneal_steps
    alpha = min(1.0, ratio)
    return (1 - alpha) * (ratio * lambda_init) + alpha * lambda_learn


def schedule_coefficients(
    t: torch.Tensor, anneal_steps: torch.Tensor, lambda_init: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offset, α)`` with ``λ(t) = offset + α·λ_learn`` (Eq.4): :func:`lambda_schedule`
    evaluated at λ_learn = 0 and its slope, as fp32 tensors on ``lambda_init``'s device."""
    t = torch.as_tensor(t, dtype=torch.float32)
    big_t = torch.as_tensor(anneal_steps, dtype=torch.float32, device=t.device)
    ratio = torch.where(big_t > 0, t / big_t.clamp_min(1.0), torch.ones_like(t))
    alpha = ratio.clamp(max=1.0)
    init = torch.as_tensor(lambda_init, dtype=torch.float32, device=t.device)
    offset = (1 - alpha) * (ratio * init)
    return offset, alpha
