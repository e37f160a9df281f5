"""Recipes shipped inside the package, so an installed wheel has them too.

* ``compare.yaml`` (the default of ``diffattn compare``), ``long_context.yaml``,
  ``scaling.yaml``: the experiments' own recipes.
* ``configs/``: the training recipes (``tiny``, the paper sizes ``paper-830m`` … ``paper-13.1b``
  on ``paper-base``, ``compare-100m``) and ``configs/dex/`` (Dex comparisons). In a checkout,
  the top-level ``configs/`` is a link to this directory.

:func:`resolve_recipe` turns what a user typed into a file: an existing path, else the name of
a shipped recipe (``tiny``, ``tiny.yaml``, ``dex/smollm2``).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

TRAINING = "configs"
"""The directory of the shipped training recipes, inside this package."""


def shipped_directory(kind: str = TRAINING) -> Path:
    """The directory of the shipped recipes of ``kind`` (``configs`` or ``configs/dex``)."""
    return Path(str(resources.files(__name__).joinpath(kind)))


def shipped_names(kind: str = TRAINING) -> list[str]:
    """The names of the shipped recipes of ``kind``, without ``.yaml``."""
    return sorted(p.stem for p in shipped_directory(kind).glob("*.yaml"))


def resolve_recipe(spec: str | os.PathLike, kind: str = TRAINING) -> Path:
    """The recipe file ``spec`` names: an existing path as it is, else a shipped recipe of
    ``kind`` by name (``tiny`` or ``tiny.yaml``).

    Raises:
        FileNotFoundError: neither; the message lists the shipped names.
    """
    path = Path(spec)
    if path.is_file():
        return path
    text = str(spec)
    name = text[: -len(".yaml")] if text.endswith(".yaml") else text
    candidate = shipped_directory(kind) / f"{name}.yaml"
    if os.sep not in text and "/" not in text and candidate.is_file():
        return candidate
    raise FileNotFoundError(
        f"{spec}: no such file, nor a shipped recipe; the shipped ones are "
        + ", ".join(shipped_names(kind))
    )
