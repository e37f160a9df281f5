"""Save and load a Dex adapter on its own: ``dex_adapter.safetensors`` + ``dex_config.json``.

The adapter holds what Dex adds and trains on top of the pretrained weights:

* the selected heads of every adapted layer, W_D and λ_learn (Eq.3–5);
* the schedule state of Eq.4: the step t, the annealing duration T and each layer's λ_init;
* by default also the weights Dex trains inside attention (§3.4: W_K, W_V, W_O of the
  trainable set, under their model parameter names), since without them a trained adapter
  does not reproduce the trained model. ``include_trained_weights=False`` leaves them out.

Loading onto a fresh copy of the same pretrained model reproduces the Dex model's outputs
exactly; a model of another shape (layer count, heads, head width, parameter shapes) is
refused with a message naming the difference. A truncated or corrupt weights file, or a
``dex_config.json`` that is not valid JSON or lacks or mistypes an entry, raises
:class:`AdapterError` (a ``ValueError``) naming the file, before the model is touched.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from diffattn.checkpoint import read_safetensors
from diffattn.dex.adapter import (
    TRAIN_ATTENTION,
    apply,
    dex_sites,
    is_dex,
    named_trainable_parameters,
)
from diffattn.dex.adapter import freeze as freeze_model
from diffattn.dex.schedule import set_step
from diffattn.dex.sites import find_attention
from diffattn.fileio import CheckpointError, give_usual_permissions, read_json, write_json

WEIGHTS_NAME = "dex_adapter.safetensors"
CONFIG_NAME = "dex_config.json"
FORMAT = "diffattn-dex"
VERSION = 1


class AdapterError(ValueError):
    """A Dex adapter directory that cannot be read: the message names the file and the
    problem."""


def save_adapter(
    model: nn.Module,
    directory: str | Path,
    include_trained_weights: bool = True,
    attention: str = "adapted",
) -> Path:
    """Write the adapter of a Dex model to ``directory`` (created); returns the directory.

    ``attention`` names the K/V/O set that was trained (as in :func:`~diffattn.dex.freeze`).
    """
    pairs = dex_sites(model)
    sites = find_attention(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for site, dex in pairs:
        tensors[f"dex.{site.index}.w_d"] = dex.w_d.detach().cpu().contiguous().clone()
        tensors[f"dex.{site.index}.lambda_learn"] = dex.lambda_learn.detach().cpu().clone()
        layers.append(
            {
                "index": site.index,
                "name": site.name,
                "heads": dex.selected,
                "lambda_init": float(dex.lambda_init),
            }
        )
    trained = []
    if include_trained_weights:
        for name, param in named_trainable_parameters(model, attention):
            if ".dex." in f".{name}":
                continue
            tensors[f"model.{name}"] = param.detach().cpu().contiguous().clone()
            trained.append(name)
    first = pairs[0][1]
    config = {
        "format": FORMAT,
        "version": VERSION,
        "model_class": type(model).__name__,
        "n_layers": len(sites),
        "n_heads": [s.n_heads for s in sites],
        "n_kv_heads": [s.n_kv_heads for s in sites],
        "head_dim": [s.head_dim for s in sites],
        "step": int(first.step),
        "anneal_steps": int(first.anneal_steps),
        "w_d_init": first.w_d_init,
        "attention": attention,
        "layers": layers,
        "trained_weights": trained,
    }
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": FORMAT})
    give_usual_permissions(directory / WEIGHTS_NAME)  # save_file makes 0600
    write_json(directory / CONFIG_NAME, config)
    return directory


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _config_problem(config: dict[str, Any]) -> str | None:
    """The first entry of an adapter config that is missing or of the wrong kind, or None."""
    n_layers = config.get("n_layers")
    if not _is_int(n_layers, 1):
        return f"'n_layers' must be a positive integer, got {n_layers!r}"
    for key in ("n_heads", "n_kv_heads", "head_dim"):
        value = config.get(key)
        if not (
            isinstance(value, list) and len(value) == n_layers and all(_is_int(v, 1) for v in value)
        ):
            return f"{key!r} must list {n_layers} positive integers (one per layer), got {value!r}"
    for key in ("step", "anneal_steps"):
        if not _is_int(config.get(key)):
            return f"{key!r} must be a non-negative integer, got {config.get(key)!r}"
    w_d_init = config.get("w_d_init", "identity")
    if w_d_init not in ("identity", "zeros") and not _is_number(w_d_init):
        return f"'w_d_init' must be 'identity', 'zeros' or a number, got {w_d_init!r}"
    attention = config.get("attention", "adapted")
    if attention not in TRAIN_ATTENTION:
        return f"'attention' must be one of {', '.join(TRAIN_ATTENTION)}, got {attention!r}"
    trained = config.get("trained_weights")
    if not isinstance(trained, list) or not all(isinstance(t, str) for t in trained):
        return f"'trained_weights' must be a list of parameter names, got {trained!r}"
    layers = config.get("layers")
    if not isinstance(layers, list) or not layers:
        return f"'layers' must be a non-empty list of layer objects, got {layers!r}"
    seen: set[int] = set()
    for number, layer in enumerate(layers):
        where = f"layers[{number}]"
        if not isinstance(layer, dict):
            return f"{where} must be an object, got {layer!r}"
        index = layer.get("index")
        if not _is_int(index) or index >= n_layers:
            return f"{where}.index must be a layer index below {n_layers}, got {index!r}"
        if index in seen:
            return f"{where}.index {index} appears twice"
        seen.add(index)
        heads = layer.get("heads")
        n_heads = config["n_heads"][index]
        if (
            not isinstance(heads, list)
            or not heads
            or not all(_is_int(h) and h < n_heads for h in heads)
            or len(set(heads)) != len(heads)
        ):
            return f"{where}.heads must list distinct head indices below {n_heads}, got {heads!r}"
        if not _is_number(layer.get("lambda_init")):
            return f"{where}.lambda_init must be a finite number, got {layer.get('lambda_init')!r}"
    return None


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """The JSON half of an adapter directory (a clear error, naming the file, when it is not
    one or the file is malformed)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"{directory} is not a Dex adapter directory: {CONFIG_NAME} is missing")
    try:
        config = read_json(path)
    except CheckpointError as error:
        raise AdapterError(str(error)) from None
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise AdapterError(
            f"{path} is not a version-{VERSION} {FORMAT} adapter "
            f"(format={config.get('format')!r}, version={config.get('version')!r})"
        )
    problem = _config_problem(config)
    if problem is not None:
        raise AdapterError(f"{path}: malformed Dex adapter config: {problem}")
    return config


def read_adapter_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an adapter directory; a missing, truncated or corrupt file, or one
    holding non-float or non-finite tensors, raises :class:`AdapterError` naming it."""
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise AdapterError(f"{path}: missing; {directory} is not a complete Dex adapter")
    try:
        tensors = read_safetensors([path])
    except CheckpointError as error:
        raise AdapterError(str(error)) from None
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise AdapterError(f"{path}: {name} holds {tensor.dtype} values, expected floats")
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{path}: {name} holds non-finite values (a corrupt file?)")
    return tensors


def _check_shape(config: dict[str, Any], model: nn.Module) -> None:
    sites = find_attention(model)
    mine = {
        "attention layers": len(sites),
        "heads per layer": [s.n_heads for s in sites],
        "key/value heads per layer": [s.n_kv_heads for s in sites],
        "head width per layer": [s.head_dim for s in sites],
    }
    theirs = {
        "attention layers": config["n_layers"],
        "heads per layer": config["n_heads"],
        "key/value heads per layer": config["n_kv_heads"],
        "head width per layer": config["head_dim"],
    }
    for what, value in theirs.items():
        if value != mine[what]:
            raise ValueError(
                f"the Dex adapter does not fit this {type(model).__name__}: it was saved for "
                f"{what} = {value}, the model has {mine[what]}"
            )


@torch.no_grad()
def load_adapter(model: nn.Module, directory: str | Path, freeze: bool = True) -> nn.Module:
    """Apply the saved adapter to a fresh pretrained ``model`` (in place) and return it.

    Raises:
        AdapterError: not an adapter directory, a malformed ``dex_config.json``, or a
            missing, truncated or corrupt weights file (named in the message).
        ValueError: Dex already applied, or a model whose shape or parameters differ from
            the one the adapter was saved from. Nothing of the model changes on any error.
    """
    config = read_adapter_config(directory)
    if is_dex(model):
        raise ValueError(f"{type(model).__name__} already has Dex applied; load onto a fresh model")
    _check_shape(config, model)
    tensors = read_adapter_weights(directory)
    weights = Path(directory) / WEIGHTS_NAME
    params = dict(model.named_parameters())
    for name in config["trained_weights"]:
        key = f"model.{name}"
        if name not in params:
            raise ValueError(f"the Dex adapter holds {name!r}, which this model does not have")
        if key not in tensors:
            raise AdapterError(f"{weights}: lacks {key}, which {CONFIG_NAME} lists")
        if tuple(tensors[key].shape) != tuple(params[name].shape):
            raise ValueError(
                f"the Dex adapter's {name} has shape {tuple(tensors[key].shape)}, "
                f"the model's {tuple(params[name].shape)}"
            )
    layers = config["layers"]
    for layer in layers:
        index, k = layer["index"], len(layer["heads"])
        d = config["head_dim"][index]
        for key, shape in (("w_d", (k, d, d)), ("lambda_learn", ())):
            name = f"dex.{index}.{key}"
            if name not in tensors:
                raise AdapterError(f"{weights}: lacks {name}, which {CONFIG_NAME} lists")
            if tuple(tensors[name].shape) != shape:
                raise AdapterError(
                    f"{weights}: {name} has shape {tuple(tensors[name].shape)}, "
                    f"expected {shape} for {k} heads of width {d}"
                )
    heads = {layer["index"]: layer["heads"] for layer in layers}
    apply(model, heads, anneal_steps=config["anneal_steps"], lambda_init=0.0, freeze=False)
    by_index = {layer["index"]: layer for layer in layers}
    for site, dex in dex_sites(model):
        layer = by_index[site.index]
        dex.w_d.copy_(tensors[f"dex.{site.index}.w_d"])
        dex.lambda_learn.copy_(tensors[f"dex.{site.index}.lambda_learn"])
        dex.lambda_init.fill_(layer["lambda_init"])
        dex.w_d_init = config.get("w_d_init", "identity")
    for name in config["trained_weights"]:
        params[name].copy_(tensors[f"model.{name}"])
    set_step(model, config["step"])
    if freeze:
        freeze_model(model, config.get("attention", "adapted"))
    return model
