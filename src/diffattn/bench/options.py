"""The options of ``diffattn bench``: their one declaration (:class:`BenchSettings`), what they
imply (modes, lengths, warmup, the longest position needed) and their validation (one message
naming the option).

Split from :mod:`diffattn.bench.throughput`, which re-exports every public name.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffattn.attention.kernels import resolve_backend
from diffattn.attention.registry import backend_names
from diffattn.attention.types import attention_type, attention_type_names
from diffattn.bench.backends import DEVICES, DTYPES, HEAD_DIM, BackendsSettings
from diffattn.bench.models import DEX_ROWS, HF_ROWS, REFERENCE, hf_available
from diffattn.settings import Settings, like, setting

MODES = ("fwd", "fwd+bwd", "decode")
MODE_CHOICES = (*MODES, "all")
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


@dataclass(frozen=True)
class BenchSettings(Settings):
    """The settings of ``diffattn bench``, in the order ``--help`` lists them: the models' shape
    (heads of width ``--head-dim``, paired by DIFF V1 §2.1) and the batch; what is timed and how
    often; where and how the models run; which rows are timed and at which lengths.

    ``min`` is each count's lower bound, checked by :func:`_check_arguments` in the order and
    words the command has always used (:meth:`check` raises its message)."""

    # the models' shape and the batch
    seq_len: int = setting(2048, min=2, help="tokens per sequence")
    d_model: int = setting(
        512, help="model width, a multiple of 128 (heads of width 64, paired by V1)"
    )
    layers: int = setting(4, min=1, help="decoder layers")
    head_dim: int = setting(
        HEAD_DIM,
        help="width of the baseline's heads (default {default}); n_heads = d_model / "
        "head_dim, and DIFF V1 pairs them",
    )
    kv_heads: int | None = setting(
        None,
        min=1,
        help="key/value heads (GQA); default d_model/64 (no grouping); DIFF V1 needs it even",
    )
    vocab: int = setting(8192, min=2, help="vocabulary size")
    batch: int = setting(1, min=1, help="sequences per step")
    # what is timed and how often
    steps: int = setting(3, min=1, help="timed repetitions per mode")
    warmup: int = setting(1, min=0, help="untimed repetitions first")
    mode: str = setting(
        "all",
        choices=MODE_CHOICES,
        help="what to time: fwd, fwd+bwd, decode or all three (default)",
    )
    prompt_len: int | None = setting(None, min=1, help="decode: prompt tokens (default --seq-len)")
    new_tokens: int = setting(64, min=1, help="decode: tokens generated")
    compile: bool = setting(
        False,
        help="compile our models as the trainer and generate do (during warmup): every "
        "decoder block through torch.compile for fwd and fwd+bwd, and the static-cache "
        "decode step (CUDA graphs on CUDA) for decode",
    )
    mem_seq_len: int | None = setting(
        None,
        min=2,
        help="measure fwd and fwd+bwd peak memory at this length (default --seq-len)",
    )
    # where and how the models run, the peak for MFU, and the output format
    device: str = like(BackendsSettings, "device")  # as diffattn backends
    dtype: str = setting("fp32", choices=tuple(DTYPES))
    backend: str = setting(
        "auto",
        help="attention backend of the diffattn models: auto or a registered one "
        "(diffattn.attention.registry)",
    )
    peak_tflops: float | None = setting(
        None,
        help="the device's dense peak TFLOP/s in --dtype, for MFU (known GPUs need none)",
    )
    json: bool = setting(
        False, help="print one JSON array of records to stdout (progress to stderr)"
    )
    # which rows are timed (ours, HF, Dex) and at which lengths, and the sweep's plot
    no_hf: bool = setting(False, help="skip the Hugging Face DiffLlama and Llama models")
    dex: bool = setting(
        False,
        help="add HF Llama with Dex on half its heads, unmerged and merged (needs transformers)",
    )
    models: list[str] | None = setting(  # noqa: RUF009 (a field, as every setting())
        None,
        type=lambda text: row_names([text]),
        help="time only these rows (e.g. baseline,hf_llama); a row of ours is an attention "
        "type or an ablation of one, spelled as diffattn compare's arms (gda:ratio=1); each "
        "row's reference (baseline for ours, hf_llama for HF and Dex rows) must be among them",
    )
    sweep: list[int] | None = setting(  # noqa: RUF009 (a field, as every setting())
        None,
        type=_lengths,
        help="time at each of these sequence lengths (e.g. 512,1024,2048); decode prompts too",
    )
    plot: Path | None = setting(  # noqa: RUF009 (a field, as every setting())
        None,
        help="write a PNG of tokens/s against sequence length per mode; sweeps "
        "512..8192 on CUDA and 256,512,1024 on CPU unless --sweep is given",
    )

    def check(self) -> None:
        """``ValueError`` with the first problem :func:`_check_arguments` finds."""
        problem = _check_arguments(self)
        if problem is not None:
            raise ValueError(problem)


add_arguments = BenchSettings.add_arguments
"""Add the options of ``diffattn bench`` to ``parser`` (in the order ``--help`` lists)."""


def settings_of(args: argparse.Namespace | BenchSettings) -> BenchSettings:
    """The settings of a parsed ``diffattn bench`` command line (settings stay as they are)."""
    return args if isinstance(args, BenchSettings) else BenchSettings.from_args(args)


Options = argparse.Namespace | BenchSettings
"""What the functions below read: the settings, or a namespace with the same names (a
script's own options, as ``scripts/profile_models.py`` gives :func:`build_configs`)."""


# --------------------------------------------------------------------------------------
# what the options imply, and their validation
# --------------------------------------------------------------------------------------
def modes_of(args: Options) -> tuple[str, ...]:
    """The modes ``--mode`` asks for, in report order."""
    return MODES if args.mode == "all" else (args.mode,)


def lengths_of(args: Options) -> list[int]:
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


def warmup_of(args: Options) -> int:
    """Untimed repetitions before the timed ones (``--warmup``, raised for ``--compile``)."""
    return max(args.warmup, COMPILED_WARMUP) if args.compile else args.warmup


def prompt_len_of(args: Options, seq_len: int) -> int:
    """The decode prompt length at timed length ``seq_len``."""
    return args.prompt_len if args.prompt_len is not None else seq_len


def longest(args: Options) -> int:
    """The most positions any run of ``args`` needs (the models' ``max_seq_len``)."""
    need = [*lengths_of(args), args.mem_seq_len or 0]
    if "decode" in modes_of(args):
        need += [prompt_len_of(args, n) + args.new_tokens for n in lengths_of(args)]
    return max(need)


BOUNDED = ("seq_len", "layers", "vocab", "batch", "steps", "warmup", "new_tokens")
BOUNDED += ("prompt_len", "mem_seq_len", "kv_heads")
"""The counts with a lower bound (their setting's ``min``), in the order they are checked."""
WHY = {"seq_len": " (the loss needs a next token)", "mem_seq_len": " (as --seq-len)"}
"""What a bound's message adds after the bound."""


def _bound_problem(args: Options, name: str) -> str | None:
    """The message of count ``name`` below its setting's ``min`` (``None``, where that is the
    default, is left out), or ``None``."""
    field = BenchSettings.__dataclass_fields__[name]
    low: Any = field.metadata["setting"].min
    value = getattr(args, name)
    if value is None and field.default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        option = "--" + name.replace("_", "-")
        return f"{option} must be an integer >= {low}{WHY.get(name, '')}, got {value!r}"
    return None


def _check_arguments(args: Options) -> str | None:
    """The first problem with ``args`` as a message naming the option, or ``None``."""
    for name in BOUNDED:
        problem = _bound_problem(args, name)
        if problem is not None:
            return problem
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


def default_types() -> tuple[str, ...]:
    """The attention types timed when ``--models`` does not choose the rows: those whose
    declarations say so (``AttentionType.bench_by_default``: the papers' three)."""
    return tuple(n for n in attention_type_names() if attention_type(n).bench_by_default)


def row_names(items) -> list[str]:
    """The rows ``--models`` names, each of ours in its canonical arm spelling
    (:func:`diffattn.compare.arms.parse_arm`: ``gda:ratio=1``), HF and Dex rows as given, and
    a name that is neither kept as given for :func:`_check_models` to refuse."""
    from diffattn.compare.arms import parse_arm, split_arms

    rows = []
    for spelling in split_arms(items):
        try:
            rows.append(parse_arm(spelling).name)
        except ValueError:
            rows.append(spelling)
    return rows


def bench_types(args: Options) -> tuple[str, ...]:
    """Our rows: :func:`default_types`, then any other arm (a registered type, or an ablation
    of one, as ``diffattn compare`` spells them) that ``--models`` names (a list, or
    comma-separated text as a script may give)."""
    from diffattn.compare.arms import arm_of

    models = getattr(args, "models", None) or ()
    named = row_names([models] if isinstance(models, str) else models)
    defaults = default_types()
    ours = [n for n in named if n not in defaults and n not in HF_ROWS + DEX_ROWS]
    return (*defaults, *(n for n in dict.fromkeys(ours) if arm_of(n) is not None))


def _check_models(args: Options) -> str | None:
    from diffattn.compare.arms import arm_of

    rows = (*([] if args.no_hf else HF_ROWS), *(DEX_ROWS if args.dex else ()))
    ours = [name for name in args.models if name not in rows]
    unknown = [name for name in ours if arm_of(name) is None]
    if unknown or not args.models:
        known = (*attention_type_names(), *rows)
        return (
            f"--models: choose among {', '.join(known)} (a type of ours may carry options, "
            f"as diffattn compare's arms: gda:ratio=1), got {', '.join(args.models) or 'none'}"
            " (a row of ours is one registered attention type at the bench's sizes; a stack of "
            "mixed types, ModelConfig.layer_types, is not a row)"
        )
    for name in args.models:
        reference = REFERENCE if name in ours else HF_ROWS[0]
        if reference not in args.models:
            return (
                f"--models: {name} is compared with {reference}, so {reference} must be timed too"
            )
    return None
