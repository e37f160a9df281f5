"""Hugging Face integration (extra ``hf``): ``DiffAttnConfig`` and ``DiffAttnForCausalLM``.

``import diffattn`` registers both with ``AutoConfig`` and ``AutoModelForCausalLM``: at once
if ``transformers`` is already imported, otherwise the moment it is imported (a one-shot
import hook, see :mod:`diffattn.hf.autoregister`), so ``import diffattn`` itself stays fast
and works without transformers. :func:`register` does the same explicitly.

After that, ``AutoModelForCausalLM.from_pretrained(model_dir)``, ``generate()`` with HF's
cache classes, and ``pipeline("text-generation", ...)`` work on diffattn model directories.
"""

from __future__ import annotations

from typing import Any

_registered = False


def register() -> None:
    """Register ``diffattn`` with transformers' Auto classes (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from diffattn.hf.configuration import DiffAttnConfig
    from diffattn.hf.modeling import DiffAttnForCausalLM

    AutoConfig.register(DiffAttnConfig.model_type, DiffAttnConfig, exist_ok=True)
    AutoModelForCausalLM.register(DiffAttnConfig, DiffAttnForCausalLM, exist_ok=True)
    _registered = True


def __getattr__(name: str) -> Any:
    if name == "DiffAttnConfig":
        from diffattn.hf.configuration import DiffAttnConfig

        return DiffAttnConfig
    if name in ("DiffAttnForCausalLM", "HFCacheAdapter"):
        from diffattn.hf import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module 'diffattn.hf' has no attribute {name!r}")


__all__ = ["DiffAttnConfig", "DiffAttnForCausalLM", "HFCacheAdapter", "register"]
