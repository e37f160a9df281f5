"""Where a training run starts: fresh in its output directory, or from one of its checkpoints.

Rank 0 makes the :class:`StartPlan` before the run writes anything, and every rank learns it.
``resume`` is ``False`` (a fresh start; the output directory must be empty, this run's own
start, or replaced with ``overwrite``), ``True`` (the newest checkpoint; with
``resume_fallback`` the newest one whose files are whole) or a step (that step's checkpoint;
the newer ones are set aside in ``OUT/superseded/``, never deleted, so ``latest`` and a later
``--resume`` follow the continued run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diffattn import fileio
from diffattn.config import ModelConfig
from diffattn.train import checkpoint as ckpt
from diffattn.train.config import TrainConfig, dump_config, yaml_error_text

CONFIG_COPY_NAME = "config.yaml"
FACTORY_MARKER_NAME = "factory.json"
SUPERSEDED_DIRNAME = "superseded"

# Entries that must match the checkpoint for the data order to continue exactly.
RESUME_FIXED_KEYS = ("data", "seq_len", "global_batch_size", "seed")
# Entries that may change on resume without any effect on the numbers.
RESUME_FREE_KEYS = frozenset(
    {
        "steps",
        "log_every",
        "eval_every",
        "eval_batches",
        "eval_batch_size",
        "checkpoint_every",
        "keep_last",
        "tensorboard",
        "wandb",
        "wandb_project",
        "run_name",
        "device",
        "dtype",
        "compile",
        "activation_checkpointing",
        "selective_ac",
        "fsdp_mixed_precision",
        "checkpoint_format",
        "async_checkpoint",
        "parallel",
        "tp",
        "fsdp_init",
        "micro_batch_size",
        "spike_factor",
        "spike_window",
    }
)


@dataclass
class StartPlan:
    """How the run starts (see the module docstring)."""

    checkpoint: Path | None = None
    error: tuple[str, str] | None = None
    """``(config key, message)`` of a refused start."""
    notes: list[str] = field(default_factory=list)
    clear: bool = False
    """Remove the output directory's old contents before writing (``overwrite``, or a restart
    of this run that saved nothing)."""
    messages: list[str] = field(default_factory=list)
    """Shown even with ``--quiet``: the run differs from what was asked (a fallback)."""
    superseded: list[Path] = field(default_factory=list)
    """Checkpoints newer than the resumed step, to be set aside."""


def _refused(key: str, message: str) -> StartPlan:
    return StartPlan(error=(key, message))


def _own_fresh_run(out: Path, config: TrainConfig) -> bool:
    """True when ``out`` is this run's own directory from a start that saved no checkpoint:
    its ``config.yaml`` is the resolved recipe of ``config``."""
    copy = out / CONFIG_COPY_NAME
    try:
        return copy.is_file() and copy.read_text(encoding="utf-8") == dump_config(config)
    except (OSError, UnicodeDecodeError):
        return False


def _fresh_start(config: TrainConfig, out: Path, overwrite: bool) -> StartPlan:
    """The output-directory rule of a run that does not resume: ``out`` must be absent or
    empty, or hold this same run's start without a checkpoint (its ``config.yaml`` is this
    recipe), or be replaced with ``overwrite``."""
    root = out / ckpt.CHECKPOINTS_DIRNAME
    if not overwrite and out.is_dir() and ckpt.list_checkpoints(root):
        return _refused(
            "out",
            f"{out} already holds checkpoints; pass --resume to continue that run, "
            "--overwrite to replace it, or choose another output directory",
        )
    try:
        fileio.check_output_directory(
            out,
            overwrite,
            own=_own_fresh_run(out, config),
            hint="it holds files of another run; pass --resume to continue a run, "
            "--overwrite to replace it, or choose another output directory",
        )
    except fileio.CheckpointError as error:
        return _refused("out", str(error))
    return StartPlan(clear=out.is_dir() and any(out.iterdir()))


def _problem(path: Path, model_config: ModelConfig | None) -> str | None:
    """Why the checkpoint ``path`` cannot be resumed from (a file is missing, cut off or
    unreadable), or ``None``; reads headers and shard metadata only, not the tensors."""
    return ckpt.checkpoint_problem(path, diffattn_model=model_config is not None)


def _choose_step(root: Path, step: int, model_config: ModelConfig | None) -> StartPlan:
    """``--resume STEP``: that checkpoint, whole, and the newer ones to set aside."""
    found = dict(ckpt.list_checkpoints(root))
    if step not in found:
        steps = ", ".join(map(str, sorted(found))) or "none"
        return _refused("resume", f"no checkpoint of step {step} in {root} (its steps: {steps})")
    problem = _problem(found[step], model_config)
    if problem is not None:
        return _refused("resume", f"the checkpoint of step {step} is unusable: {problem}")
    newer = [path for s, path in sorted(found.items()) if s > step]
    notes = [f"checkpoints after step {step} are set aside in {SUPERSEDED_DIRNAME}/"] * bool(newer)
    return StartPlan(checkpoint=found[step], superseded=newer, notes=notes)


def _choose_newest(root: Path, fallback: bool, model_config: ModelConfig | None) -> StartPlan:
    """``--resume``: the newest checkpoint; with ``fallback`` the newest whole one."""
    candidates = [path for _, path in reversed(ckpt.list_checkpoints(root))]
    if not candidates:
        return _refused("resume", f"no checkpoint found in {root}; start without --resume")
    skipped = []
    for candidate in candidates:
        problem = _problem(candidate, model_config)
        if problem is None:  # one line: what was skipped, why, and where the run resumes
            messages = ["; ".join([*skipped, f"resuming from {candidate}"])] if skipped else []
            return StartPlan(checkpoint=candidate, messages=messages)
        if not fallback:
            return _refused(
                "resume",
                f"the newest checkpoint is unusable: {problem}; pass --resume-fallback to "
                "resume from the newest valid checkpoint instead",
            )
        skipped.append(f"skipped {candidate.name}: {problem}")
    return _refused("resume", f"no valid checkpoint in {root}: " + "; ".join(skipped))


def _same_model(found: Path, model_config: ModelConfig | None) -> tuple[str, str] | None:
    """Why the checkpoint holds another model than this run's, or ``None``.
    ``model_config=None`` marks a ``model_factory`` run."""
    factory_checkpoint = (found / FACTORY_MARKER_NAME).is_file()
    if (model_config is None) != factory_checkpoint:
        kind = "a model_factory" if factory_checkpoint else "a preset"
        return "resume", f"the checkpoint {found} belongs to {kind} run"
    if model_config is None:
        return None
    try:
        saved_model = ckpt.read_checkpoint_model_config(found)
    except ValueError as error:
        return "resume", str(error)
    diffs = ckpt.model_config_differences(saved_model, model_config)
    if diffs:
        key = "model." + diffs[0].split(":", 1)[0]
        return key, f"the checkpoint {found} has a different model: " + "; ".join(diffs)
    return None


def _same_recipe(found: Path, config: TrainConfig) -> tuple[tuple[str, str] | None, list[str]]:
    """``(refusal or None, notes)``: the entries of the checkpoint's recipe that must match
    (:data:`RESUME_FIXED_KEYS`) and those that changed."""
    import yaml

    saved_path = found / ckpt.CONFIG_YAML_NAME
    if not saved_path.is_file():
        return None, []
    try:
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        problem = yaml_error_text(error) if isinstance(error, yaml.YAMLError) else error
        return ("resume", f"{saved_path}: not a readable YAML recipe ({problem})"), []
    if not isinstance(saved, dict):
        return ("resume", f"{saved_path}: not a recipe mapping"), []
    now = config.to_dict()
    for key in RESUME_FIXED_KEYS:
        if key in saved and saved[key] != now[key]:
            message = (
                f"differs from the checkpoint {found} ({saved[key]!r} there, {now[key]!r} now); "
                "an exact resume needs the same data, seq_len, global_batch_size and seed"
            )
            return (key, message), []
    notes = []
    for key in now:
        checked = key in RESUME_FREE_KEYS or key in RESUME_FIXED_KEYS or key == "model"
        if key in saved and not checked and saved[key] != now[key]:
            notes.append(f"{key} changed since the checkpoint: {saved[key]!r} -> {now[key]!r}")
    return None, notes


def plan_start(
    config: TrainConfig,
    model_config: ModelConfig | None,
    out: Path,
    resume: bool | int,
    overwrite: bool = False,
    resume_fallback: bool = False,
) -> StartPlan:
    """How the run starts (see the module docstring); ``model_config=None`` marks a
    ``model_factory`` run, whose checkpoints only it can resume."""
    if resume is not False and overwrite:
        return _refused("resume", "--resume and --overwrite exclude each other")
    if resume is False:
        return _fresh_start(config, out, overwrite)
    root = out / ckpt.CHECKPOINTS_DIRNAME
    if resume is True:
        plan = _choose_newest(root, resume_fallback, model_config)
    else:
        plan = _choose_step(root, int(resume), model_config)
    if plan.error is not None:
        return plan
    plan.error = _same_model(plan.checkpoint, model_config)
    if plan.error is None:
        plan.error, notes = _same_recipe(plan.checkpoint, config)
        plan.notes.extend(notes)
    return plan


def set_aside(out: Path, checkpoints: list[Path]) -> list[Path]:
    """Move ``checkpoints`` (newer than the resumed step) to ``OUT/superseded/``, each under a
    name no earlier move used; returns the new paths."""
    holder = out / SUPERSEDED_DIRNAME
    holder.mkdir(exist_ok=True)
    moved = []
    for path in checkpoints:
        target, n = holder / path.name, 1
        while target.exists():
            target, n = holder / f"{path.name}.{n}", n + 1
        path.rename(target)
        moved.append(target)
    return moved
