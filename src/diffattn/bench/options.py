"""The options of ``diffattn bench``: their definitions, what they imply (modes, lengths,
warmup, the longest position needed) and their validation (one message naming the option).

Split from :mod:`diffattn.bench.throughput`, which re-exports every public name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from diffattn.attention.kernels import resolve_backend
from diffattn.attention.registry import backend_names
from diffattn.bench.models import DEX_ROWS, hf_available

HEAD_DIM = 64
ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
MODES = ("fwd", "fwd+bwd", "decode")
MODE_CHOICES = (*MODES, "all")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
DEFAULT_SWEEP = {"cuda": (512, 1024, 2048, 4096, 8192), "cpu": (256, 512, 1024)}
"""Lengths ``--plot`` sweeps when ``--sweep`` is not given (CPU: affordable on a laptop)."""


def _lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 512,1024, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one length")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``diffattn bench`` to ``parser`` (in the order ``--help`` lists)."""
    _add_size_arguments(parser)
    _add_timing_arguments(parser)
    _add_device_arguments(parser)
    _add_row_arguments(parser)


def _add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The models' shape (heads of width ``--head-dim``, paired by DIFF V1 §2.1) and the batch."""
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument(
        "--d-model",
        type=int,
        default=512,
        help="model width, a multiple of 128 (heads of width 64, paired by V1)",
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument(
        "--head-dim",
        type=int,
        default=HEAD_DIM,
        help=f"width of the baseline's heads (default {HEAD_DIM}); n_heads = d_model / "
        "head_dim, and DIFF V1 pairs them",
    )
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="key/value heads (GQA); default d_model/64 (no grouping); DIFF V1 needs it even",
    )
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")


def _add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """What is timed and how often: repetitions, modes, decode lengths, compilation, memory."""
    parser.add_argument("--steps", type=int, default=3, help="timed repetitions per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument(
        "--mode",
        choices=MODE_CHOICES,
        default="all",
        help="what to time: fwd, fwd+bwd, decode or all three (default)",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="decode: prompt tokens (default --seq-len)"
    )
    parser.add_argument("--new-tokens", type=int, default=64, help="decode: tokens generated")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile our models as the trainer and generate do (during warmup): every "
        "decoder block through torch.compile for fwd and fwd+bwd, and the static-cache "
        "decode step (CUDA graphs on CUDA) for decode",
    )
    parser.add_argument(
        "--mem-seq-len",
        type=int,
        default=None,
        help="measure fwd and fwd+bwd peak memory at this length (default --seq-len)",
    )


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and how the models run, the peak for MFU, and the output format."""
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument(
        "--backend",
        default="auto",
        help="attention backend of the diffattn models: auto or a registered one "
        "(diffattn.attention.registry)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense peak TFLOP/s in --dtype, for MFU (known GPUs need none)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON array of records to stdout (progress to stderr)",
    )


def _add_row_arguments(parser: argparse.ArgumentParser) -> None:
    """Which rows are timed (ours, HF, Dex) and at which lengths, and the sweep's plot."""
    parser.add_argument(
        "--no-hf", action="store_true", help="skip the Hugging Face DiffLlama and Llama models"
    )
    parser.add_argument(
        "--dex",
        action="store_true",
        help="add HF Llama with Dex on half its heads, unmerged and merged (needs transformers)",
    )
    parser.add_argument(
        "--models",
        type=lambda text: [name for name in text.replace(",", " ").split() if name],
        default=None,
        help="time only these rows (e.g. baseline,hf_llama); each row's reference "
        "(baseline for ours, hf_llama for HF and Dex rows) must be among them",
    )
    parser.add_argument(
        "--sweep",
        type=_lengths,
        default=None,
        help="time at each of these sequence lengths (e.g. 512,1024,2048); decode prompts too",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write a PNG of tokens/s against sequence length per mode; sweeps "
        "512..8192 on CUDA and 256,512,1024 on CPU unless --sweep is given",
    )


# --------------------------------------------------------------------------------------
# what the options imply, and their validation
# --------------------------------------------------------------------------------------
def modes_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The modes ``--mode`` asks for, in report order."""
    return MODES if args.mode == "all" else (args.mode,)


def lengths_of(args: argparse.Namespace) -> list[int]:
    """The sequence lengths to time: ``--sweep``, the default sweep of ``--plot``, or
    ``--seq-len``."""
    if args.sweep:
        return sorted(set(args.sweep))
    if args.plot is not None:
        return list(DEFAULT_SWEEP[args.device])
    return [args.seq_len]


COMPILED_WARMUP = 2
"""Untimed repetitions at least, with ``--compile``: the first compiles, and the second may
compile again once ``auto`` has remembered its first choices."""


def warmup_of(args: argparse.Namespace) -> int:
    """Untimed repetitions before the timed ones (``--warmup``, raised for ``--compile``)."""
    return max(args.warmup, COMPILED_WARMUP) if args.compile else args.warmup


def prompt_len_of(args: argparse.Namespace, seq_len: int) -> int:
    """The decode prompt length at timed length ``seq_len``."""
    return args.prompt_len if args.prompt_len is not None else seq_len


def longest(args: argparse.Namespace) -> int:
    """The most positions any run of ``args`` needs (the models' ``max_seq_len``)."""
    need = [*lengths_of(args), args.mem_seq_len or 0]
    if "decode" in modes_of(args):
        need += [prompt_len_of(args, n) + args.new_tokens for n in lengths_of(args)]
    return max(need)


def _check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with ``args`` as a message naming the option, or ``None``."""
    minimum = {"seq_len": 2, "layers": 1, "vocab": 2, "batch": 1, "steps": 1, "warmup": 0}
    minimum |= {"new_tokens": 1, "prompt_len": 1, "mem_seq_len": 2, "kv_heads": 1}
    why = {"seq_len": " (the loss needs a next token)", "mem_seq_len": " (as --seq-len)"}
    optional = {"prompt_len", "mem_seq_len", "kv_heads"}
    for name, low in minimum.items():
        value = getattr(args, name)
        if value is None and name in optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            option = "--" + name.replace("_", "-")
            return f"{option} must be an integer >= {low}{why.get(name, '')}, got {value!r}"
    d_model, head_dim = args.d_model, args.head_dim
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2 or head_dim % 2:
        return f"--head-dim must be an even integer >= 2 (RoPE rotates pairs), got {head_dim!r}"
    if not isinstance(d_model, int) or d_model < 2 * head_dim or d_model % (2 * head_dim):
        return (
            f"--d-model must be a positive multiple of {2 * head_dim} (heads of width "
            f"{head_dim}, and DIFF V1 pairs them), got {d_model!r}"
        )
    heads = d_model // head_dim
    kv = args.kv_heads
    if kv is not None and (heads % kv or kv % 2):
        return (
            f"--kv-heads must be an even divisor of the {heads} heads (GQA groups; DIFF V1 "
            f"pairs key heads), got {kv}"
        )
    if args.mode not in MODE_CHOICES:
        return f"--mode must be one of {', '.join(MODE_CHOICES)}, got {args.mode!r}"
    if args.sweep is not None and min(args.sweep) < 2:
        return f"--sweep lengths must be integers >= 2, got {args.sweep}"
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        return f"--peak-tflops must be a positive number, got {args.peak_tflops!r}"
    if args.plot is not None and not args.plot.parent.is_dir():
        return f"--plot: the folder {str(args.plot.parent)!r} does not exist"
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        return f"--plot writes a PNG; give a path ending in .png, got {str(args.plot)!r}"
    if args.models is not None:
        problem = _check_models(args)
        if problem is not None:
            return problem
    if args.dex and (args.no_hf or not hf_available()):
        return "--dex adapts the HF Llama row: it needs transformers and no --no-hf"
    if args.device not in DEVICES:
        return f"--device must be one of {', '.join(DEVICES)}, got {args.device!r}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: CUDA is not available on this machine"
    if args.dtype not in DTYPES:
        return f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}"
    if args.backend not in backend_names():
        return f"--backend must be one of {', '.join(backend_names())}, got {args.backend!r}"
    probe = torch.empty(0, device=args.device, dtype=DTYPES[args.dtype])
    try:
        resolve_backend(args.backend, probe)
    except RuntimeError as error:
        return f"--backend {args.backend}: {error}"
    return None


def _check_models(args: argparse.Namespace) -> str | None:
    hf = ("hf_llama", "hf_diffllama")
    known = (*ATTENTIONS, *([] if args.no_hf else hf), *(DEX_ROWS if args.dex else ()))
    unknown = [name for name in args.models if name not in known]
    if unknown or not args.models:
        return f"--models: choose among {', '.join(known)}, got {', '.join(args.models) or 'none'}"
    for name in args.models:
        reference = "baseline" if name in ATTENTIONS else "hf_llama"
        if reference not in args.models:
            return (
                f"--models: {name} is compared with {reference}, so {reference} must be timed too"
            )
    return None
