"""Save and load a Dex adapter on its own: ``dex_adapter.safetensors`` + ``dex_config.json``.

The adapter holds what Dex adds and trains on top of the pretrained weights:

* the selected heads of every adapted layer, W_D and λ_learn (Eq.3–5);
* the schedule state of Eq.4: the step t, the annealing duration T and each layer's λ_init;
* by default also the weights Dex trains inside attention (§3.4: W_K, W_V, W_O of the
  trainable set, under their model parameter names), since without them a trained adapter
  does not reproduce the trained model. ``include_trained_weights=False`` leaves them out.

Loading onto a fresh copy of the same pretrained model reproduces the Dex model's outputs
exactly; a model of another shape (layer count, heads, head width, parameter shapes) is
refused with a message naming the difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from diffattn.checkpoint import read_safetensors
from diffattn.dex.adapter import apply, dex_sites, is_dex, named_trainable_parameters
from diffattn.dex.adapter import freeze as freeze_model
from diffattn.dex.schedule import set_step
from diffattn.dex.sites import find_attention
from diffattn.fileio import read_json, write_json

WEIGHTS_NAME = "dex_adapter.safetensors"
CONFIG_NAME = "dex_config.json"
FORMAT = "diffattn-dex"
VERSION = 1


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
    write_json(directory / CONFIG_NAME, config)
    return directory


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """The JSON half of an adapter directory (a clear error, naming the file, when it is not
    one or the file is malformed)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{directory} is not a Dex adapter directory: {CONFIG_NAME} is missing")
    config = read_json(path)
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ValueError(
            f"{path} is not a version-{VERSION} {FORMAT} adapter "
            f"(format={config.get('format')!r}, version={config.get('version')!r})"
        )
    return config


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
        ValueError: not an adapter directory, Dex already applied, or a model whose shape
            or parameters differ from the one the adapter was saved from.
    """
    config = read_adapter_config(directory)
    if is_dex(model):
        raise ValueError(f"{type(model).__name__} already has Dex applied; load onto a fresh model")
    _check_shape(config, model)
    tensors = read_safetensors([Path(directory) / WEIGHTS_NAME])
    params = dict(model.named_parameters())
    for name in config["trained_weights"]:
        key = f"model.{name}"
        if name not in params:
            raise ValueError(f"the Dex adapter holds {name!r}, which this model does not have")
        if key not in tensors:
            raise ValueError(f"the Dex adapter lists {name!r} but its weights file lacks it")
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
                raise ValueError(f"the Dex adapter's weights file lacks {name}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(
                    f"the Dex adapter's {name} has shape {tuple(tensors[name].shape)}, "
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
