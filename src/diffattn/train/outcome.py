"""What a training run reports: each step's :class:`StepState`, the run's :class:`TrainResult`,
and :class:`TrainingDiverged` when a loss or gradient norm stops being finite."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.config import ModelConfig
from diffattn.train.config import (
    TrainConfig,
)


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/Inf; the weights of the previous step are kept."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


@dataclass
class StepState:
    """What a step callback sees, after the optimizer step of ``step`` (on every rank).

    ``model`` is the trained module (unwrapped from DDP, sharded in place under FSDP2).
    A callback may add entries to ``metrics`` (logged with the step when it is a logging
    step) or set ``stop = True`` to end the run after this step with a checkpoint.
    """

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    metrics: dict[str, Any] = field(default_factory=dict)
    stop: bool = False


@dataclass
class TrainResult:
    """The outcome of :func:`train`."""

    out_dir: Path
    checkpoint: Path | None
    """The last checkpoint (a loadable model directory)."""
    step: int
    """The last completed optimizer step."""
    losses: dict[int, float]
    """Training loss per step run by this call (a resumed call starts after the checkpoint)."""
    val_losses: dict[int, float]
    final: dict[str, Any]
    """The last metrics record."""
    num_parameters: int
    model_config: ModelConfig | None
    """The preset's config; for a ``model_factory`` run the model's own config when it is a
    :class:`~diffattn.DiffTransformerLM`, else ``None``."""
    tokens: int
    """Tokens trained on since step 0."""
    elapsed_s: float
    stopped: str | None = None
    """``None`` when all steps ran, else ``SIGINT``, ``SIGTERM`` or ``callback``."""
    trainable_parameters: int = 0
    """Parameters with ``requires_grad`` (all of them for a preset run)."""

    @property
    def exit_code(self) -> int:
        """0, or 128 + the signal number when a signal stopped the run."""
        if self.stopped in ("SIGINT", "SIGTERM"):
            return 128 + int(getattr(signal, self.stopped))
        return 0
