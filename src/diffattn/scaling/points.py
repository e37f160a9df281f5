"""The (attention, x, loss) points of a scaling fit: from finished runs or from a file.

A point is one validation loss (the trainer's mean over ``eval_batches`` held-out batches)
at one x: a parameter count N or a token count D.

``--from-results`` reads:

* training run directories (``config.yaml`` + ``metrics.jsonl`` of ``diffattn train`` or a
  sweep): the arm from the recipe's model (its type, options and changed type fields:
  :func:`diffattn.compare.arms.arm_of_model`); for the params axis N from the recipe's model
  and the final validation loss; for the tokens axis every validation loss, at the tokens
  seen by then;
* a JSON file: a list of rows, or a mapping with ``points`` (a ``results.json`` of
  ``diffattn scaling``);
* a CSV file with a header.

Rows hold ``attention`` (an arm: ``baseline``, ``diff_v1``, ``gda:ratio=3``, ...; see
:mod:`diffattn.compare.arms`), ``loss`` and x as ``x``, ``parameters`` or ``tokens``.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diffattn.compare.arms import arm_of_model, parse_arm

X_KEYS = ("x", "parameters", "tokens")


@dataclass
class Point:
    attention: str
    x: float
    loss: float
    source: str = ""
    """Where it came from: a run directory, or a file and row."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row_point(row: dict[str, Any], where: str) -> Point:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a mapping with attention, x and loss, got {row!r}")
    try:
        attention = parse_arm(str(row.get("attention", ""))).name
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    key = next((k for k in X_KEYS if row.get(k) not in (None, "")), None)
    if key is None:
        raise ValueError(f"{where}: no x value (one of the columns {', '.join(X_KEYS)})")
    try:
        x, loss = float(row[key]), float(row["loss"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{where}: x and loss must be numbers, got {row.get(key)!r} and {row.get('loss')!r}"
        ) from None
    if not (math.isfinite(x) and x > 0 and math.isfinite(loss)):
        raise ValueError(f"{where}: x must be positive and loss finite, got {x} and {loss}")
    return Point(attention, x, loss, where)


def _run_points(run_dir: Path, axis: str, count: str) -> list[Point]:
    """The points of one training run directory."""
    from diffattn.model import count_parameters
    from diffattn.train import load_config, read_metrics

    config = load_config(run_dir / "config.yaml")
    records = [r for r in read_metrics(run_dir) if "val_loss" in r]
    if not records:
        raise ValueError(f"{run_dir}: no validation loss in metrics.jsonl (eval_every 0?)")
    model = config.model_config()
    attention = arm_of_model(model).name
    if axis == "params":
        n = count_parameters(model, exclude_embeddings=count == "non_embedding")
        last = records[-1]
        return [Point(attention, float(n), float(last["val_loss"]), str(run_dir))]
    return [
        Point(attention, float(r["tokens"]), float(r["val_loss"]), f"{run_dir}@{r['step']}")
        for r in records
        if r.get("tokens")
    ]


def read_points(paths: list[str | Path], axis: str, count: str) -> list[Point]:
    """Points from run directories, JSON and CSV files (see the module docstring), each named
    by its arm's canonical spelling."""
    points: list[Point] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            if not (path / "config.yaml").is_file():
                raise ValueError(f"--from-results {path}: not a training run (no config.yaml)")
            points += _run_points(path, axis, count)
        elif not path.is_file():
            raise ValueError(f"--from-results {path}: no such file or directory")
        elif path.suffix.lower() == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(f"--from-results {path}: not readable JSON ({error})") from None
            rows = data.get("points") if isinstance(data, dict) else data
            if not isinstance(rows, list):
                raise ValueError(f"--from-results {path}: expected a list of rows or 'points'")
            points += [_row_point(r, f"{path}[{i}]") for i, r in enumerate(rows)]
        elif path.suffix.lower() == ".csv":
            with path.open(encoding="utf-8", newline="") as handle:
                rows = list(csv.DictReader(handle))
            points += [_row_point(r, f"{path}:{i + 2}") for i, r in enumerate(rows)]
        else:
            raise ValueError(
                f"--from-results {path}: expected a run directory, a .json or a .csv file"
            )
    return points


__all__ = ["X_KEYS", "Point", "read_points"]
