"""``diffattn convert SRC OUT --grow-signal-heads FACTOR``: a GDA model directory grown by
group-differentiated growth (:mod:`diffattn.attention.gda_growth`), written as a new diffattn
model directory that computes the same function.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from diffattn.attention.gda_growth import gda_layers, grow_signal_heads
from diffattn.convert.common import (
    cast_state,
    check_output_dir,
    parse_dtype,
    read_diffattn_dir,
    token_ids,
    write_diffattn_dir,
)
from diffattn.convert.detect import resolve_convert_source


def grow_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    factor: int,
    *,
    symmetry_noise: float = 0.0,
    seed: int = 0,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
) -> Path:
    """Grow every GDA layer of the diffattn model directory ``src`` by ``factor`` copies of
    each signal head and write the result to ``out`` (atomically; tokenizer files and special
    token ids carried over); returns ``out``.

    ``symmetry_noise`` (std of the copies' zero-sum W_O perturbation, drawn from ``seed``)
    lets training separate the copies; ``dtype`` casts floating tensors as ``convert`` does.
    Everything is checked before anything is written: a source that is not a diffattn model
    directory or has no GDA layer, a bad factor or an unusable ``out`` raise ``ValueError``
    and leave ``out`` as it was.
    """
    kind, path = resolve_convert_source(src)
    if kind != "diffattn":
        what = (
            "a sharded training checkpoint (convert it to diffattn first)"
            if kind == "diffattn-sharded"
            else f"a {kind} checkpoint"
        )
        raise ValueError(
            f"--grow-signal-heads grows a diffattn model directory with GDA layers; {src} is {what}"
        )
    torch_dtype = parse_dtype(dtype)
    out = Path(out)
    check_output_dir(path, out, overwrite)
    config, state, raw = read_diffattn_dir(path)
    if not gda_layers(config):
        names = ", ".join(declaration.name for declaration in config.attention_types)
        raise ValueError(
            f"--grow-signal-heads applies to GDA models (attention type 'gda'); {path} is a "
            f"{names} model"
        )
    generator = torch.Generator().manual_seed(seed)
    new_config, new_state = grow_signal_heads(
        state, config, factor, symmetry_noise=symmetry_noise, generator=generator
    )
    return write_diffattn_dir(
        new_config,
        cast_state(new_state, torch_dtype),
        out,
        overwrite=overwrite,
        tokenizer_dir=path,
        ids=token_ids(raw),
    )
