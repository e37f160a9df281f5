"""``diffattn lm-eval [HARNESS ARGUMENTS ...]``: lm-evaluation-harness with diffattn's models.

The harness's command line finds only the model classes of its own package, so this command
imports :mod:`diffattn.eval.harness` (which registers the model ``diffattn``) and then runs
that command line with the arguments as given. ``--model diffattn`` is added when no
``--model`` is passed. Example::

    diffattn lm-eval --model_args pretrained=runs/diff_v1/final,dex=ADAPTER \\
        --tasks arc_easy --include_path my_tasks/ --limit 100 --output_path out/

Needs ``pip install 'diffattn[lm-eval]'``; see docs/eval.md for offline use with local task
YAMLs over local files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

DESCRIPTION = (
    "Run lm-evaluation-harness (its own arguments, passed through) with diffattn's models "
    "available as --model diffattn --model_args pretrained=MODEL[,dex=ADAPTER,dtype=fp32]. "
    "Needs the lm-eval extra. See docs/eval.md."
)
SUBCOMMANDS = ("run", "ls", "validate")
PARSER_OPTIONS = {"prefix_chars": "+", "add_help": False}
"""Every argument, options and ``--help`` included, is the harness's: this verb's parser
recognises no option of its own."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "harness_args",
        nargs=argparse.REMAINDER,
        metavar="HARNESS_ARGUMENTS",
        help="lm-evaluation-harness arguments (lm-eval run --help lists them)",
    )


def harness_argv(arguments: Sequence[str]) -> list[str]:
    """The harness's command line: ``run`` unless another subcommand is named,
    ``--model diffattn`` unless a model is named and ``--device auto`` (CUDA when available,
    else the CPU; the harness's own default is ``cuda:0``) unless a device is named."""
    argv = list(arguments)
    if not argv or argv[0] not in SUBCOMMANDS:
        argv.insert(0, "run")
    if argv[0] != "run" or {"-h", "--help"} & set(argv):
        return argv

    def named(option: str) -> bool:
        return any(a == option or a.startswith(f"{option}=") for a in argv)

    if not named("--model"):
        argv[1:1] = ["--model", "diffattn"]
    if not named("--device"):
        argv[1:1] = ["--device", "auto"]
    return argv


def run(args: argparse.Namespace) -> int:
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging

        from diffattn.eval import harness  # noqa: F401  (registers --model diffattn)
    except ImportError as error:
        raise ValueError(
            f"lm-evaluation-harness is not installed ({error}); pip install 'diffattn[lm-eval]'"
        ) from error
    argv = harness_argv(args.harness_args)
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        setup_logging()
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    finally:
        sys.argv = saved
    return 0
