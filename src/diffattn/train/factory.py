"""Training any ``nn.Module`` (``train(config, out, model_factory=make)``): building it, and its
checkpoints (a Hugging Face model's ``save_pretrained`` layout, or the full state dict) with
the trainer's state beside them. See :mod:`diffattn.train.trainer` for the contract."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn import fileio
from diffattn.train import checkpoint as ckpt
from diffattn.train.config import (
    ConfigError,
)
from diffattn.train.resume import (
    FACTORY_MARKER_NAME,
)

FACTORY_STATE_NAME = "model_state.safetensors"
HF_WEIGHTS_NAME = "model.safetensors"
"""A Hugging Face factory model's weights, named as ``save_pretrained`` names them."""


def takes_document_ids(model: nn.Module) -> bool:
    """Whether ``model.forward`` names a ``document_ids`` parameter (a ``**kwargs`` that would
    swallow it does not count)."""
    import inspect

    return "document_ids" in inspect.signature(model.forward).parameters


def factory_model(factory: Callable[[], nn.Module], vocab: int) -> nn.Module:
    """Build a ``model_factory`` model and check that it embeds every token."""
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model_factory", f"must return a torch.nn.Module, got {type(model).__name__}"
        )
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and vocab > rows:
        raise ConfigError(
            "data.tokenizer",
            f"the tokenizer has {vocab} tokens but the model embeds only {rows}",
        )
    return model


def is_plain_hf_model(model: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    """Whether ``model`` is a Hugging Face causal LM whose state (names and shapes) and modules
    are exactly what ``AutoModelForCausalLM.from_config(model.config)`` builds (built on the
    meta device), so its ``save_pretrained`` form loads back as the same model."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "save_pretrained", None)):
        return False
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(config)
    except Exception:  # not a causal LM transformers can build from its config
        return False
    expected = fresh.state_dict()
    if set(expected) != set(state) or any(expected[k].shape != state[k].shape for k in state):
        return False
    own = dict(model.named_modules())  # no module swapped for another under the same names
    return all(isinstance(own.get(name), type(module)) for name, module in fresh.named_modules())


def read_factory_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The state a factory checkpoint saved: ``model_state.safetensors``, or an HF model's
    ``model.safetensors`` (the marker names the file)."""
    import json

    from safetensors.torch import load_file

    marker = json.loads((checkpoint / FACTORY_MARKER_NAME).read_text())
    return load_file(str(checkpoint / marker.get("weights", FACTORY_STATE_NAME)))


def load_factory_state(model: nn.Module, state: dict[str, torch.Tensor], checkpoint: Path) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ConfigError(
            "resume", f"the checkpoint {checkpoint} does not fit the model: {error}"
        ) from None


def save_factory_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    config_yaml: str,
    tokenizer_dir: Path | None,
    keep_last: int | None,
) -> Path:
    """A checkpoint of a ``model_factory`` run: the full state dict (parameters and
    persistent buffers, tied tensors stored once per name) as safetensors, the trainer state,
    the config and the tokenizer files, written atomically like the preset runs'.

    A plain Hugging Face model (:func:`is_plain_hf_model`) is written as its
    ``save_pretrained`` directory instead (``config.json``, ``generation_config.json`` when it
    has one, ``model.safetensors``), so ``from_pretrained``, ``diffattn eval``, ``serve`` and
    the loaders read the checkpoint as any HF model; resume reads the same weights. A model
    with tensors its config does not build (a Dex model's adapter) keeps the state-dict form,
    which the loaders refuse rather than load without those tensors."""
    import json

    from safetensors.torch import save_file

    final = root / ckpt.checkpoint_name(step)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model_state.items()}
    hf_model = is_plain_hf_model(model, state)
    with fileio.atomic_directory(final, overwrite=True) as tmp:
        weights = HF_WEIGHTS_NAME if hf_model else FACTORY_STATE_NAME
        save_file(state, str(tmp / weights), metadata={"format": "pt"})
        if hf_model:
            model.config.save_pretrained(tmp)
            generation_config = getattr(model, "generation_config", None)
            if generation_config is not None:
                generation_config.save_pretrained(tmp)
        marker = {
            "model_class": type(model).__name__,
            "step": step,
            "tensors": len(state),
            "weights": weights,
        }
        (tmp / FACTORY_MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        torch.save(
            ckpt.to_safe({"format": ckpt.FORMAT_VERSION, **trainer_state}),
            tmp / ckpt.TRAINER_STATE_NAME,
        )
        (tmp / ckpt.CONFIG_YAML_NAME).write_text(config_yaml, encoding="utf-8")
        if tokenizer_dir is not None:
            fileio.copy_tokenizer_files(tokenizer_dir, tmp)
    ckpt.prune(root, keep_last)
    return final


class NoProbe:
    """The λ probe of a model without diffattn attention layers: records nothing."""

    def capture(self):
        return contextlib.nullcontext()

    def collect(self, device: torch.device) -> dict[str, Any]:
        return {}

    def remove(self) -> None:
        pass
