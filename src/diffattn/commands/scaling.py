"""``diffattn scaling``: sweep sizes or token counts, fit L = a·x^−α + c (DIFF V1 Fig 3)."""

from __future__ import annotations

import argparse

from diffattn.scaling.plan import ScalingOptions

DESCRIPTION = (
    "Train the Transformer baseline and DIFF at several model sizes (--axis params, DIFF V1 "
    "Fig 3a) or to several token counts (--axis tokens, Fig 3b) on the same tokens, fit "
    "L(x) = a·x^−α + c per type with scipy, and report the share of parameters or tokens DIFF "
    "needs to match the Transformer (paper: 62.2%, 59.5%, 63.7%) in OUT/report.md, "
    "results.json and scaling.png. --from-results fits finished runs or a JSON/CSV of points "
    "instead. A size is PRESET, PRESET:key=value,... or key=value,... (model fields), e.g. "
    "--sizes d_model=64,n_heads=4 d_model=96,n_heads=6 tiny. --attention takes any registered "
    "attention type or an ablation of one as TYPE:option=value,... (e.g. "
    "diff_v1:lambda_init=0.8) besides the baseline."
)


add_arguments = ScalingOptions.add_arguments
"""Add the ``scaling`` verb's arguments to a parser: the fields of the library's
:class:`~diffattn.scaling.ScalingOptions`, each declared there once."""


def run(args: argparse.Namespace) -> int:
    """Run the sweep (or the fit alone) of a parsed command line."""
    return run_settings(ScalingOptions.from_args(args))


def run_settings(settings: ScalingOptions) -> int:
    """Run the sweep (or the fit alone); invalid settings raise ValueError before any work."""
    from diffattn.scaling import fit_results, run_scaling

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
            attentions=settings.attentions,
            progress=settings.progress,
        )
        return 0
    run_scaling(settings)
    return 0
