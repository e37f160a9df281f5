"""The ``optim`` and ``schedule`` sections of a training recipe (:class:`OptimSection`,
:class:`ScheduleSection`): the optimizer (:mod:`diffattn.train.optim` builds it) and the
learning-rate schedule. Their own module so that the optimizer code reads them without
importing the whole recipe (:mod:`diffattn.train.config` re-exports both)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Decay = Literal["linear", "cosine", "constant", "wsd"]
DecayShape = Literal["linear", "cosine", "sqrt"]
DECAYS: tuple[str, ...] = get_args(Decay)
DECAY_SHAPES: tuple[str, ...] = get_args(DecayShape)


@dataclass
class OptimSection:
    """The optimizer. Default: AdamW (Loshchilov & Hutter, 2019) with DIFF V1 Table 9 (3B).

    ``name`` picks it (:mod:`diffattn.train.optim`): ``adamw``, any ``torch.optim`` class by
    name (case-insensitive: ``sgd`` is ``torch.optim.SGD``), or ``muon``: ``torch.optim.Muon``
    on the hidden 2-D matrices and AdamW on the rest.
    """

    name: str = "adamw"
    """``adamw`` | ``muon`` | a ``torch.optim`` class name (``sgd``, ``adam``, ``rmsprop``...)."""
    lr: float = 3.2e-4
    """Peak learning rate (reached after warmup)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Passed to a class that takes ``betas`` (muon: its AdamW part)."""
    eps: float = 1e-8
    """Passed to a class that takes ``eps`` (muon: its AdamW part; Muon's own ``eps`` goes in
    ``kwargs``)."""
    weight_decay: float = 0.1
    """Decay on matrices; norms and DIFF V1's λ vectors are never decayed (decoupled in AdamW
    and Muon, the class's own kind elsewhere)."""
    decay_embeddings: bool = True
    """Decay the token embedding too (the LM head, a projection, is always decayed)."""
    clip: float | None = 1.0
    """Max global gradient norm; ``null`` or 0 turns clipping off (the norm is still logged)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments of the class (muon: of ``torch.optim.Muon``), e.g.
    ``{momentum: 0.9}`` for SGD; a list is passed as a tuple."""
    muon_lr_scale: float = 1.0
    """muon only: Muon's learning rate is ``lr · muon_lr_scale`` (its AdamW part runs at
    ``lr``)."""


@dataclass
class ScheduleSection:
    """Learning-rate schedule: linear warmup, then decay to ``min_lr``.

    ``linear`` is DIFF V1's schedule (§3.1: 1000 warmup steps, then linear decay from 3.2e-4 to
    1.28e-5); ``cosine`` decays along a half cosine; ``constant`` holds the peak; ``wsd``
    (warmup-stable-decay) holds the peak and decays over the last ``decay_steps`` (or
    ``decay_fraction`` of the horizon) along ``decay_shape``. Formulas: :class:`LRSchedule`.
    """

    warmup_steps: int = 0
    decay: Decay = "linear"
    min_lr: float = 0.0
    """The floor reached at ``total_steps`` and held afterwards."""
    total_steps: int | None = None
    """Decay horizon; ``null`` means ``steps``. Set it to stop early and extend later with
    ``--resume`` on the same schedule."""
    decay_steps: int | None = None
    """wsd only: length of the final decay, ending at the horizon."""
    decay_fraction: float | None = None
    """wsd only, instead of ``decay_steps``: that length as a fraction of the horizon (rounded
    to the nearest step, halves up)."""
    decay_shape: DecayShape = "linear"
    """wsd only: ``linear``, ``cosine`` or ``sqrt`` (1 − √p, Hägele et al. 2024)."""

    def wsd_decay_steps(self, horizon: int) -> int:
        """The steps of the final decay of ``wsd`` for a schedule of ``horizon`` steps."""
        if self.decay_steps is not None:
            return self.decay_steps
        return math.floor(float(self.decay_fraction or 0.0) * horizon + 0.5)
