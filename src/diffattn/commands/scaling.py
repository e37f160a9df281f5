"""``diffattn scaling``: sweep sizes or token counts, fit L = a·x^−α + c (DIFF V1 Fig 3)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from diffattn.scaling.plan import ATTENTIONS, AXES, COUNTS
from diffattn.settings import Settings, setting
from diffattn.train.cli import recipe_overrides

DESCRIPTION = (
    "Train the Transformer baseline and DIFF at several model sizes (--axis params, DIFF V1 "
    "Fig 3a) or to several token counts (--axis tokens, Fig 3b) on the same tokens, fit "
    "L(x) = a·x^−α + c per type with scipy, and report the share of parameters or tokens DIFF "
    "needs to match the Transformer (paper: 62.2%, 59.5%, 63.7%) in OUT/report.md, "
    "results.json and scaling.png. --from-results fits finished runs or a JSON/CSV of points "
    "instead. A size is PRESET, PRESET:key=value,... or key=value,... (model fields), e.g. "
    "--sizes d_model=64,n_heads=4 d_model=96,n_heads=6 tiny."
)


@dataclass(frozen=True)
class ScalingSettings(Settings):
    """The options of ``diffattn scaling``, each declared once."""

    out: str = setting("runs/scaling", help="output directory")
    config: str | None = setting(None, help="a YAML recipe (default: the embedded scaling recipe)")
    axis: str = setting("params", choices=AXES, help="x of the fit")
    sizes: tuple[str, ...] = setting((), help="model sizes (--axis params)")
    tokens: tuple[int, ...] = setting((), help="token counts (--axis tokens)")
    attention: tuple[str, ...] = setting(
        ATTENTIONS,
        choices=ATTENTIONS,
        help="attention types (baseline and at least one DIFF type; default: all three)",
    )
    count: str = setting(
        "non_embedding",
        choices=COUNTS,
        help="N is the non-embedding (Kaplan et al., default) or the total parameter count",
    )
    steps: int | None = setting(None, help="optimizer steps per run")
    device: str | None = setting(None, help="auto, cpu or cuda")
    overrides: Sequence[str] = recipe_overrides(
        "override a recipe value, e.g. --set optim.lr=1e-3 (repeatable)"
    )
    from_results: tuple[str, ...] | None = setting(
        None,
        metavar="PATH",
        help="fit these run directories or .json/.csv files of (attention, x, loss) "
        "instead of training",
    )
    overwrite: bool = setting(False, help="replace an OUT holding a different sweep")
    quiet: bool = setting(False, help="no progress output")


add_arguments = ScalingSettings.add_arguments
"""Add the ``scaling`` verb's arguments to a parser."""


def run(args: argparse.Namespace) -> int:
    """Run the sweep (or the fit alone) of a parsed command line."""
    return run_settings(ScalingSettings.from_args(args))


def run_settings(settings: ScalingSettings) -> int:
    """Run the sweep (or the fit alone); invalid settings raise ValueError before any work."""
    from diffattn.scaling import ScalingOptions, fit_results, run_scaling

    if settings.from_results is not None:
        training = [
            name
            for name, given in (
                ("--sizes", settings.sizes),
                ("--tokens", settings.tokens),
                ("--set", settings.overrides),
                ("--steps", settings.steps is not None),
                ("--config", settings.config is not None),
            )
            if given
        ]
        if training:
            raise ValueError(f"--from-results trains nothing; drop {', '.join(training)}")
        fit_results(
            settings.from_results,
            settings.out,
            axis=settings.axis,
            count=settings.count,
            attentions=tuple(settings.attention),
            progress=not settings.quiet,
        )
        return 0
    options = ScalingOptions(
        out=settings.out,
        config=settings.config,
        axis=settings.axis,
        sizes=tuple(settings.sizes),
        tokens=tuple(settings.tokens),
        attentions=tuple(settings.attention),
        overrides=list(settings.overrides),
        steps=settings.steps,
        device=settings.device,
        count=settings.count,
        overwrite=settings.overwrite,
        progress=not settings.quiet,
    )
    run_scaling(options)
    return 0
