"""The papers' measurements as functions and as ``diffattn eval <experiment>`` commands.

Each experiment module has ``NAME``, ``HELP``, ``add_arguments(parser)``, ``run(models, ...)``
(importable: ``diffattn.eval.loss.run(models, ...)``) and ``main(args)`` (the command). The
shared conventions (models, ``--compare``, ``--dex``, outputs, seeds) are in
:mod:`diffattn.eval.common`. See ``docs/eval.md``.
"""

EXPERIMENTS = (
    "loss",
    "needle",
    "outliers",
    "heads",
    "effective",
    "hessian",
    "mc",
    "icl",
    "hallucination",
    "attention_map",
)
"""Experiment modules, in the order the command line lists them (present ones only)."""
