"""``diffattn scaling``: sweep sizes or token counts, fit L = a·x^−α + c (DIFF V1 Fig 3)."""

from __future__ import annotations

import argparse

from diffattn.train.cli import add_set_option

DESCRIPTION = (
    "Train the Transformer baseline and DIFF at several model sizes (--axis params, DIFF V1 "
    "Fig 3a) or to several token counts (--axis tokens, Fig 3b) on the same tokens, fit "
    "L(x) = a·x^−α + c per type with scipy, and report the share of parameters or tokens DIFF "
    "needs to match the Transformer (paper: 62.2%, 59.5%, 63.7%) in OUT/report.md, "
    "results.json and scaling.png. --from-results fits finished runs or a JSON/CSV of points "
    "instead. A size is PRESET, PRESET:key=value,... or key=value,... (model fields), e.g. "
    "--sizes d_model=64,n_heads=4 d_model=96,n_heads=6 tiny."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``scaling`` verb's arguments to ``parser``."""
    from diffattn.scaling import ATTENTIONS, AXES, COUNTS

    parser.add_argument("--out", default="runs/scaling", help="output directory")
    parser.add_argument(
        "--config", default=None, help="a YAML recipe (default: the embedded scaling recipe)"
    )
    parser.add_argument("--axis", choices=AXES, default="params", help="x of the fit")
    parser.add_argument("--sizes", nargs="+", default=[], help="model sizes (--axis params)")
    parser.add_argument(
        "--tokens", nargs="+", type=int, default=[], help="token counts (--axis tokens)"
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        default=list(ATTENTIONS),
        choices=ATTENTIONS,
        help="attention types (baseline and at least one DIFF type; default: all three)",
    )
    parser.add_argument(
        "--count",
        choices=COUNTS,
        default="non_embedding",
        help="N is the non-embedding (Kaplan et al., default) or the total parameter count",
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    parser.add_argument("--device", default=None, help="auto, cpu or cuda")
    add_set_option(parser, "override a recipe value, e.g. --set optim.lr=1e-3 (repeatable)")
    parser.add_argument(
        "--from-results",
        nargs="+",
        default=None,
        metavar="PATH",
        help="fit these run directories or .json/.csv files of (attention, x, loss) "
        "instead of training",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an OUT holding a different sweep"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    """Run the sweep (or the fit alone); invalid settings raise ValueError before any work."""
    from diffattn.scaling import ScalingOptions, fit_results, run_scaling

    if args.from_results is not None:
        training = [
            name
            for name, given in (
                ("--sizes", args.sizes),
                ("--tokens", args.tokens),
                ("--set", args.overrides),
                ("--steps", args.steps is not None),
                ("--config", args.config is not None),
            )
            if given
        ]
        if training:
            raise ValueError(f"--from-results trains nothing; drop {', '.join(training)}")
        fit_results(
            args.from_results,
            args.out,
            axis=args.axis,
            count=args.count,
            attentions=tuple(args.attention),
            progress=not args.quiet,
        )
        return 0
    options = ScalingOptions(
        out=args.out,
        config=args.config,
        axis=args.axis,
        sizes=tuple(args.sizes),
        tokens=tuple(args.tokens),
        attentions=tuple(args.attention),
        overrides=list(args.overrides),
        steps=args.steps,
        device=args.device,
        count=args.count,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    run_scaling(options)
    return 0
