"""``diffattn compare``: train baseline, DIFF V1 and DIFF V2 the same way and report."""

from __future__ import annotations

import argparse

from diffattn.train.cli import add_set_option

DESCRIPTION = (
    "Train a Transformer baseline, DIFF V1 and DIFF V2 at matched parameter count on the same "
    "tokens, in the same order, with the same seed, then write OUT/report.md (+ report.json, "
    "loss_curves.png, lambda.png) and print the results table. With no arguments: the embedded "
    "recipe (tiny preset, the Python standard library as corpus), a few minutes on a laptop CPU."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``compare`` verb's arguments to ``parser``."""
    from diffattn.compare import ATTENTIONS

    parser.add_argument("--out", default="runs/compare", help="output directory")
    parser.add_argument(
        "--config", default=None, help="a YAML recipe (default: the embedded compare recipe)"
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    parser.add_argument("--preset", default=None, help="model preset (see `diffattn presets`)")
    parser.add_argument("--seeds", type=int, default=1, help="number of seeds (spread reported)")
    parser.add_argument("--device", default=None, help="auto, cpu or cuda")
    parser.add_argument(
        "--attention",
        nargs="+",
        default=list(ATTENTIONS),
        choices=ATTENTIONS,
        help="attention types to compare (default: all three)",
    )
    add_set_option(parser, "override a recipe value, e.g. --set optim.lr=1e-3 (repeatable)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an OUT holding a different comparison"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    """Run the comparison; invalid settings raise ValueError (exit code 2) before any work."""
    from diffattn.compare import CompareOptions, run_compare

    options = CompareOptions(
        out=args.out,
        config=args.config,
        overrides=list(args.overrides),
        attentions=tuple(args.attention),
        seeds=args.seeds,
        steps=args.steps,
        preset=args.preset,
        device=args.device,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    run_compare(options)
    return 0
