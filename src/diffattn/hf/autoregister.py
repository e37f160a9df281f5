"""Register diffattn with transformers' Auto classes when both are imported, in any order.

If ``transformers`` is already in ``sys.modules`` we register now. Otherwise a one-shot
``sys.meta_path`` finder wraps the loader of the top-level ``transformers`` package so that
:func:`diffattn.hf.register` runs right after that package finishes importing; the finder
removes itself on first use. Nothing happens when transformers is not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings


def _register_quietly() -> None:
    try:
        from diffattn.hf import register

        register()
    except Exception as error:  # never break the user's import of transformers
        warnings.warn(
            f"diffattn could not register with transformers' Auto classes: {error}",
            stacklevel=2,
        )


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of ``transformers``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _register_quietly()

        spec.loader.exec_module = exec_and_register
        return spec


def install() -> None:
    """Register now, or arrange to register when transformers is imported."""
    if "transformers" in sys.modules:
        _register_quietly()
    elif importlib.util.find_spec("transformers") is not None and not any(
        isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _RegisterAfterImport())
