"""``diffattn eval <experiment> MODEL [--compare MODEL2 ...]``: the papers' measurements."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

from diffattn.commands.extras import VERB_EXTRAS, add_unavailable, missing_extra

DESCRIPTION = (
    "Measure the papers' claims on any model: fine-grained loss, multi-needle retrieval, "
    "activation outliers and quantization, head analyses, Dex effective attention, Hessian "
    "spectra, and the attention picture (A1, A2, A1 − λA2) of any model on your own prompt. "
    "Writes results.json, report.md and PNG figures to --out (docs/eval.md)."
)


def experiments() -> list:
    """The experiment modules that exist and import here, in their listed order."""
    return [module for _, module, _ in _experiment_modules() if module is not None]


def _experiment_modules() -> list[tuple[str, Any, ModuleNotFoundError | None]]:
    """``(name, module, None)`` for each experiment module that exists, in the listed order, or
    ``(name, None, error)`` for one whose import needs an optional package missing here."""
    from diffattn.eval import EXPERIMENTS

    found = []
    for name in EXPERIMENTS:
        module_name = f"diffattn.eval.{name}"
        if importlib.util.find_spec(module_name) is None:
            continue
        try:
            found.append((name, importlib.import_module(module_name), None))
        except ModuleNotFoundError as error:
            if missing_extra(error, VERB_EXTRAS["eval"]) is None:
                raise
            found.append((name, None, error))
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, module, error in _experiment_modules():
        if module is not None:
            try:
                _add_experiment(subparsers, module)
                continue
            except ModuleNotFoundError as failure:  # its arguments need a missing package
                name, error = module.NAME, failure
        message = missing_extra(error, VERB_EXTRAS["eval"])
        if message is None:
            raise error
        add_unavailable(subparsers, name, f"(not available here: {message})", error, message)


def _add_experiment(subparsers: argparse._SubParsersAction, module: Any) -> None:
    from diffattn.eval.common import EvalCommandOptions

    sub = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
    EvalCommandOptions.add_arguments(sub)
    module.add_arguments(sub)
    sub.set_defaults(experiment_main=module.main)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from diffattn.eval.common import RESULTS_NAME
    from diffattn.fileio import check_output_directory, clear_output_directory, read_json

    args.out = Path(args.out or f"runs/eval/{args.experiment}")
    if getattr(args, "data_defaults", None) is not None:  # an experiment that reads documents
        from diffattn.eval.run_split import resolve

        args.data_provenance = resolve(args, args.data_defaults)
    prepare = getattr(importlib.import_module(args.experiment_main.__module__), "prepare", None)
    if prepare is not None:  # check the arguments against the models before touching --out
        args.prepared = prepare(args)
    own = False
    if (args.out / RESULTS_NAME).is_file():  # an earlier run of the same experiment
        try:
            own = read_json(args.out / RESULTS_NAME).get("experiment") == args.experiment
        except ValueError:
            own = False
    if check_output_directory(
        args.out, args.overwrite, own=own, option="--out", hint="pass --overwrite to replace it"
    ):
        clear_output_directory(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    reading = getattr(args, "document_reading", None)
    if not reading:
        return int(args.experiment_main(args) or 0)
    from diffattn.eval.text import DOCUMENT_READING

    token = DOCUMENT_READING.set(reading)  # documents cut as the evaluated run cut them
    try:
        return int(args.experiment_main(args) or 0)
    finally:
        DOCUMENT_READING.reset(token)
