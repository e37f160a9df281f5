"""The papers' measurements as functions and as ``diffattn eval <experiment>`` commands.

Each experiment module has ``NAME``, ``HELP``, a settings dataclass declaring each of its
settings once (:mod:`diffattn.settings`: default, type, bounds, help, flag), the
``add_arguments(parser)`` generated from it, ``run(models, settings)`` (importable:
``diffattn.eval.loss.run(models, LossSettings(seq_len=256))``, or the settings by name:
``run(models, seq_len=256)``) and ``main(args)`` (the command). The shared conventions
(models, ``--compare``, ``--dex``, outputs, seeds) are in :mod:`diffattn.eval.common`. See
``docs/eval.md``.
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
