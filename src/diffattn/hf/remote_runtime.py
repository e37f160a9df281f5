"""diffattn's Hugging Face classes as Hub remote code: who registers, and what a save writes.

:mod:`diffattn.hf.remote_code` vendors this package into ``modeling_diffattn.py`` under a
private name (``_diffattn_<hash>``), so the modules here run in two copies: diffattn itself,
and the vendored copy (:func:`vendored`). They differ in two places only.

* **Registration** (:func:`register_auto_class`). diffattn registers its classes with
  ``AutoConfig`` and ``AutoModelForCausalLM`` for ``model_type: diffattn``. The vendored copy
  registers nothing: transformers registers the two classes that ``modeling_diffattn.py``
  itself defines and marks them as remote code (``register_for_auto_class``), and their
  ``save_pretrained`` copies ``modeling_diffattn.py`` along (transformers'
  ``custom_object_save`` copies the file of the module that defines the class). Were the
  vendored classes registered, transformers releases that prefer registered code to remote
  code (5.24 does, 5.0 does not) would build them from the second load of a Hub directory on,
  and no save of theirs would copy the file while ``config.json`` kept its ``auto_map``.
* **Saving** (:func:`write_modeling_file`, called by ``DiffAttnConfig.save_pretrained``, which a
  model's ``save_pretrained`` calls too). A configuration whose ``auto_map`` points at
  ``modeling_diffattn.py`` writes that file beside ``config.json`` when transformers copies it
  for no class: with diffattn's own classes, which transformers builds for a Hub directory
  once diffattn is imported, the file is generated from the installed package; with the
  vendored ones used directly, it is the ``modeling_diffattn.py`` the copy was unpacked from.
  So every save of a model or configuration loaded from a Hub directory is a Hub directory
  again, and ``diffattn convert --to hub`` writes the file the same way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from diffattn.hf.remote_code import MODELING_FILE, SOURCE_ATTRIBUTE, modeling_file

PACKAGE = "diffattn"


def vendored() -> bool:
    """Whether this is the copy vendored into ``modeling_diffattn.py`` (package renamed)."""
    return __name__.split(".")[0] != PACKAGE


def register_auto_class(auto_class: str, key: Any, value: type) -> None:
    """``transformers.<auto_class>.register(key, value, exist_ok=True)`` in diffattn; nothing
    in the vendored copy (module docstring)."""
    if vendored():
        return
    import transformers

    getattr(transformers, auto_class).register(key, value, exist_ok=True)


def points_at_modeling_file(auto_map: Any) -> bool:
    """Whether ``auto_map`` names a class of a ``modeling_diffattn.py`` beside ``config.json``
    (a reference to another repository's code, ``repo--module.Class``, does not count)."""
    if not isinstance(auto_map, dict):
        return False
    module = Path(MODELING_FILE).stem
    return any(
        isinstance(ref, str) and "--" not in ref and ref.split(".")[0] == module
        for ref in auto_map.values()
    )


def modeling_file_text(config: Any) -> str:
    """The ``modeling_diffattn.py`` of the classes running here for a model of ``config`` (a
    ``DiffAttnConfig``): generated from the installed package and the sources of the model's
    attention types in diffattn, the file the vendored copy was unpacked from in that copy."""
    if not vendored():
        return modeling_file(config.to_model_config().attention_types)
    package = sys.modules[__name__.split(".")[0]]
    path = getattr(package, SOURCE_ATTRIBUTE, None)
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"{package.__name__}: the {MODELING_FILE} it was unpacked from is gone ({path}); "
            "load the model with from_pretrained(..., trust_remote_code=True) again"
        )
    return Path(path).read_text(encoding="utf-8")


def write_modeling_file(config: Any, directory: str | os.PathLike) -> None:
    """Write ``modeling_diffattn.py`` into ``directory`` when ``config.auto_map`` points at it
    and transformers copies no file for ``config``'s class (its ``_auto_class`` is unset)."""
    if getattr(config, "_auto_class", None) is not None:
        return
    if not points_at_modeling_file(getattr(config, "auto_map", None)):
        return
    Path(directory, MODELING_FILE).write_text(modeling_file_text(config), encoding="utf-8")
