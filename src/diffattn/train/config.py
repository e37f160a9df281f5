"""Training configuration: one validated dataclass tree, read from a YAML recipe.

A recipe (``configs/*.yaml``) is a mapping with the sections ``model``, ``data``, ``optim``
and ``schedule`` plus top-level run settings. ``base: FILE`` builds it on another recipe (a
path relative to the recipe's directory), whose mapping it deep-merges over
(:func:`read_recipe`). ``--set key.sub=value`` then overrides any entry, the value being parsed
as a YAML scalar (``--set optim.lr=3e-4``, ``--set model.n_layers=4``,
``--set optim.betas=[0.9,0.98]``).

Everything is checked before any work starts. :func:`load_config` and
:meth:`TrainConfig.from_dict` check keys, types and the combinations that need nothing but the
config; :func:`check_runtime` adds the checks that depend on the launch (world size, CUDA,
optional packages). Each problem raises one :class:`ConfigError` whose ``key`` names the
offending entry (``optim.lr``, ``global_batch_size``, ...).

Defaults follow DIFF V1 (Ye et al., ICLR 2025): AdamW with β = (0.9, 0.95), weight decay 0.1,
warmup then linear decay to a floor (§3.1, App. D, Table 9).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from diffattn import presets
from diffattn.config import ATTENTION_TYPES, ModelConfig
from diffattn.train.fields import ConfigError, _build_dataclass, _require_mapping
from diffattn.train.recipe_files import (  # re-exported: the recipe API lives here too
    BASE_KEY,
    apply_overrides,
    merge_recipes,
    read_recipe,
    yaml_error_text,
)
from diffattn.train.runtime import check_runtime
from diffattn.train.sections import (  # re-exported
    DECAY_SHAPES,
    DECAYS,
    OptimSection,
    ScheduleSection,
)

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "fp32", "bf16"]
Parallel = Literal["none", "ddp", "fsdp"]
FsdpInit = Literal["rank0", "sharded"]
ActivationCheckpointing = Literal["none", "full", "selective"]
CheckpointFormat = Literal["auto", "full", "sharded"]

DEVICES: tuple[str, ...] = get_args(Device)
DTYPES: tuple[str, ...] = get_args(Dtype)
PARALLEL_MODES: tuple[str, ...] = get_args(Parallel)

# ModelConfig fields a recipe may override under ``model:`` (``attention`` has its own key).
_MODEL_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("attention", "extra")
)
# The model section's own keys, beside the ModelConfig fields.
_MATCH_KEYS = ("match_multiple_of", "match_params")
_SECTION_KEYS = ("preset", "attention", *_MATCH_KEYS)
SECTIONS = ("model", "data", "optim", "schedule")
"""The recipe's sections: mappings of entries. One left empty (null) changes nothing: over a
base recipe's it keeps the base's (:func:`merge_recipes`), alone it is the defaults."""


# ----------------------------------------------------------------------------------------
# sections
@dataclass
class ModelSection:
    """Which model to train: a preset, its attention type and field overrides.

    In YAML the overrides sit next to ``preset`` and ``attention``
    (``model: {preset: tiny, attention: diff_v1, n_layers: 4}``); any
    :class:`~diffattn.ModelConfig` field may be overridden.
    """

    preset: str = "tiny"
    attention: str = "baseline"
    match_params: bool = False
    """DIFF V2 only: narrow the SwiGLU so the parameter count matches the baseline."""
    match_multiple_of: int | None = None
    """The multiple the matched SwiGLU width keeps (``presets.match_v2_params``); ``None``:
    the model's ``ffn_multiple_of`` (64). Read only by runs with ``match_params``."""
    overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, prefix: str = "model.") -> ModelSection:
        data = _require_mapping(data, prefix.rstrip("."))
        own = {k: data[k] for k in _SECTION_KEYS if k in data}
        rest = {k: v for k, v in data.items() if k not in own}
        if "overrides" in rest:
            raise ConfigError(
                f"{prefix}overrides",
                "write ModelConfig overrides directly under model: (e.g. model.n_layers)",
            )
        unknown = sorted(set(rest) - set(_MODEL_FIELDS))
        if unknown:
            raise ConfigError(
                f"{prefix}{unknown[0]}",
                f"unknown key; model takes {', '.join(_SECTION_KEYS)} and the "
                f"ModelConfig fields {', '.join(_MODEL_FIELDS)}",
            )
        section = _build_dataclass(cls, own, prefix)
        section.overrides = dict(rest)
        return section

    def to_dict(self) -> dict[str, Any]:
        own = {
            "preset": self.preset,
            "attention": self.attention,
            "match_params": self.match_params,
        }
        if self.match_multiple_of is not None:
            own["match_multiple_of"] = self.match_multiple_of
        return {**own, **self.overrides}

    def build(self) -> ModelConfig:
        """The validated :class:`ModelConfig`; a bad field raises :class:`ConfigError`."""
        if self.preset not in presets.names():
            raise ConfigError(
                "model.preset",
                f"unknown preset {self.preset!r}; available: {', '.join(presets.names())}",
            )
        if self.match_multiple_of is not None and self.match_multiple_of <= 0:
            raise ConfigError(
                "model.match_multiple_of",
                f"must be a positive integer or null, got {self.match_multiple_of}",
            )
        try:
            return presets.get(
                self.preset,
                attention=self.attention,
                match_params=self.match_params,
                match_multiple_of=self.match_multiple_of if self.match_params else None,
                **self.overrides,
            )
        except ValueError as error:
            message = str(error)
            match = re.match(r"ModelConfig\.(\w+): (.*)", message, flags=re.S)
            if match:
                raise ConfigError(f"model.{match.group(1)}", match.group(2)) from None
            key = next((f"model.{k}" for k in _MATCH_KEYS if k in message), "model")
            raise ConfigError(key, message) from None


@dataclass
class TrainConfig:
    """Everything one training run needs; see ``docs/training.md`` for each entry."""

    model: ModelSection = field(default_factory=ModelSection)
    data: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of :class:`diffattn.data.DataConfig`."""
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    steps: int = 1000
    """Optimizer steps to reach (a resumed run continues up to this step)."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward on one rank; ``null`` means global / world size.
    Gradient accumulation = global / (micro × world)."""
    seq_len: int = 256
    seed: int = 0
    device: Device = "auto"
    dtype: Dtype = "auto"
    """``auto``: bf16 autocast on CUDA, fp32 on CPU; ``bf16``: bf16 autocast on either (under
    FSDP2 with ``fsdp_mixed_precision``, also bf16 parameters in compute and all-gathers)."""
    compile: bool = False
    """``torch.compile`` each decoder block."""
    document_masking: bool = False
    """Attend only within each document of a window (documents end with EOS; RoPE restarts and
    no loss target crosses a boundary), as packed fine-tuning does. ``false`` (the papers'
    pretraining, and the default) attends across the concatenated stream."""
    activation_checkpointing: ActivationCheckpointing | bool = "none"
    """``full`` (or ``true``): recompute every decoder block in backward; ``selective``: see
    ``selective_ac``; ``none`` (or ``false``): keep every activation
    (:mod:`diffattn.train.activation_checkpointing`)."""
    selective_ac: str | int = "op"
    """With ``activation_checkpointing: selective``: ``op`` keeps the outputs of the matrix
    multiplications and attention kernels and recomputes the element-wise work of every block;
    an integer ``k`` recomputes every k-th block in full."""
    fsdp_mixed_precision: bool = True
    """Under FSDP2 with ``dtype: bf16`` (or ``auto`` on CUDA): parameters all-gathered and used
    in bf16, gradients reduced in fp32, fp32 master weights and optimizer state
    (``MixedPrecisionPolicy``); ``false`` all-gathers fp32 weights."""
    checkpoint_format: CheckpointFormat = "auto"
    """``full``: rank 0 gathers and writes one model directory per checkpoint; ``sharded``:
    each rank writes its shards with DCP (:mod:`diffattn.train.sharded`); ``auto``: sharded
    under FSDP2 (``parallel: fsdp``) for preset models, full otherwise."""
    async_checkpoint: bool = False
    """Sharded checkpoints only: write in the background while training continues."""
    parallel: Parallel = "none"
    tp: int = 1
    """Tensor-parallel degree: each model is split by KV groups over this many consecutive
    ranks (``diffattn.train.tensor_parallel``). With ``parallel: none`` the launch has exactly
    ``tp`` processes; with ``parallel: fsdp`` the world forms a 2-D mesh
    ``(world / tp, tp)``, FSDP2 sharding over the first dimension."""
    cp: int = 1
    """Context-parallel degree: each row's sequence is split over this many consecutive ranks,
    which hold the same rows (:mod:`diffattn.train.context_parallel`: chunks i and 2·cp − 1 − i
    of 2·cp per rank, keys and values all-gathered in every layer). With ``parallel: ddp`` or
    ``fsdp``, which then reduce gradients over the data-parallel and context-parallel ranks
    together; ``seq_len`` a multiple of 2·cp; every layer's attention type able to split. With
    ``tp`` (FSDP2) a context-parallel group is the ranks of one tensor-parallel index."""
    fsdp_init: FsdpInit = "rank0"
    """FSDP2 initial weights: ``rank0`` builds the full model once on rank 0's CPU and
    broadcasts it, giving exactly the weights of a single-process run with the same seed;
    ``sharded`` initialises each shard in place (no full copy anywhere)."""
    log_every: int = 10
    eval_every: int = 0
    """Validation loss every this many steps and at the end; 0 turns it off."""
    eval_batches: int = 8
    eval_batch_size: int | None = None
    """Sequences per validation batch (split over ranks, run in micro batches); ``null``
    means ``global_batch_size``. The validation windows do not depend on the launch."""
    checkpoint_every: int = 0
    """0: checkpoint only at the end (and on SIGINT/SIGTERM)."""
    keep_last: int | None = 3
    """Checkpoints kept; ``null`` keeps all."""
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "diffattn"
    run_name: str | None = None
    spike_factor: float = 2.0
    """A step's loss above ``spike_factor`` × the running median counts as a loss spike."""
    spike_window: int = 50
    init_from: str | None = None
    """A diffattn model directory (a checkpoint of another run, or a saved model) whose
    weights this run starts from, at step 0 with a fresh optimizer and schedule. The recipe's
    model must have the same architecture; only ``rope_theta`` and ``max_seq_len`` may differ
    (context extension, DIFF V1 §3.3). Ignored when resuming this run's own checkpoint."""

    # ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any) -> TrainConfig:
        """Build and validate; the first problem raises :class:`ConfigError`."""
        data = _require_mapping(data, "config")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(unknown[0], f"unknown key; valid keys are {', '.join(known)}")
        # a section left empty (null: its entries all commented out) is its defaults
        values = {k: v for k, v in data.items() if not (v is None and k in SECTIONS)}
        model = ModelSection.from_dict(values.pop("model", {}))
        config = _build_dataclass(cls, values, "")
        config.model = model
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        """A plain, YAML-ready mapping that :meth:`from_dict` reads back."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "model":
                out[f.name] = value.to_dict()
            elif dataclasses.is_dataclass(value):
                out[f.name] = {
                    k: list(v) if isinstance(v, tuple) else v
                    for k, v in dataclasses.asdict(value).items()
                }
            elif isinstance(value, dict):
                out[f.name] = dict(value)
            else:
                out[f.name] = value
        return out

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with top-level ``changes``."""
        return TrainConfig.from_dict({**self.to_dict(), **changes})

    def _validate_checkpointing(self) -> None:
        """Activation checkpointing and checkpoint-format entries (normalises booleans)."""
        if isinstance(self.activation_checkpointing, bool):
            self.activation_checkpointing = "full" if self.activation_checkpointing else "none"
        choice = self.selective_ac
        if isinstance(choice, bool) or not (
            choice == "op" or (isinstance(choice, int) and choice >= 1)
        ):
            raise ConfigError(
                "selective_ac", f"expected 'op' or a block interval k >= 1, got {choice!r}"
            )
        if choice != "op" and self.activation_checkpointing != "selective":
            raise ConfigError(
                "selective_ac",
                f"{choice!r} applies only with activation_checkpointing: selective, not "
                f"{self.activation_checkpointing}; set activation_checkpointing: selective, or "
                "leave selective_ac out",
            )
        if self.async_checkpoint and self.checkpoint_format == "full":
            raise ConfigError(
                "async_checkpoint",
                "needs sharded checkpoints (checkpoint_format: sharded or auto under fsdp); "
                "a full checkpoint is gathered and written by rank 0",
            )

    # ------------------------------------------------------------------------------------
    @property
    def decay_horizon(self) -> int:
        return self.schedule.total_steps or self.steps

    def model_config(self) -> ModelConfig:
        return self.model.build()

    def data_config(self) -> Any:
        """The :class:`diffattn.data.DataConfig` of ``data`` (validated)."""
        try:
            from diffattn.data import DataConfig
        except ImportError as error:
            raise ConfigError(
                "data", f"the diffattn.data package is unavailable ({error})"
            ) from None
        try:
            return DataConfig.from_dict(dict(self.data))
        except ConfigError:
            raise
        except (ValueError, TypeError) as error:
            message = str(error)
            field_match = re.match(r"DataConfig\.(\w+): (.*)", message, flags=re.S)
            if field_match:
                raise ConfigError(f"data.{field_match.group(1)}", field_match.group(2)) from None
            unknown = re.search(r"unknown key\(s\) '([^']+)'", message)
            key = f"data.{unknown.group(1)}" if unknown else "data"
            raise ConfigError(key, message) from None

    def validate(self) -> None:
        """Checks that need only the config (no launch environment)."""
        positive = ("steps", "global_batch_size", "seq_len", "log_every", "eval_batches")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("micro_batch_size", "eval_batch_size", "keep_last"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(name, f"must be >= 1 or null, got {value}")
        for name in ("eval_every", "checkpoint_every", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ConfigError(
                "seq_len", f"must be >= 2 (inputs and shifted labels), got {self.seq_len}"
            )
        mb = self.micro_batch_size
        if mb is not None:
            if mb > self.global_batch_size:
                raise ConfigError(
                    "micro_batch_size",
                    f"{mb} is larger than global_batch_size={self.global_batch_size}",
                )
            if self.global_batch_size % mb:
                raise ConfigError(
                    "global_batch_size",
                    f"{self.global_batch_size} is not divisible by micro_batch_size={mb}",
                )
        self._validate_optim()
        self._validate_schedule()
        if self.spike_factor <= 1.0:
            raise ConfigError("spike_factor", f"must be > 1, got {self.spike_factor}")
        if self.spike_window < 3:
            raise ConfigError("spike_window", f"must be >= 3, got {self.spike_window}")
        self._validate_checkpointing()
        if self.parallel != "fsdp" and self.fsdp_init != "rank0":
            raise ConfigError("fsdp_init", "only applies to parallel: fsdp")
        self._validate_tp()
        self._validate_cp()
        if self.init_from is not None and not self.init_from.strip():
            raise ConfigError("init_from", "must be a model directory or null, got ''")
        model = self.model_config()
        if self.seq_len > model.max_seq_len:
            raise ConfigError(
                "seq_len",
                f"{self.seq_len} exceeds the model's max_seq_len={model.max_seq_len} "
                "(raise model.max_seq_len)",
            )
        self.data_config()

    def _validate_tp(self) -> None:
        from diffattn.train.tensor_parallel import tp_problem

        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError("tp", f"must be an integer >= 1, got {self.tp!r}")
        if self.tp > 1 and self.parallel == "ddp":
            raise ConfigError(
                "tp", "combines with parallel: none or fsdp (a 2-D mesh), not with ddp"
            )
        problem = tp_problem(self.model_config(), self.tp)
        if problem is not None:
            raise ConfigError("tp", problem)

    def _validate_cp(self) -> None:
        from diffattn.train.context_parallel import recipe_problem

        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise ConfigError("cp", f"must be an integer >= 1, got {self.cp!r}")
        problem = recipe_problem(self, self.model_config())
        if problem is not None:
            raise ConfigError("cp", problem)

    def _validate_optim(self) -> None:
        o = self.optim
        if not 0.0 < o.lr < math.inf:
            raise ConfigError("optim.lr", f"must be a positive finite number, got {o.lr}")
        if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
            raise ConfigError("optim.betas", f"must be two numbers in [0, 1), got {list(o.betas)}")
        if not o.eps > 0.0:
            raise ConfigError("optim.eps", f"must be > 0, got {o.eps}")
        if not o.weight_decay >= 0.0:
            raise ConfigError("optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
        if o.clip is not None and not o.clip >= 0.0:
            raise ConfigError("optim.clip", f"must be >= 0 or null, got {o.clip}")
        if not 0.0 < o.muon_lr_scale < math.inf:
            raise ConfigError(
                "optim.muon_lr_scale", f"must be a positive finite number, got {o.muon_lr_scale}"
            )
        _require_mapping(o.kwargs, "optim.kwargs")
        from diffattn.train.optim import check_optimizer

        check_optimizer(o)

    def _validate_schedule(self) -> None:
        s = self.schedule
        if s.warmup_steps < 0:
            raise ConfigError("schedule.warmup_steps", f"must be >= 0, got {s.warmup_steps}")
        if s.total_steps is not None and s.total_steps < 1:
            raise ConfigError("schedule.total_steps", f"must be >= 1 or null, got {s.total_steps}")
        if s.warmup_steps > self.decay_horizon:
            name = "total_steps" if s.total_steps is not None else "steps"
            raise ConfigError(
                "schedule.warmup_steps",
                f"{s.warmup_steps} warmup steps exceed the {self.decay_horizon} "
                f"steps of the schedule ({name})",
            )
        if not 0.0 <= s.min_lr <= self.optim.lr:
            raise ConfigError(
                "schedule.min_lr", f"must lie in [0, optim.lr={self.optim.lr}], got {s.min_lr}"
            )
        if s.decay == "wsd":
            self._validate_wsd()
            return
        for name in ("decay_steps", "decay_fraction"):
            if getattr(s, name) is not None:
                raise ConfigError(f"schedule.{name}", "only applies to decay: wsd")
        if s.decay_shape != "linear":
            raise ConfigError(
                "schedule.decay_shape", "only applies to decay: wsd (the shape of its last phase)"
            )

    def _validate_wsd(self) -> None:
        """``decay: wsd``: one final decay of at least one step, after the warmup."""
        s, horizon = self.schedule, self.decay_horizon
        if s.decay_steps is None and s.decay_fraction is None:
            raise ConfigError(
                "schedule.decay_steps",
                "decay: wsd needs decay_steps or decay_fraction (the length of the final decay)",
            )
        if s.decay_steps is not None and s.decay_fraction is not None:
            raise ConfigError(
                "schedule.decay_fraction", "set decay_steps or decay_fraction, not both"
            )
        key = "schedule.decay_steps" if s.decay_steps is not None else "schedule.decay_fraction"
        if s.decay_steps is not None and s.decay_steps < 1:
            raise ConfigError(key, f"must be >= 1, got {s.decay_steps}")
        if s.decay_fraction is not None and not 0.0 < s.decay_fraction <= 1.0:
            raise ConfigError(key, f"must lie in (0, 1], got {s.decay_fraction}")
        steps = s.wsd_decay_steps(horizon)
        if steps < 1:
            raise ConfigError(
                key, f"{s.decay_fraction} of the {horizon} steps of the schedule is 0 steps"
            )
        if steps > horizon - s.warmup_steps:
            raise ConfigError(
                key,
                f"a final decay of {steps} steps overlaps the warmup: the schedule's {horizon} "
                f"steps less {s.warmup_steps} warmup steps leave {horizon - s.warmup_steps}",
            )


OTHER_COMMANDS_SECTIONS = {"retrieval": "diffattn compare's retrieval experiment"}
"""Top-level sections a recipe may hold for another command, not for training (``compare.yaml``
is a training recipe plus its ``retrieval:`` section): :func:`load_config` leaves them out and
says so; :meth:`TrainConfig.from_dict` refuses them as any unknown key."""


def load_config(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    notes: list[str] | None = None,
) -> TrainConfig:
    """Read a YAML recipe with its bases (:func:`read_recipe`), apply ``key.sub=value``
    overrides, validate.

    A section of :data:`OTHER_COMMANDS_SECTIONS` is left out with a note: appended to
    ``notes``, or a ``UserWarning`` without it."""
    data = apply_overrides(read_recipe(path), overrides)
    for key, owner in OTHER_COMMANDS_SECTIONS.items():
        if isinstance(data, dict) and key in data:
            del data[key]
            note = f"the recipe's {key}: section is {owner}; training leaves it out"
            if notes is None:
                warnings.warn(note, UserWarning, stacklevel=2)
            else:
                notes.append(note)
    return TrainConfig.from_dict(data)


def dump_config(config: TrainConfig) -> str:
    """The resolved config as YAML text."""
    import yaml

    return yaml.safe_dump(config.to_dict(), sort_keys=False)


__all__ = [
    "ATTENTION_TYPES",
    "BASE_KEY",
    "DECAYS",
    "DECAY_SHAPES",
    "DEVICES",
    "DTYPES",
    "OTHER_COMMANDS_SECTIONS",
    "PARALLEL_MODES",
    "SECTIONS",
    "ConfigError",
    "ModelSection",
    "OptimSection",
    "ScheduleSection",
    "TrainConfig",
    "apply_overrides",
    "check_runtime",
    "dump_config",
    "load_config",
    "merge_recipes",
    "read_recipe",
    "yaml_error_text",
]
