"""The runs of a scaling sweep: sizes (Fig 3a) or token counts (Fig 3b) × arms.

The arms are those of ``diffattn compare`` (:mod:`diffattn.compare.arms`): any registered
attention type, or an ablation of one (``TYPE:option=value,...``), each at the baseline's
parameter count (a type that ``matches_by_ffn``, as DIFF V2, with its SwiGLU narrowed); the
baseline is the arm the others are fitted against.

A size is ``PRESET``, ``PRESET:key=value,...`` or ``key=value,...`` (model fields over the
recipe's preset), e.g. ``tiny:d_model=64,n_heads=4``. Every run of a sweep starts from the
same recipe, reads the same tokens in the same order and uses the same seed; only the model
(params axis) or the step count (tokens axis) changes.

Tokens axis: as in DIFF V1 §3.2 (Fig 3b: the 3B models "evaluated every 40B tokens"), each
attention type is trained once, to the largest token count, on that run's learning-rate
schedule, and its validation loss is read at every requested count. Token counts are rounded
to whole steps of ``global_batch_size × seq_len`` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

from diffattn.compare.arms import REFERENCE, matched_config, parse_arms
from diffattn.settings import Settings, progress_switch, setting
from diffattn.train.cli import recipe_overrides

ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
"""The default arms: the papers' three types."""
AXES = ("params", "tokens")
COUNTS = ("non_embedding", "total")


@dataclass(frozen=True)
class Size:
    """One model size of a sweep: a preset and model-field overrides."""

    label: str
    preset: str | None
    overrides: tuple[tuple[str, Any], ...] = ()

    def as_overrides(self) -> list[str]:
        items = [f"model.preset={self.preset}"] if self.preset else []
        return items + [f"model.{key}={value}" for key, value in self.overrides]


def parse_size(spec: str) -> Size:
    """``PRESET``, ``PRESET:k=v,k=v`` or ``k=v,k=v`` -> :class:`Size` (ValueError if bad)."""
    import yaml

    text = spec.strip()
    if not text:
        raise ValueError("--sizes: an empty size; give a preset name or key=value,...")
    preset, fields = (text, "") if "=" not in text else ("", text)
    if ":" in text:
        preset, _, fields = text.partition(":")
    overrides = []
    for item in filter(None, (part.strip() for part in fields.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--sizes {spec!r}: expected key=value, got {item!r}")
        overrides.append((key.strip(), yaml.safe_load(raw)))
    label = text.replace(":", "-").replace(",", "-").replace("=", "")
    return Size(label=label, preset=preset.strip() or None, overrides=tuple(overrides))


@dataclass
class PlannedRun:
    """One training run and the points it gives."""

    attention: str
    """The arm's name (:attr:`diffattn.compare.arms.Arm.name`)."""
    name: str
    """Directory name under ``OUT/runs``."""
    config: Any
    """The run's :class:`~diffattn.train.TrainConfig`."""
    size: str
    parameters: int
    non_embedding: int
    points: list[tuple[int, float]] = field(default_factory=list)
    """(step, x) for every point read from this run: the final step for the params axis,
    every requested token count for the tokens axis."""


@dataclass
class ScalingOptions(Settings):
    """What ``diffattn scaling`` runs, each option declared once (its command line comes from
    these fields); ``None`` keeps the recipe's value."""

    out: str | Path = setting(  # noqa: RUF009 (a field, as every setting())
        "runs/scaling", help="output directory"
    )
    config: str | Path | None = setting(  # noqa: RUF009 (a field, as every setting())
        None, help="a YAML recipe (default: the embedded scaling recipe)"
    )
    """A YAML recipe; default: the embedded ``recipes/scaling.yaml``."""
    axis: str = setting("params", choices=AXES, help="x of the fit")
    sizes: tuple[str, ...] = setting((), nargs="+", parse=tuple, help="model sizes (--axis params)")
    """Sizes of the params axis (at least 3)."""
    tokens: tuple[int, ...] = setting(
        (), nargs="+", type=int, parse=tuple, help="token counts (--axis tokens)"
    )
    """Token counts of the tokens axis (at least 3); the size is the recipe's model."""
    attentions: tuple[str, ...] = setting(
        ATTENTIONS,
        flag="--attention",
        dest="attention",
        nargs="+",
        parse=tuple,
        metavar="ARM",
        help="arms: baseline and at least one other, each a registered attention type or an "
        "ablation of one as TYPE:option=value,... (e.g. diff_v1:lambda_init=0.8); "
        "default: baseline diff_v1 diff_v2",
    )
    """The arms (:mod:`diffattn.compare.arms`), as spelled."""
    count: str = setting(
        "non_embedding",
        choices=COUNTS,
        help="N is the non-embedding (Kaplan et al., default) or the total parameter count",
    )
    """Which parameter count is N: ``non_embedding`` (Kaplan et al.) or ``total``."""
    steps: int | None = setting(None, help="optimizer steps per run")
    device: str | None = setting(None, help="auto, cpu or cuda")
    overrides: Sequence[str] = recipe_overrides(
        "override a recipe value, e.g. --set optim.lr=1e-3 (repeatable)"
    )
    from_results: tuple[str, ...] | None = setting(
        None,
        metavar="PATH",
        nargs="+",
        parse=tuple,
        help="fit these run directories or .json/.csv files of (attention, x, loss) "
        "instead of training",
    )
    """What :func:`~diffattn.scaling.fit_results` fits instead of a sweep (``diffattn scaling
    --from-results``); :func:`~diffattn.scaling.run_scaling` trains and ignores it."""
    overwrite: bool = setting(False, help="replace an OUT holding a different sweep")
    progress: bool = progress_switch()


def default_recipe() -> Path:
    """Path of the embedded recipe ``diffattn/recipes/scaling.yaml``."""
    return Path(str(resources.files("diffattn.recipes").joinpath("scaling.yaml")))


def _check_options(options: ScalingOptions) -> None:
    if options.axis not in AXES:
        raise ValueError(f"--axis: choose one of {', '.join(AXES)}, got {options.axis!r}")
    if options.count not in COUNTS:
        raise ValueError(f"--count: choose one of {', '.join(COUNTS)}, got {options.count!r}")
    arms = [arm.name for arm in parse_arms(options.attentions, "--attention")]
    if REFERENCE not in arms or len(arms) < 2:
        raise ValueError(f"--attention: the sweep needs {REFERENCE} and at least one other arm")
    if options.axis == "params":
        if options.tokens:
            raise ValueError("--tokens belongs to --axis tokens")
        if len(options.sizes) < 3:
            raise ValueError(
                f"--sizes: a fit of L = a·N^−α + c needs at least 3 sizes, got {len(options.sizes)}"
            )
    else:
        if options.sizes:
            raise ValueError("--sizes belongs to --axis params (--axis tokens trains one size)")
        if options.steps is not None:
            raise ValueError("--steps belongs to --axis params; --tokens sets the steps")
        if len(options.tokens) < 3:
            raise ValueError(
                f"--tokens: a fit of L = a·D^−α + c needs at least 3 token counts, got "
                f"{len(options.tokens)}"
            )
        if any(t <= 0 for t in options.tokens):
            raise ValueError(f"--tokens must be positive, got {list(options.tokens)}")


def plan_runs(options: ScalingOptions) -> tuple[Any, list[PlannedRun]]:
    """Validate everything and return (base config, runs); nothing is written.

    Raises ``ValueError`` (a :class:`~diffattn.train.ConfigError` for recipe entries)."""
    from diffattn.model import count_parameters
    from diffattn.train import ConfigError, check_runtime, load_config, read_env

    _check_options(options)
    overrides = list(options.overrides)
    if options.steps is not None:
        overrides.append(f"steps={options.steps}")
    if options.device is not None:
        overrides.append(f"device={options.device}")
    recipe = Path(options.config) if options.config is not None else default_recipe()
    base = load_config(recipe, overrides)
    env = read_env()
    if env.world_size > 1:
        raise ConfigError("environment", "diffattn scaling runs in one process, not torchrun")

    if options.axis == "params":
        sizes = [parse_size(spec) for spec in options.sizes]
        labels = [s.label for s in sizes]
        if len(set(labels)) != len(labels):
            raise ValueError(f"--sizes: each size may appear once, got {labels}")
        variants = [(s.label, s.as_overrides()) for s in sizes]
        steps_of = None
    else:
        per_step = base.global_batch_size * base.seq_len
        steps_of = sorted({max(1, round(t / per_step)) for t in options.tokens})
        if len(steps_of) < 3:
            raise ValueError(
                f"--tokens {list(options.tokens)} round to {len(steps_of)} distinct step "
                f"counts of {per_step:,} tokens (global_batch_size × seq_len); give counts "
                "that differ by at least one step"
            )
        every = math.gcd(*steps_of)
        variants = [(base.model.preset, [f"steps={steps_of[-1]}", f"eval_every={every}"])]

    runs: list[PlannedRun] = []
    for label, size_overrides in variants:
        for arm in parse_arms(options.attentions, "--attention"):
            run_overrides = [*overrides, *size_overrides, *arm.recipe_overrides()]
            if options.axis == "params" and base.eval_every == 0:
                run_overrides.append(f"eval_every={base.steps}")
            config = matched_config(arm, partial(load_config, recipe), run_overrides)
            model = config.model_config()
            check_runtime(config, env)
            run = PlannedRun(
                attention=arm.name,
                name=f"{arm.directory}-{label}",
                config=config,
                size=label,
                parameters=count_parameters(model),
                non_embedding=count_parameters(model, exclude_embeddings=True),
            )
            if steps_of is None:
                x = run.non_embedding if options.count == "non_embedding" else run.parameters
                run.points = [(config.steps, x)]
            else:
                per_step = config.global_batch_size * config.seq_len
                run.points = [(s, s * per_step) for s in steps_of]
            runs.append(run)
    return base, runs


def plan_text(options: ScalingOptions, base: Any, runs: list[PlannedRun]) -> str:
    """The resolved plan as YAML (what makes an ``OUT`` reusable)."""
    import yaml

    from diffattn.train import dump_config

    plan = {
        "axis": options.axis,
        "count": options.count,
        "runs": {run.name: yaml.safe_load(dump_config(run.config)) for run in runs},
        "points": {run.name: [list(p) for p in run.points] for run in runs},
        "data": yaml.safe_load(dump_config(base))["data"],
    }
    return yaml.safe_dump(plan, sort_keys=True)


__all__ = [
    "ATTENTIONS",
    "AXES",
    "COUNTS",
    "PlannedRun",
    "ScalingOptions",
    "Size",
    "default_recipe",
    "parse_size",
    "plan_runs",
    "plan_text",
]
