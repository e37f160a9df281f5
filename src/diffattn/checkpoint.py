"""Model directories: ``config.json`` + safetensors weights, readable by diffattn and by HF.

A diffattn model directory is exactly what ``DiffAttnForCausalLM.save_pretrained`` writes, so
``AutoModelForCausalLM.from_pretrained(dir)`` (after ``import diffattn``) and
:func:`load_model` read the same files:

* ``config.json``: ``{"model_type": "diffattn", "architectures": ["DiffAttnForCausalLM"],
  ...every ModelConfig field...}`` (``tie_word_embeddings`` mirrors ``tie_embeddings``);
* ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``): the
  :class:`~diffattn.model.DiffTransformerLM` state dict with every key prefixed ``model.``
  (the HF wrapper holds the LM as ``self.model``); a tied LM head is not stored.

A sharded training checkpoint (:mod:`diffattn.train.sharded`) holds ``config.json`` and, in
place of safetensors, ``sharded/``: ``torch.distributed.checkpoint``'s ``.metadata`` and the
``.distcp`` files it names. :func:`check_sharded_files` checks that those files are all there
and long enough without reading a tensor; loading one directly is refused with the command
that consolidates it.

Loading is strict and safe: weights come only from safetensors (a pickle ``.bin`` is refused),
shard names of an index must stay inside the directory, missing / unexpected / mis-shaped
tensors and tensors of the wrong dtype kind are named in one error, so is the first tensor
holding NaN or infinite values, and a foreign ``model_type`` is rejected with a pointer to
``diffattn convert``. Saving is atomic (:func:`diffattn.fileio.atomic_directory`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from diffattn.config import RUNTIME_FIELDS, ModelConfig
from diffattn.fileio import CheckpointError, atomic_directory, read_json
from diffattn.model import DiffTransformerLM

MODEL_TYPE = "diffattn"
ARCHITECTURE = "DiffAttnForCausalLM"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
KEY_PREFIX = "model."
SHARDED_DIRNAME = "sharded"
SHARD_METADATA_NAME = ".metadata"

# Keys HF's PretrainedConfig adds to config.json; they are not ModelConfig fields.
_HF_CONFIG_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "tie_word_embeddings",
        "diffattn_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "auto_map",
        "_name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
        "is_encoder_decoder",
        "chunk_size_feed_forward",
        "add_cross_attention",
        "tokenizer_class",
        "problem_type",
        "id2label",
        "label2id",
    }
)


# ----------------------------------------------------------------------------------------
# config.json
def config_to_json_dict(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` content for ``config`` (HF-compatible, see module docstring)."""
    from diffattn.version import __version__

    data = {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURE]}
    data.update(config.to_dict())
    data.pop("extra", None)
    data["tie_word_embeddings"] = config.tie_embeddings
    data["diffattn_version"] = __version__
    return data


def config_from_json_dict(data: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Parse a ``config.json`` dict; a ``model_type`` other than ``diffattn`` is an error."""
    model_type = data.get("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointError(
            f"{source}: model_type is {model_type!r}, not {MODEL_TYPE!r}. "
            "To bring in a Hugging Face Llama or DiffLlama checkpoint, run "
            "`diffattn convert SRC_DIR OUT_DIR` first."
        )
    # Earlier versions saved the run-time backend as if it were architecture; it is ignored.
    fields = {k: v for k, v in data.items() if k not in _HF_CONFIG_KEYS | RUNTIME_FIELDS}
    if "tie_word_embeddings" in data and "tie_embeddings" not in fields:
        fields["tie_embeddings"] = bool(data["tie_word_embeddings"])
    try:
        return ModelConfig.from_dict(fields)
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from error


def read_config(path: str | os.PathLike) -> ModelConfig:
    """Read the :class:`ModelConfig` of a model directory (or of a ``config.json`` file)."""
    path = Path(path)
    file = path / CONFIG_NAME if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_NAME} found (not a model directory)")
    return config_from_json_dict(read_json(file), source=str(file))


# ----------------------------------------------------------------------------------------
# weights
def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model directory, refusing pickle checkpoints."""
    directory = Path(directory)
    if (directory / SHARDED_DIRNAME).is_dir() and not any(directory.glob("*.safetensors")):
        check_sharded_files(directory)  # a damaged one: the error names the file
        raise CheckpointError(
            f"{directory}: a sharded training checkpoint (DCP shards, no safetensors); write "
            f"a model directory from it first: diffattn convert {directory} OUT"
        )
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except (KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{index}: not a valid safetensors index ({error})") from error
        files = [_shard_path(directory, name, index) for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return files
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    others = sorted(directory.glob("*.safetensors"))
    if others:
        return others
    pickles = [name for name in PICKLE_NAMES if (directory / name).exists()]
    if pickles or list(directory.glob("*.bin")):
        found = pickles or [p.name for p in directory.glob("*.bin")]
        raise CheckpointError(
            f"{directory}: only pickle weights found ({', '.join(found)}). diffattn loads "
            "weights from safetensors only, because unpickling can run arbitrary code. "
            "Re-save the model with safetensors (e.g. `save_pretrained(..., "
            "safe_serialization=True)`)."
        )
    raise CheckpointError(f"{directory}: no {WEIGHTS_NAME} found")


def _shard_path(directory: Path, name: Any, index: Path) -> Path:
    """The shard ``name`` of ``index``, refusing names that reach outside ``directory``."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index}: shard name {name!r} is not a file name")
    relative = Path(name)
    inside = directory.resolve()
    if relative.is_absolute() or ".." in relative.parts or "\\" in name:
        raise CheckpointError(f"{index}: shard {name!r} points outside the model directory")
    if not (directory / relative).resolve().is_relative_to(inside):
        raise CheckpointError(f"{index}: shard {name!r} points outside the model directory")
    return directory / relative


def check_finite(state: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise a :class:`CheckpointError` naming the first floating tensor (in name order) that
    holds a NaN or an infinity; for any loader that wants to refuse broken weights."""
    for name in sorted(state):
        tensor = state[name]
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
            raise CheckpointError(f"{source}: tensor {name} holds {bad} values")


def check_safetensors_files(files: list[Path]) -> None:
    """Check that each file is a complete safetensors file (its header parses and its size is
    exactly what the header describes) without reading the tensors; a truncated or corrupt
    file is named in a :class:`CheckpointError`. For loaders that read the files themselves
    (e.g. ``from_pretrained``) and would report a bare parse error."""
    for file in files:
        try:
            size = file.stat().st_size
            with open(file, "rb") as handle:
                prefix = handle.read(8)
                header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
                if header_len < 2 or 8 + header_len > size:
                    raise ValueError("the header is cut off")
                header = json.loads(handle.read(header_len))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            ends = [
                entry["data_offsets"][1]
                for key, entry in header.items()
                if key != "__metadata__" and isinstance(entry, dict)
            ]
        except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from error
        expected = 8 + header_len + max(ends, default=0)
        if size != expected:
            raise CheckpointError(
                f"{file}: truncated or padded safetensors file ({size} bytes, the header "
                f"describes {expected})"
            )


class _ShardMetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` pickle, which consists of DCP's own records (dataclasses and
    enums of ``torch.distributed.checkpoint``), ``torch.Size``, dtypes, layouts and paths;
    any other object it would build is refused, so reading it runs no foreign code."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = module.startswith("torch.distributed.checkpoint.") or module in (
            "torch",
            "torch.serialization",
            "pathlib",
        )
        found = super().find_class(module, name) if allowed else None
        if module.startswith("torch.distributed.checkpoint."):
            plain = isinstance(found, type) and (
                dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)
            )
        elif module == "torch":
            plain = found is torch.Size or isinstance(found, (torch.dtype, torch.layout))
        elif module == "torch.serialization":
            plain = name == "_get_layout"
        else:
            plain = isinstance(found, type) and issubclass(found, pathlib.PurePath)
        if not plain:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP never writes")
        return found


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (its type name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def read_shard_metadata(file: str | os.PathLike) -> dict[str, int]:
    """The shard files a DCP ``.metadata`` file names, each with the length it must have
    at least (the largest offset + length of the items it stores).

    Raises:
        CheckpointError: ``file`` is missing, unreadable or not DCP metadata (named).
    """
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; the shards beside it cannot be read without it")
    try:
        with open(file, "rb") as handle:
            metadata = _ShardMetadataUnpickler(handle).load()
        ends: dict[str, int] = {}
        for item in metadata.storage_data.values():
            name, end = item.relative_path, int(item.offset) + int(item.length)
            parts = pathlib.PurePath(name).parts if isinstance(name, str) else ()
            if not parts or pathlib.PurePath(name).is_absolute() or ".." in parts:
                raise ValueError(f"it names the shard file {name!r}, outside its directory")
            if item.offset < 0 or item.length < 0:
                raise ValueError(f"it gives {name} a negative offset or length")
            ends[name] = max(ends.get(name, 0), end)
    except Exception as error:  # unpickling a damaged file fails in many ways
        reason = _one_line(error)
        raise CheckpointError(f"{file}: not a readable DCP metadata file ({reason})") from None
    if not ends:
        raise CheckpointError(f"{file}: names no shard file")
    return ends


def check_sharded_files(checkpoint: str | os.PathLike) -> None:
    """Check that the sharded checkpoint ``checkpoint`` (its ``sharded/`` directory) is whole
    without reading a tensor: its ``.metadata`` is readable, every shard file it names is
    there and at least as long as the items it places in it.

    Raises:
        CheckpointError: naming the missing, short or unreadable file.
    """
    directory = Path(checkpoint) / SHARDED_DIRNAME
    metadata = directory / SHARD_METADATA_NAME
    where = f"{SHARDED_DIRNAME}/{SHARD_METADATA_NAME}"
    for name, end in sorted(read_shard_metadata(metadata).items()):
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing ({where} names it)")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(
                f"{file}: truncated ({size} bytes; {where} places items up to byte {end})"
            )


def read_safetensors(
    files: list[Path], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Read tensors from safetensors files; a corrupt or truncated file is named in the error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix in (".bin", ".pt", ".pth", ".pkl"):
            raise CheckpointError(f"{file}: pickle files are refused; use safetensors")
        try:
            part = load_file(str(file), device=str(device))
        except (SafetensorError, OSError, RuntimeError, ValueError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from error
        duplicate = state.keys() & part.keys()
        if duplicate:
            raise CheckpointError(f"{file}: tensor(s) stored twice: {sorted(duplicate)[:5]}")
        state.update(part)
    return state


def check_state_dict(
    expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor], source: str
) -> None:
    """Raise one :class:`CheckpointError` naming missing, unexpected and mis-shaped tensors,
    and tensors whose dtype is of another kind (an integer tensor for a float parameter)."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    misshaped = [
        f"{k} (expected {tuple(expected[k].shape)}, found {tuple(found[k].shape)})"
        for k in sorted(expected.keys() & found.keys())
        if tuple(expected[k].shape) != tuple(found[k].shape)
    ]
    miskinded = [
        f"{k} (expected {expected[k].dtype}, found {found[k].dtype})"
        for k in sorted(expected.keys() & found.keys())
        if _dtype_kind(expected[k].dtype) != _dtype_kind(found[k].dtype)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensor(s): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s): {', '.join(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensor(s): {', '.join(misshaped)}")
    if miskinded:
        problems.append(f"wrong-dtype tensor(s): {', '.join(miskinded)}")
    if problems:
        raise CheckpointError(f"{source}: weights do not match the config; " + "; ".join(problems))


def _dtype_kind(dtype: torch.dtype) -> str:
    """``float``, ``complex``, ``bool`` or ``int``: a stored tensor may differ from its
    parameter in precision (e.g. bfloat16 weights for a float32 model) but not in kind."""
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "int"


def model_state_for_saving(model: DiffTransformerLM) -> dict[str, torch.Tensor]:
    """The state dict as stored on disk: prefixed keys, contiguous tensors, no buffers."""
    return {KEY_PREFIX + k: v.detach().contiguous() for k, v in model.state_dict().items()}


def save_model(
    model: DiffTransformerLM,
    out_dir: str | os.PathLike,
    tokenizer: Any | None = None,
    overwrite: bool = False,
    extra_files: Mapping[str, Callable[[Path], None]] | None = None,
) -> Path:
    """Write ``model`` as a model directory (atomically). Returns the directory.

    ``tokenizer``: anything with ``save_pretrained(dir)`` (an HF tokenizer) or ``save(path)``
    (a ``tokenizers.Tokenizer``, written as ``tokenizer.json``), saved beside the weights.
    ``extra_files``: name -> writer(path) for additional files.
    """
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        write_model_files(model, tmp, tokenizer=tokenizer, extra_files=extra_files)
    return Path(out_dir)


def write_model_files(
    model: DiffTransformerLM,
    directory: str | os.PathLike,
    tokenizer: Any | None = None,
    extra_files: Mapping[str, Callable[[Path], None]] | None = None,
) -> Path:
    """Write the files of a model directory into the existing ``directory`` (not atomically:
    for a directory that is itself being written atomically, e.g. a training checkpoint).
    Arguments as in :func:`save_model`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    (directory / CONFIG_NAME).write_text(
        json.dumps(config_to_json_dict(model.config), indent=2, sort_keys=True) + "\n",
        encoding="utf-8",
    )
    save_file(
        model_state_for_saving(model), str(directory / WEIGHTS_NAME), metadata={"format": "pt"}
    )
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)
    for name, writer in (extra_files or {}).items():
        writer(directory / name)
    return directory


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """Save a tokenizer beside a model: an HF tokenizer (``save_pretrained``), a
    ``tokenizers.Tokenizer`` (written as ``tokenizer.json``) or a :mod:`diffattn.data`
    tokenizer (whose ``save`` writes its files into a directory)."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(directory))
    elif type(tokenizer).__module__.split(".")[0] == "tokenizers":
        tokenizer.save(str(directory / "tokenizer.json"))
    elif hasattr(tokenizer, "save"):
        tokenizer.save(directory)
    else:
        raise TypeError(f"cannot save a tokenizer of type {type(tokenizer).__name__}")


def load_model(
    directory: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> DiffTransformerLM:
    """Load a model directory written by :func:`save_model` or ``save_pretrained``.

    ``config_overrides`` replace config fields that do not change weights (e.g.
    ``backend="sdpa"``). The model is returned in eval mode.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    config = read_config(directory)
    if config_overrides:
        config = config.replace(**config_overrides)
    state = read_safetensors(weight_files(directory))
    with torch.device("meta"):
        model = DiffTransformerLM(config)
    expected = {KEY_PREFIX + k: v for k, v in model.state_dict().items()}
    check_state_dict(expected, state, str(directory))
    check_finite(state, str(directory))
    model.to_empty(device=device)
    model.rotary.reset_parameters()  # the only buffer (RoPE); parameters are loaded below
    model.load_state_dict({k[len(KEY_PREFIX) :]: v for k, v in state.items()}, strict=True)
    if dtype is not None:
        model.to(dtype=dtype)
    return model.eval()
