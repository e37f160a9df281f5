"""``diffattn train``: the options, the run and the exit codes of :mod:`diffattn.train.cli`."""

from __future__ import annotations

from diffattn.train.cli import DESCRIPTION, add_arguments, run

__all__ = ["DESCRIPTION", "add_arguments", "run"]
