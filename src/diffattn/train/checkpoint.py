"""Training checkpoints: ``OUT/checkpoints/step-XXXXXXXX/``, written atomically, last k kept.

A full checkpoint (``checkpoint_format: full``, the default outside FSDP2) is also a diffattn
model directory (``config.json`` + ``model.safetensors``, written by
:func:`diffattn.checkpoint.save_model`), so ``load_model(OUT/checkpoints/step-00001000)`` loads
it. A sharded one (:mod:`diffattn.train.sharded`, the default under ``parallel: fsdp``) holds
``config.json`` and the DCP shards in ``sharded/`` instead; ``diffattn convert`` writes the
model directory from it. Next to the model it holds:

* ``trainer_state.pt``: the step, the optimizer state (full, keyed by parameter names; in the
  shards of a sharded checkpoint), the learning-rate schedule, the loss-spike detector, and
  per rank the RNG states (python, numpy, torch CPU and CUDA) and the data loader position.
  It is read with ``torch.load(weights_only=True)`` only: plain containers and tensors, no
  pickled objects.
* ``train_config.yaml``: the resolved training config.
* the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``).

Beside the checkpoints, ``checkpoints/latest`` is a link to the newest one and
``checkpoints/final`` to the one of the run's last step (``steps`` reached), so
``OUT/checkpoints/final`` is a model path. A resumed run that goes further moves ``final``
only when it writes a newer checkpoint: away from the old one, and to the new one at its new
last step. Both are relative symbolic links, replaced atomically.

A checkpoint is listed (:func:`list_checkpoints`) once its ``trainer_state.pt`` is in place;
whether its files are whole (none lost or cut off since) is :func:`check_checkpoint_files`'s
question, asked before a resume or a load uses it.

Atomicity: everything is written with :func:`diffattn.fileio.atomic_directory` into a hidden
temporary sibling (``.step-XXXXXXXX.tmp-*``), flushed to disk, and renamed into place, so a
crash (even ``kill -9``) leaves either the complete checkpoint or none; leftovers are removed
at the next start (:func:`diffattn.fileio.remove_partial_writes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffattn.checkpoint import (
    CONFIG_NAME,
    CheckpointError,
    config_to_json_dict,
    read_config,
    write_model_files,
)
from diffattn.config import ModelConfig
from diffattn.fileio import TEMP_MARKER, atomic_directory, copy_tokenizer_files
from diffattn.model import DiffTransformerLM

CHECKPOINTS_DIRNAME = "checkpoints"
TRAINER_STATE_NAME = "trainer_state.pt"
CONFIG_YAML_NAME = "train_config.yaml"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{8,})$")
LATEST_ENTRY = "latest"
FINAL_ENTRY = "final"

# ModelConfig fields that do not change the weights or the function; they may differ on resume.


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_RE.match(path.name)
        if match and path.is_dir() and (path / TRAINER_STATE_NAME).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def point_entry(root: str | os.PathLike, name: str, checkpoint: Path) -> None:
    """Make ``root/name`` a relative link to the checkpoint ``checkpoint`` (in ``root``),
    replacing an older link atomically (a reader sees the old target or the new one)."""
    root = Path(root)
    entry = root / name
    if entry.is_dir() and not entry.is_symlink():
        # a copy that followed the link (shutil.copytree, cp -L): the checkpoint itself is kept
        if not (entry / TRAINER_STATE_NAME).is_file():
            raise CheckpointError(f"{entry}: a directory that is no checkpoint copy; move it away")
        shutil.rmtree(entry)
    tmp = root / f".{name}{TEMP_MARKER}{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(checkpoint.name, tmp, target_is_directory=True)
    os.replace(tmp, entry)


def clear_entry(root: str | os.PathLike, name: str) -> None:
    """Remove the link ``root/name`` if there is one."""
    path = Path(root) / name
    if path.is_symlink():
        path.unlink()


def read_entry(root: str | os.PathLike, name: str) -> Path | None:
    """The complete checkpoint the link ``root/name`` points to, or ``None``."""
    path = Path(root) / name
    if not path.is_symlink():
        return None
    target = Path(root) / os.readlink(path)
    match = _STEP_RE.match(target.name)
    complete = target.parent == Path(root) and (target / TRAINER_STATE_NAME).is_file()
    return target if match and complete else None


def prune(root: str | os.PathLike, keep_last: int | None) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints; returns the deleted paths."""
    if keep_last is None:
        return []
    found = list_checkpoints(root)
    doomed = [path for _, path in found[: max(0, len(found) - keep_last)]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model_config: ModelConfig,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    config_yaml: str,
    tokenizer_dir: str | os.PathLike | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write one checkpoint (rank 0 only; the states are already gathered). Returns its path.

    ``tokenizer_dir``: a directory of tokenizer files copied beside the weights.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    with torch.device("meta"):
        skeleton = DiffTransformerLM(model_config)
    skeleton.load_state_dict(model_state, strict=True, assign=True)
    with atomic_directory(final, overwrite=True) as tmp:
        write_model_files(skeleton, tmp)
        write_run_files(tmp, trainer_state, config_yaml, tokenizer_dir)
    prune(root, keep_last)
    return final


def write_run_files(
    directory: Path,
    trainer_state: dict[str, Any],
    config_yaml: str,
    tokenizer_dir: str | os.PathLike | None,
    model_config: ModelConfig | None = None,
) -> None:
    """The files every checkpoint holds beside its weights: ``trainer_state.pt``,
    ``train_config.yaml``, the tokenizer, and (``model_config``: for a checkpoint whose
    weights are not a model directory's, a sharded one) ``config.json``."""
    state = {"format": FORMAT_VERSION, **trainer_state}
    torch.save(to_safe(state), directory / TRAINER_STATE_NAME)
    (directory / CONFIG_YAML_NAME).write_text(config_yaml, encoding="utf-8")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, directory)
    if model_config is not None:
        text = json.dumps(config_to_json_dict(model_config), indent=2, sort_keys=True)
        (directory / CONFIG_NAME).write_text(text + "\n", encoding="utf-8")


def check_checkpoint_files(checkpoint: str | os.PathLike, diffattn_model: bool = True) -> None:
    """Check that a checkpoint's files are complete without reading the tensors: every
    safetensors header parses and its file has the size the header describes, or (a sharded
    checkpoint) every shard file its ``.metadata`` names is there and long enough,
    ``trainer_state.pt`` is a complete archive, and (``diffattn_model``) ``config.json`` is a
    valid diffattn config. A missing, cut-off or unreadable file raises a
    :class:`CheckpointError` naming it."""
    from diffattn.checkpoint import SHARDED_DIRNAME, check_safetensors_files, check_sharded_files

    checkpoint = Path(checkpoint)
    state = checkpoint / TRAINER_STATE_NAME
    try:
        with zipfile.ZipFile(state) as archive:
            archive.infolist()
    except (OSError, zipfile.BadZipFile) as error:
        raise CheckpointError(f"{state}: unreadable ({error})") from None
    if (checkpoint / SHARDED_DIRNAME).is_dir():  # diffattn.train.sharded
        check_sharded_files(checkpoint)
    else:
        weights = sorted(checkpoint.glob("*.safetensors"))
        if not weights:
            raise CheckpointError(f"{checkpoint}: no .safetensors weights")
        check_safetensors_files(weights)
    if diffattn_model:
        read_config(checkpoint)


def checkpoint_problem(checkpoint: str | os.PathLike, diffattn_model: bool = True) -> str | None:
    """Why the checkpoint's files are not whole (:func:`check_checkpoint_files`'s message,
    naming the file), or ``None``."""
    try:
        check_checkpoint_files(checkpoint, diffattn_model=diffattn_model)
    except ValueError as error:
        return str(error)
    return None


def load_trainer_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint, read with ``weights_only=True``."""
    path = Path(checkpoint) / TRAINER_STATE_NAME
    if not path.is_file():
        raise CheckpointError(f"{checkpoint}: no {TRAINER_STATE_NAME} (not a training checkpoint)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling errors come in many types
        raise CheckpointError(f"{path}: unreadable ({error})") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown trainer-state format")
    return from_safe(state)


def load_model_state(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model state dict of a checkpoint (names as in ``DiffTransformerLM.state_dict``)."""
    from diffattn.checkpoint import KEY_PREFIX, read_safetensors, weight_files

    state = read_safetensors(weight_files(checkpoint))
    return {k[len(KEY_PREFIX) :] if k.startswith(KEY_PREFIX) else k: v for k, v in state.items()}


def model_config_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """``field: saved (checkpoint) vs current (config)`` for each weight-relevant difference."""
    a, b = saved.to_dict(), current.to_dict()
    return [
        f"{name}: {a[name]!r} (checkpoint) vs {b[name]!r} (config)"
        for name in a
        if name != "extra" and a[name] != b.get(name)
    ]


def read_checkpoint_model_config(checkpoint: str | os.PathLike) -> ModelConfig:
    return read_config(checkpoint)


# ----------------------------------------------------------------------------------------
# RNG states
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and CUDA generator states as plain values and tensors."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": np_state,
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


# ----------------------------------------------------------------------------------------
# weights_only-safe containers
_ARRAY_TAG = "__ndarray__"


def to_safe(obj: Any) -> Any:
    """``obj`` with numpy arrays and scalars replaced by tensors / Python numbers, so that
    ``torch.load(weights_only=True)`` reads it; :func:`from_safe` undoes it."""
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        if array.dtype.kind == "u":  # stored as int64, bit for bit
            array = array.view(np.int64) if array.itemsize == 8 else array.astype(np.int64)
        return {_ARRAY_TAG: torch.from_numpy(array.copy()), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    return _map_items(obj, to_safe)


def from_safe(obj: Any) -> Any:
    if isinstance(obj, dict) and set(obj) == {_ARRAY_TAG, "dtype"}:
        array, dtype = obj[_ARRAY_TAG].numpy(), np.dtype(obj["dtype"])
        if dtype.kind == "u" and dtype.itemsize == 8:
            return array.view(dtype)
        return array.astype(dtype)
    return _map_items(obj, from_safe)


def _map_items(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """A dict, list or tuple rebuilt with ``fn`` applied to each value; anything else as is."""
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fn(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(fn(v) for v in obj)
    return obj
