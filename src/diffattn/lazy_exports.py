"""A package facade whose names are imported when first used (PEP 562).

A package ``__init__`` that imports every submodule makes ``import diffattn.train.config`` pay
for the trainer, the data loader and numpy. With :func:`lazy_exports` the package lists the
public names of each submodule, and the submodule is imported on the first access to one of
them::

    __all__, __getattr__, __dir__ = lazy_exports(
        globals(), {"trainer": ("Trainer", "train"), "config": ("TrainConfig",)}
    )

``from diffattn.train import train`` then works as before, and a name that is not exported is
Python's own ``AttributeError``/``ImportError``. This module imports nothing of diffattn.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], modules: Mapping[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__all__``, ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is
    ``namespace``: ``modules`` maps each submodule (relative to the package) to the public names
    it defines. ``__all__`` lists those names sorted. A name, once imported, is stored in
    ``namespace`` so later accesses are plain lookups."""
    package = namespace["__name__"]
    exports = {name: module for module, names in modules.items() for name in names}
    if len(exports) != sum(map(len, modules.values())):
        raise ValueError(f"{package}: a name is exported from two submodules")

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return sorted(exports), __getattr__, __dir__
