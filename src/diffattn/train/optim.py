"""Optimizers by name, weight decay on matrices only, and the learning-rate schedules.

Weight decay (DIFF V1 Table 9: 0.1 for 3B; App. E: 0.05 for the scaling sizes) applies to the
projection matrices and the LM head. It never applies to RMSNorm weights (including DIFF V1's
per-head norm) or to DIFF V1's λ vectors λ_q1, λ_k1, λ_q2, λ_k2 (Eq.2): decaying them would pull
λ towards λ_init + exp(0) − exp(0) = λ_init for no modelling reason. The token embedding is
decayed unless ``decay_embeddings`` is false.

Optimizers (``optim.name``, :func:`build_optimizer`):

* ``adamw`` (the default): ``torch.optim.AdamW`` over the two groups of
  :func:`parameter_groups` with ``lr``, ``betas`` and ``eps``.
* any other ``torch.optim`` class by name, case-insensitive (``sgd`` is ``torch.optim.SGD``):
  the same two groups; ``lr``, then ``betas`` and ``eps`` where the class takes an argument of
  that name and form (a pair of numbers, a number), then ``optim.kwargs``. A class without
  ``weight_decay`` needs ``optim.weight_decay: 0``; a non-default ``betas`` or ``eps`` that the
  class cannot take is refused. LBFGS (it needs a closure that re-evaluates the loss) and
  SparseAdam (sparse gradients only) are refused.
* ``muon``: ``torch.optim.Muon`` (Jordan et al. 2024) on the hidden matrices (the 2-D weight
  of every ``nn.Linear`` but the LM head) at ``lr · muon_lr_scale`` with ``weight_decay`` and
  ``optim.kwargs``; AdamW (``betas``, ``eps``, the decay groups) on the rest: the embedding,
  the LM head, norms, λ vectors, biases. This is the split of torch's Muon documentation and
  of Keller Jordan's reference code. Both run behind one :class:`CombinedOptimizer`.

Schedules (:class:`LRSchedule`): DIFF V1 §3.1's linear warmup to the peak over
``warmup_steps``, then linear decay to ``min_lr`` at the decay horizon (3.2e-4 → 1.28e-5 over
1T tokens at 3B); ``cosine`` is the common alternative, ``constant`` holds the peak, and ``wsd``
(warmup-stable-decay; MiniCPM, Hu et al. 2024; Hägele et al. 2024) holds the peak until a
final decay.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from diffattn.train.fields import ConfigError
from diffattn.train.sections import OptimSection, ScheduleSection

EMBEDDING_NAME = "embed_tokens.weight"
HEAD_NAME = "lm_head"
MUON = "muon"
REFUSED = {
    "lbfgs": "needs a closure that re-evaluates the loss at every step, which the trainer's "
    "step does not provide",
    "sparseadam": "takes sparse gradients only; the model's gradients are dense",
}
DEFAULTS = OptimSection()


def is_decayed(name: str, param: torch.Tensor, decay_embeddings: bool) -> bool:
    """Whether parameter ``name`` gets weight decay (see module docstring)."""
    if param.ndim < 2:  # norms, λ vectors, biases
        return False
    return decay_embeddings or not name.endswith(EMBEDDING_NAME)


def parameter_groups(
    model: nn.Module, weight_decay: float, decay_embeddings: bool = True
) -> list[dict]:
    """Two groups (decayed, not decayed) over the trainable parameters of ``model``.

    Each group carries ``lr_scale`` (1.0): the schedule sets ``lr = schedule(step) · lr_scale``,
    so a caller may add groups with their own scale.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return _decay_groups(named, weight_decay, decay_embeddings)


def _decay_groups(
    named: list[tuple[str, torch.Tensor]], weight_decay: float, decay_embeddings: bool
) -> list[dict]:
    decay, no_decay = [], []
    for name, param in named:
        (decay if is_decayed(name, param, decay_embeddings) else no_decay).append(param)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0})
    if not groups:
        raise ValueError("the model has no trainable parameters")
    return groups


# ----------------------------------------------------------------------------------------
# choosing the class
def optimizer_classes() -> dict[str, type]:
    """Every ``torch.optim`` optimizer class of the installed torch, by lower-case name."""
    found = {}
    for name in dir(torch.optim):
        value = getattr(torch.optim, name)
        if (
            isinstance(value, type)
            and issubclass(value, torch.optim.Optimizer)
            and value is not torch.optim.Optimizer
        ):
            found[name.lower()] = value
    return found


def optimizer_class(optim: OptimSection) -> type:
    """The class ``optim.name`` names (``muon``: ``torch.optim.Muon``); else ConfigError."""
    name = optim.name.strip().lower()
    if name == MUON:
        if not hasattr(torch.optim, "Muon"):
            raise ConfigError(
                "optim.name",
                f"muon needs torch.optim.Muon, which the installed torch {torch.__version__} "
                "does not have; upgrade torch or choose another optimizer",
            )
        return torch.optim.Muon
    classes = optimizer_classes()
    if name in REFUSED:
        raise ConfigError("optim.name", f"{classes[name].__name__} {REFUSED[name]}")
    if name not in classes:
        usable = sorted({MUON, *classes} - set(REFUSED))
        raise ConfigError(
            "optim.name",
            f"unknown optimizer {optim.name!r}; choose one of {', '.join(usable)} "
            "(torch.optim class names, case-insensitive)",
        )
    return classes[name]


def _signature(cls: type) -> dict[str, inspect.Parameter]:
    """The constructor's arguments beside ``self`` and ``params``."""
    parameters = dict(inspect.signature(cls.__init__).parameters)
    parameters.pop("self", None)
    parameters.pop("params", None)
    return parameters


def _takes(cls: type, name: str, form: Callable[[Any], bool]) -> bool:
    """Whether ``cls`` takes argument ``name`` in the form ``form`` accepts (by its default)."""
    parameter = _signature(cls).get(name)
    return parameter is not None and form(parameter.default)


def _is_number(value: Any) -> bool:
    return isinstance(value, float)


def _is_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(map(_is_number, value))


# ----------------------------------------------------------------------------------------
# the constructor's arguments
def constructor_arguments(optim: OptimSection, cls: type) -> dict[str, Any]:
    """The keyword arguments of ``cls`` (without ``params``): see the module docstring.

    For ``muon`` they are Muon's: ``betas`` and ``eps`` belong to its AdamW part.
    """
    muon = optim.name.strip().lower() == MUON
    arguments: dict[str, Any] = {"lr": optim.lr * (optim.muon_lr_scale if muon else 1.0)}
    for key, form in (("betas", _is_pair), ("eps", _is_number)):
        value = getattr(optim, key)
        if not muon and _takes(cls, key, form):
            arguments[key] = tuple(value) if key == "betas" else value
        elif not muon and value != getattr(DEFAULTS, key):
            raise ConfigError(f"optim.{key}", _cannot_take(cls, key))
    if "weight_decay" not in _signature(cls) and optim.weight_decay != 0.0:
        raise ConfigError(
            "optim.weight_decay",
            f"{cls.__name__} takes no weight_decay; set optim.weight_decay: 0",
        )
    if muon:
        arguments["weight_decay"] = optim.weight_decay
    elif optim.muon_lr_scale != DEFAULTS.muon_lr_scale:
        raise ConfigError("optim.muon_lr_scale", "only applies to optim.name: muon")
    arguments.update(_extra_arguments(optim, cls, set(arguments)))
    return arguments


def _cannot_take(cls: type, key: str) -> str:
    """Why ``cls`` cannot take ``optim.KEY`` (``betas`` or ``eps``)."""
    own = _signature(cls).get(key)
    if own is None:
        arguments = ", ".join(_signature(cls))
        return f"{cls.__name__} takes no {key}; remove optim.{key} (its arguments: {arguments})"
    form = "a pair of numbers" if key == "betas" else "a number"
    return (
        f"{cls.__name__}'s {key} is not {form} (its default: {own.default!r}); remove "
        f"optim.{key} and set optim.kwargs.{key}"
    )


def _extra_arguments(optim: OptimSection, cls: type, passed: set[str]) -> dict[str, Any]:
    """``optim.kwargs``, each an argument ``cls`` takes and the trainer does not pass."""
    accepted = _signature(cls)
    reserved = passed | {"params"} | ({"weight_decay"} & set(accepted))
    extra = {}
    for key, value in optim.kwargs.items():
        if key in reserved:
            where = "" if key == "params" else f"; set optim.{key} instead"
            raise ConfigError(f"optim.kwargs.{key}", f"the trainer passes {key} itself{where}")
        if key not in accepted:
            raise ConfigError(
                f"optim.kwargs.{key}",
                f"{cls.__name__} takes no argument {key!r}; it takes {', '.join(accepted)}",
            )
        extra[key] = tuple(value) if isinstance(value, list) else value
    return extra


def check_optimizer(optim: OptimSection) -> None:
    """Everything about ``optim``'s optimizer that can be checked without the model: the
    class, its arguments, and the class's own checks of their values (run on a 2×2 probe
    parameter, ``optim.kwargs`` added one at a time so that a refusal names its key). Each
    problem raises one :class:`ConfigError`."""
    cls = optimizer_class(optim)
    arguments = constructor_arguments(optim, cls)
    extra = [k for k in optim.kwargs if k in arguments]
    probe = nn.Parameter(torch.zeros(2, 2))
    for count in range(len(extra) + 1):
        trial = {k: v for k, v in arguments.items() if k not in extra[count:]}
        try:
            cls([probe], **trial)
        except (ValueError, TypeError, RuntimeError) as error:
            key = f"optim.kwargs.{extra[count - 1]}" if count else "optim.name"
            raise ConfigError(key, f"{cls.__name__} refuses it: {error}") from None


# ----------------------------------------------------------------------------------------
# building
def build_optimizer(model: nn.Module, optim: OptimSection) -> Any:
    """The optimizer ``optim`` describes over the trainable parameters of ``model`` (module
    docstring): a ``torch.optim.Optimizer``, or for ``muon`` a :class:`CombinedOptimizer`."""
    cls = optimizer_class(optim)
    arguments = constructor_arguments(optim, cls)
    if optim.name.strip().lower() == MUON:
        return _muon_with_adamw(model, optim, arguments)
    groups = parameter_groups(model, optim.weight_decay, optim.decay_embeddings)
    if "weight_decay" not in _signature(cls):
        for group in groups:
            del group["weight_decay"]
    return cls(groups, **arguments)


def hidden_matrices(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainable 2-D weights of ``model``'s ``nn.Linear`` layers but the LM head
    (``lm_head``, or what ``get_output_embeddings()`` returns): Muon's parameters."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is output:
            continue
        if name.rsplit(".", 1)[-1] == HEAD_NAME:
            continue
        weight = module.weight
        if weight.requires_grad and weight.ndim == 2:
            found.append((f"{name}.weight" if name else "weight", weight))
    return found


def _muon_with_adamw(
    model: nn.Module, optim: OptimSection, muon_arguments: dict[str, Any]
) -> CombinedOptimizer:
    """Muon on :func:`hidden_matrices`, AdamW on the other trainable parameters."""
    matrices = hidden_matrices(model)
    if not matrices:
        raise ConfigError(
            "optim.name",
            "muon: the model has no hidden matrices (2-D weights of nn.Linear layers besides "
            "the LM head) for Muon to train",
        )
    chosen = {id(param) for _, param in matrices}
    rest = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in chosen]
    muon_group = {
        "params": [param for _, param in matrices],
        "weight_decay": optim.weight_decay,
        "lr_scale": optim.muon_lr_scale,
    }
    optimizers = [torch.optim.Muon([muon_group], **muon_arguments)]
    if rest:
        groups = _decay_groups(rest, optim.weight_decay, optim.decay_embeddings)
        betas, eps = tuple(optim.betas), optim.eps
        optimizers.append(torch.optim.AdamW(groups, lr=optim.lr, betas=betas, eps=eps))
    return CombinedOptimizer(optimizers)


class CombinedOptimizer:
    """Several optimizers over disjoint parameters, used as one (``muon``: Muon and AdamW).

    For the trainer it behaves as a ``torch.optim.Optimizer``: :meth:`step`,
    :meth:`zero_grad`, :attr:`param_groups` (every optimizer's groups in order, the same
    dicts, so the schedule's ``lr = schedule(step) · lr_scale`` reaches each),
    :attr:`state`, and :meth:`state_dict` / :meth:`load_state_dict` in the single-optimizer
    format (parameter ids numbered on across the optimizers). It is also an iterable of its
    optimizers, which is how ``torch.distributed.checkpoint.state_dict``'s
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` take several optimizers: the
    checkpoint holds one state keyed by parameter names, as for one optimizer.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = tuple(optimizers)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {p: s for optimizer in self.optimizers for p, s in optimizer.state.items()}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every optimizer; ``closure`` (if any) is evaluated once, first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """One optimizer's format: ``state`` and ``param_groups``, ids counted on."""
        state, groups, offset = {}, [], 0
        for optimizer in self.optimizers:
            own = optimizer.state_dict()
            state.update({offset + i: value for i, value in own["state"].items()})
            for group in own["param_groups"]:
                groups.append({**group, "params": [offset + i for i in group["params"]]})
            offset += sum(len(g["params"]) for g in optimizer.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned; each optimizer takes its own groups."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state holds {len(groups)} parameter groups, this optimizer "
                f"{len(self.param_groups)}"
            )
        start = offset = 0
        for optimizer in self.optimizers:
            own = groups[start : start + len(optimizer.param_groups)]
            count = sum(len(g["params"]) for g in own)
            optimizer.load_state_dict(
                {
                    "state": {
                        i - offset: value
                        for i, value in state_dict["state"].items()
                        if offset <= i < offset + count
                    },
                    "param_groups": [
                        {**g, "params": [i - offset for i in g["params"]]} for g in own
                    ],
                }
            )
            start, offset = start + len(own), offset + count


# ----------------------------------------------------------------------------------------
# schedules
class LRSchedule:
    """``lr(step)`` for the 1-based optimizer step about to be taken.

    Warmup: ``peak · step / warmup_steps`` for ``step <= warmup_steps``. Then, with
    ``p = (step − warmup) / (horizon − warmup)`` clamped to [0, 1]:

    * ``linear``: ``peak − (peak − min_lr)·p``;
    * ``cosine``: ``min_lr + (peak − min_lr)·(1 + cos πp)/2``;
    * ``constant``: ``peak``.

    ``wsd`` (warmup-stable-decay) with a final decay of ``D`` steps (``decay_steps``, or
    ``decay_fraction · horizon`` rounded) that starts at ``S = horizon − D``: ``peak`` for
    ``warmup < step <= S`` (the stable phase); then, with ``q = (step − S) / D`` clamped to
    [0, 1], ``min_lr + (peak − min_lr)·f(q)`` where ``decay_shape`` picks ``f``:

    * ``linear``: ``f(q) = 1 − q``;
    * ``cosine``: ``f(q) = (1 + cos πq)/2``;
    * ``sqrt``: ``f(q) = 1 − √q`` (the "1-sqrt" cooldown of Hägele et al. 2024).

    Every shape reaches ``min_lr`` at the horizon and holds it afterwards. A pure function of
    the step, so resuming needs only the step.
    """

    def __init__(self, peak: float, schedule: ScheduleSection, horizon: int) -> None:
        self.peak = float(peak)
        self.warmup = int(schedule.warmup_steps)
        self.decay = schedule.decay
        self.min_lr = float(schedule.min_lr)
        self.horizon = int(horizon)
        self.decay_steps = schedule.wsd_decay_steps(self.horizon) if self.decay == "wsd" else 0
        self.decay_shape = schedule.decay_shape

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"optimizer steps count from 1, got {step}")
        if self.warmup and step <= self.warmup:
            return self.peak * step / self.warmup
        if self.decay == "constant":
            return self.peak
        if self.decay == "wsd":
            return self._wsd(step)
        span = max(1, self.horizon - self.warmup)
        progress = min(1.0, max(0.0, (step - self.warmup) / span))
        if self.decay == "linear":
            return self.peak - (self.peak - self.min_lr) * progress
        return self.min_lr + (self.peak - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def _wsd(self, step: int) -> float:
        """The stable and decay phases of ``wsd`` (after the warmup)."""
        start = self.horizon - self.decay_steps
        if step <= start:
            return self.peak
        q = min(1.0, (step - start) / max(1, self.decay_steps))
        if self.decay_shape == "linear":
            factor = 1.0 - q
        elif self.decay_shape == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * q))
        else:
            factor = 1.0 - math.sqrt(q)
        return self.min_lr + (self.peak - self.min_lr) * factor

    def apply(self, optimizer: Any, step: int) -> float:
        """Set every group's learning rate for ``step``; returns the base rate."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr

    def state_dict(self) -> dict:
        """The schedule's settings (``wsd``'s decay length and shape only for ``wsd``, so a
        checkpoint of another schedule compares equal)."""
        state = {
            "peak": self.peak,
            "warmup": self.warmup,
            "decay": self.decay,
            "min_lr": self.min_lr,
            "horizon": self.horizon,
        }
        if self.decay == "wsd":
            state.update(decay_steps=self.decay_steps, decay_shape=self.decay_shape)
        return state

    def describe_changes(self, saved: dict) -> list[str]:
        """Entries of a saved :meth:`state_dict` that differ from this schedule."""
        now = self.state_dict()
        return [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k]]
