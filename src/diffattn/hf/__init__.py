"""Hugging Face integration (extra ``hf``): ``DiffAttnConfig`` and ``DiffAttnForCausalLM``.

Importing the classes registers them with ``AutoConfig`` and ``AutoModelForCausalLM`` (plain
registration at the end of each module), whatever was imported before. ``import diffattn`` also
registers them: at once if ``transformers`` is already imported, otherwise the moment it is
(a one-shot import hook, see :mod:`diffattn.hf.autoregister`), so ``import diffattn`` itself
stays fast and works without transformers. :func:`register` does the same explicitly.

After that, ``AutoModelForCausalLM.from_pretrained(model_dir)``, ``generate()`` with HF's
cache classes, and ``pipeline("text-generation", ...)`` work on diffattn model directories.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def register() -> None:
    """Register ``diffattn`` with transformers' Auto classes (idempotent).

    Importing :mod:`diffattn.hf.configuration` and :mod:`diffattn.hf.modeling` registers their
    classes, so this imports them. A module that is being imported at this very moment (its
    own import of transformers can trigger this call) is left to finish and register itself.
    """
    for name in ("diffattn.hf.configuration", "diffattn.hf.modeling"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_register", None) is None:
            return  # mid-import: it registers itself (and what follows it) at its end
        importlib.import_module(name)


def __getattr__(name: str) -> Any:
    if name == "DiffAttnConfig":
        from diffattn.hf.configuration import DiffAttnConfig

        return DiffAttnConfig
    if name in ("DiffAttnForCausalLM", "HFCacheAdapter"):
        from diffattn.hf import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module 'diffattn.hf' has no attribute {name!r}")


__all__ = ["DiffAttnConfig", "DiffAttnForCausalLM", "HFCacheAdapter", "register"]
