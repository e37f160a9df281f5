"""A package facade whose names are imported when first used (PEP 562).

A package ``__init__`` that imports every submodule makes ``import diffattn.train.config`` pay
for the trainer, the data loader and numpy. With :func:`lazy_exports` the package lists where
each public name lives, and the submodule is imported on the first access to one of its names::

    __getattr__, __dir__ = lazy_exports(globals(), {"train": "trainer", "TrainConfig": "config"})

``from diffattn.train import train`` then works as before, and a name that is not exported is
Python's own ``AttributeError``/``ImportError``. This module imports nothing of diffattn.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``:
    ``exports`` maps each public name to the submodule (relative to the package) defining it.
    A name, once imported, is stored in ``namespace`` so later accesses are plain lookups."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
