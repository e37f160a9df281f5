"""``diffattn lm-eval [--engine hf|vllm] [HARNESS ARGUMENTS ...]``: lm-evaluation-harness with
diffattn's models.

The harness's command line finds only the model classes of its own package, so this command
imports :mod:`diffattn.eval.harness` (which registers the model ``diffattn``) and then runs
that command line with the arguments as given. ``--model diffattn`` is added when no
``--model`` is passed. Example::

    diffattn lm-eval --model_args pretrained=runs/diff_v1/final,dex=ADAPTER \\
        --tasks arc_easy --include_path my_tasks/ --limit 100 --output_path out/

``--engine vllm`` runs the harness's own vLLM model (``--model vllm``) instead, over diffattn's
vLLM plugin (:mod:`diffattn.eval.harness_vllm`). ``--engine`` is this command's one option
(:class:`LmEvalSettings`); it is taken out of the arguments before the harness reads them.

Needs ``pip install 'diffattn[lm-eval]'`` (and vLLM beside it for ``--engine vllm``); see
docs/eval.md for offline use with local task YAMLs over local files.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Literal, NoReturn

from diffattn.settings import Settings, setting

DESCRIPTION = (
    "Run lm-evaluation-harness (its own arguments, passed through) with diffattn's models "
    "available as --model diffattn --model_args pretrained=MODEL[,dex=ADAPTER,dtype=fp32]. "
    "Needs the lm-eval extra. See docs/eval.md."
)
SUBCOMMANDS = ("run", "ls", "validate")
PARSER_OPTIONS = {"prefix_chars": "+", "add_help": False}
"""Every argument, options and ``--help`` included, goes to the harness except ``--engine``,
which :func:`split_engine` takes out first: this verb's parser recognises no option of its
own."""
DEFAULT_ENGINE = "hf"


@dataclasses.dataclass(frozen=True)
class LmEvalSettings(Settings):
    """The one option of ``diffattn lm-eval`` that is not the harness's."""

    engine: Literal["hf", "vllm"] = setting(
        DEFAULT_ENGINE,
        help="hf (default): the harness's Hugging Face model over diffattn's loading "
        "(--model diffattn); vllm: the harness's vLLM model (--model vllm) over diffattn's "
        "vLLM plugin, for diffattn directories whose attention types vLLM serves (needs vLLM "
        "installed; docs/eval.md)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "harness_args",
        nargs=argparse.REMAINDER,
        metavar="HARNESS_ARGUMENTS",
        help="lm-evaluation-harness arguments (lm-eval run --help lists them)",
    )


def engine_parser() -> argparse.ArgumentParser:
    """The parser of :class:`LmEvalSettings` alone; a bad value raises ``ValueError`` (one
    line) instead of printing usage and exiting."""
    parser = argparse.ArgumentParser(prog="diffattn lm-eval", add_help=False, allow_abbrev=False)
    LmEvalSettings.add_arguments(parser)

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def split_engine(arguments: Sequence[str]) -> tuple[str, list[str]]:
    """``--engine`` (:class:`LmEvalSettings`) and the harness's arguments without it, in their
    order. ``--engine`` before a subcommand other than ``run`` is refused: only ``run`` runs a
    model."""
    engine_given = any(a == "--engine" or a.startswith("--engine=") for a in arguments)
    parsed, rest = engine_parser().parse_known_args(list(arguments))
    settings = LmEvalSettings.from_args(parsed)
    if engine_given and rest and rest[0] in SUBCOMMANDS and rest[0] != "run":
        raise ValueError(f"--engine applies to 'run' only, not to '{rest[0]}'")
    return settings.engine, rest


def harness_argv(arguments: Sequence[str], engine: str = DEFAULT_ENGINE) -> list[str]:
    """The harness's command line: ``run`` unless another subcommand is named and, for the
    ``hf`` engine, ``--model diffattn`` unless a model is named and ``--device auto`` (CUDA
    when available, else the CPU; the harness's own default is ``cuda:0``) unless a device is
    named. (The ``vllm`` engine's model is set once the command line is parsed, where a
    ``--config`` file's is known too: :func:`diffattn.eval.harness_vllm.prepare_run`.)"""
    argv = list(arguments)
    if not argv or argv[0] not in SUBCOMMANDS:
        argv.insert(0, "run")
    if argv[0] != "run" or {"-h", "--help"} & set(argv) or engine != "hf":
        return argv

    def named(option: str) -> bool:
        return any(a == option or a.startswith(f"{option}=") for a in argv)

    if not named("--model"):
        argv[1:1] = ["--model", "diffattn"]
    if not named("--device"):
        argv[1:1] = ["--device", "auto"]
    return argv


def run(args: argparse.Namespace) -> int:
    engine, arguments = split_engine(args.harness_args)
    if engine == "vllm":
        from diffattn.serve.vllm_engine import require_vllm

        require_vllm()
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging

        if engine == "vllm":
            from diffattn.eval import harness_vllm
        else:
            from diffattn.eval import harness  # noqa: F401  (registers --model diffattn)
    except ImportError as error:
        raise ValueError(
            f"lm-evaluation-harness is not installed ({error}); pip install 'diffattn[lm-eval]'"
        ) from error
    argv = harness_argv(arguments, engine)
    if {"-h", "--help"} & set(argv):
        print(engine_parser().format_help())
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        setup_logging()
        cli = HarnessCLI()
        parsed = cli.parse_args()
        if engine == "vllm" and parsed.command == "run":
            harness_vllm.prepare_run(parsed)
        cli.execute(parsed)
    finally:
        sys.argv = saved
    return 0
