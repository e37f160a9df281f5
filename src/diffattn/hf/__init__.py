"""Hugging Face integration (extra ``hf``): ``DiffAttnConfig`` and ``DiffAttnForCausalLM``.

Importing the classes registers them with ``AutoConfig`` and ``AutoModelForCausalLM`` (plain
registration at the end of each module); :func:`register` pairs the two, so whichever module is
imported first, both Auto classes know ``diffattn``. ``import diffattn`` also
registers them: at once if ``transformers`` is already imported, otherwise the moment it is
(a one-shot import hook, see :mod:`diffattn.hf.autoregister`), so ``import diffattn`` itself
stays fast and works without transformers. :func:`register` does the same explicitly.

After that, ``AutoModelForCausalLM.from_pretrained(model_dir)``, ``generate()`` with HF's
cache classes, and ``pipeline("text-generation", ...)`` work on diffattn model directories.
"""

from __future__ import annotations

import sys
from typing import Any


def register() -> None:
    """Register ``diffattn`` with transformers' Auto classes (idempotent).

    Importing :mod:`diffattn.hf.configuration` registers ``AutoConfig`` and importing
    :mod:`diffattn.hf.modeling` registers ``AutoModelForCausalLM``, so this imports both. A
    module that is being imported at this very moment (its own import of transformers can
    trigger this call) is left to finish and register itself; the hook of
    :mod:`diffattn.hf.autoregister` calls this again once the configuration module has.
    """
    if _importing("diffattn.hf.configuration"):
        return
    from diffattn.hf import configuration  # noqa: F401  (registers AutoConfig)

    if _importing("diffattn.hf.modeling"):
        return
    from diffattn.hf import modeling  # noqa: F401  (registers AutoModelForCausalLM)


def _importing(name: str) -> bool:
    """Whether module ``name`` is being imported now (its ``_register`` not yet defined)."""
    module = sys.modules.get(name)
    return module is not None and getattr(module, "_register", None) is None


def __getattr__(name: str) -> Any:
    if name == "DiffAttnConfig":
        from diffattn.hf.configuration import DiffAttnConfig

        return DiffAttnConfig
    if name in ("DiffAttnForCausalLM", "HFCacheAdapter"):
        from diffattn.hf import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module 'diffattn.hf' has no attribute {name!r}")


__all__ = ["DiffAttnConfig", "DiffAttnForCausalLM", "HFCacheAdapter", "register"]
