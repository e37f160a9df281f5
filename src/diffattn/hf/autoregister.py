"""Register diffattn with transformers' Auto classes when both are imported, in any order.

If ``transformers`` is already in ``sys.modules`` we register now. Otherwise a one-shot
``sys.meta_path`` finder wraps the loader of the top-level ``transformers`` package so that
:func:`diffattn.hf.register` runs right after that package finishes importing; the finder
removes itself once that has happened. Nothing happens when transformers is not installed.

The finder wraps the loader of :mod:`diffattn.hf.configuration` the same way: when that module
is imported first, its own import of transformers finds it half-built, so :func:`register`
leaves it alone then and pairs it with :mod:`diffattn.hf.modeling` once it is complete.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

WATCHED = ("transformers", "diffattn.hf.configuration")
"""The modules after whose import :func:`diffattn.hf.register` runs."""


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
    """Finds nothing itself; wraps the loaders of :data:`WATCHED` found by the other finders.

    It stays installed until transformers has actually been executed, so availability checks
    such as ``importlib.util.find_spec("transformers")`` (which also consult this finder but
    import nothing) do not use it up.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        finder = self

        def exec_and_register(module):
            exec_module(module)
            if fullname == "transformers" and finder in sys.meta_path:
                sys.meta_path.remove(finder)
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
