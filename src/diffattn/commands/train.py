"""``diffattn train``: the options, the run and the exit codes of :mod:`diffattn.train.cli`."""

from __future__ import annotations

from diffattn.train.cli import DESCRIPTION, TrainSettings, add_arguments, run, run_settings

__all__ = ["DESCRIPTION", "TrainSettings", "add_arguments", "run", "run_settings"]
