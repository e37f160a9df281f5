"""``diffattn bench``: throughput, peak memory and MFU of baseline, DIFF V1 and DIFF V2.

The three models are built at matched parameters: heads of width 64, ``n_heads =
d_model / 64`` baseline heads (DIFF V1 pairs them), ``--kv-heads`` key/value heads (GQA), and
DIFF V2's SwiGLU narrowed as ``presets.get(..., match_params=True)`` does. When
``transformers`` is importable, HF ``DiffLlamaForCausalLM`` and ``LlamaForCausalLM`` at the same
size join them (``--dex`` adds that Llama with Dex, unmerged and merged); HF rows are compared
with HF Llama, so every comparison pits a model against its own code base's baseline
(:mod:`diffattn.bench.models`).

Modes (``--mode``): ``fwd`` (under ``torch.no_grad()``), ``fwd+bwd`` (loss, backward, zero
grads) and ``decode`` (``--new-tokens`` greedy one-token steps after a ``--prompt-len`` prompt
run into a fresh KV cache, which is not timed; ours use the static cache). Every repetition
runs all models in turn, starting one model later each time, so slow drift hits every model
alike; the median over the timed repetitions gives ``tokens/s = batch·N / median seconds``
(``batch·new_tokens`` in decode), and ratios come from one run.

``--sweep`` repeats everything at several sequence lengths and ``--plot`` draws tokens/s
against the length per mode (the analogue of Dex Fig 12). MFU (:mod:`diffattn.hardware`)
needs a known GPU or ``--peak-tflops``.

Peak memory (one extra, untimed run per model and mode, at ``--mem-seq-len`` for ``fwd`` and
``fwd+bwd``; the whole prefill and decode in ``decode``, cache included): the largest number of
bytes held at once by tensors allocated during the run, above what was live before it (weights
of every resident model). It covers activations, saved tensors, gradients and the tensors ops
return; on CUDA it is ``max_memory_allocated`` minus ``memory_allocated`` at the start, so it
also covers kernel workspaces taken from the caching allocator; on CPU it is tracked by
:class:`LiveTensorBytes` and misses scratch memory kernels allocate internally.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from diffattn import presets
from diffattn.attention.kernels import resolve_backend
from diffattn.attention.registry import backend_names
from diffattn.bench.models import (
    DEX_ROWS,
    Candidate,
    dex_candidates,
    hf_available,
    hf_candidates,
    our_candidates,
)
from diffattn.config import ModelConfig
from diffattn.flops import throughput_bound
from diffattn.hardware import device_name, mfu, peak_tflops

HEAD_DIM = 64
ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
MODES = ("fwd", "fwd+bwd", "decode")
MODE_CHOICES = (*MODES, "all")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
DEFAULT_SWEEP = {"cuda": (512, 1024, 2048, 4096, 8192), "cpu": (256, 512, 1024)}
"""Lengths ``--plot`` sweeps when ``--sweep`` is not given (CPU: affordable on a laptop)."""
MEMORY_NOTE = {
    "cuda": "peak mem: torch.cuda.max_memory_allocated during one run minus the bytes "
    "allocated before it (weights excluded; activations, gradients, KV cache, workspaces "
    "included)",
    "cpu": "peak mem: most bytes held at once by tensors that aten ops allocated during one "
    "run (tracked per storage; weights excluded; activations, gradients, KV cache included; "
    "scratch memory inside kernels and allocator overhead not seen); not process RSS",
}
RECORD_FIELDS: dict[str, type | tuple[type, ...]] = {
    "attention": str,
    "mode": str,
    "seq_len": int,
    "tokens_per_s": float,
    "peak_mem_bytes": int,
    "mem_seq_len": int,
    "params": int,
    "ratio_to_baseline": float,
    "best_ratio_to_baseline": float,
    "paired_ratio_to_baseline": float,
    "mem_ratio_to_baseline": float,
    "ratio_reference": str,
    "flop_bound": float,
    "flops_per_token": float,
    "mfu": (float, type(None)),
    "peak_tflops": (float, type(None)),
    "seconds_median": float,
    "seconds": list,
    "spread": float,
    "kernel": str,
    "cache": (str, type(None)),
    "prompt_len": (int, type(None)),
    "new_tokens": (int, type(None)),
    "d_model": int,
    "layers": int,
    "head_dim": int,
    "n_heads": int,
    "n_kv_heads": int,
    "vocab": int,
    "batch": int,
    "device": str,
    "device_name": str,
    "threads": int,
    "dtype": str,
    "backend": str,
    "compiled": bool,
    "torch": str,
}
"""Every key of a JSON record and its type (``seq_len`` is the prompt length in decode)."""


def _lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 512,1024, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one length")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``diffattn bench`` to ``parser``."""
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
# validation and model construction
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


def matched_v2(baseline: ModelConfig) -> ModelConfig:
    """The DIFF V2 twin of ``baseline``, SwiGLU narrowed to give back V2's extra parameters."""
    return presets.match_v2_params(baseline.replace(attention="diff_v2"))


def build_configs(args: argparse.Namespace) -> dict[str, ModelConfig]:
    """Baseline, DIFF V1 and DIFF V2 configs at matched parameters."""
    baseline = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // args.head_dim,
        n_kv_heads=getattr(args, "kv_heads", None),
        max_seq_len=longest(args),
        attention="baseline",
        backend=args.backend,
    )
    return {
        "baseline": baseline,
        "diff_v1": baseline.replace(attention="diff_v1"),
        "diff_v2": matched_v2(baseline),
    }


# --------------------------------------------------------------------------------------
# memory needed, checked before anything is allocated
# --------------------------------------------------------------------------------------
GIB = 1024**3


def estimate_memory(configs: dict[str, ModelConfig], args: argparse.Namespace) -> dict[str, int]:
    """A lower bound on the bytes a bench run holds at its peak, from the configs alone.

    ``weights``: every model under test stays resident (ours, plus HF Llama and DiffLlama
    unless ``--no-hf``, plus two Dex copies of HF Llama with ``--dex``). ``step``: one
    forward+backward of the largest model at the longest length needs at least its gradients,
    the activations each layer saves (the normed input, Q/K/V, the attention output and the
    residual, about ``6·d_model`` numbers per token, and the three SwiGLU projections,
    ``3·d_ff``) and the fp32 logits with their gradient. Attention maps, optimizer-free
    workspaces and allocator slack come on top, so the true need is higher.
    """
    from diffattn.model import count_parameters

    width = torch.finfo(DTYPES[args.dtype]).bits // 8
    params = {name: count_parameters(config) for name, config in configs.items()}
    resident = sum(params.values())
    if not args.no_hf:
        resident += params["baseline"] + params["diff_v1"]
    if args.dex:
        resident += 2 * params["baseline"]
    tokens = args.batch * max(*lengths_of(args), args.mem_seq_len or 0)
    largest = max(params, key=params.get)
    config = configs[largest]
    saved = config.n_layers * tokens * (6 * config.d_model + 3 * config.ffn_dim) * width
    logits = 2 * tokens * config.vocab_size * 4
    step = params[largest] * width + saved + logits
    return {"weights": resident * width, "step": step, "total": resident * width + step}


def available_memory(device: str) -> int | None:
    """Bytes the device can still give: free CUDA memory, or the kernel's ``MemAvailable``
    (else the physical memory) on CPU; ``None`` when it cannot be told."""
    if device == "cuda":
        try:
            return int(torch.cuda.mem_get_info()[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(configs: dict[str, ModelConfig], args: argparse.Namespace) -> str | None:
    """The refusal of a size that cannot fit (naming the size and the need), or ``None``."""
    need = estimate_memory(configs, args)
    have = available_memory(args.device)
    if have is None or need["total"] <= have:
        return None
    return (
        f"d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} "
        f"x seq_len {args.seq_len} ({args.dtype}) needs at least "
        f"{need['total'] / GIB:,.1f} GiB (weights of the models {need['weights'] / GIB:,.1f} "
        f"GiB, one forward+backward {need['step'] / GIB:,.1f} GiB), but {args.device} has "
        f"{have / GIB:,.1f} GiB available; lower --d-model, --layers, --seq-len or --batch"
    )


def _out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "DefaultCPUAllocator" in text or "out of memory" in text.lower()
    )


# --------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of storages that aten ops allocate while the mode is active.

    A storage counts from the op that returns it (unless it aliases an input of that op)
    until Python's finaliser sees the storage freed, which is when its last tensor, view or
    autograd-saved reference goes. ``peak`` is the most bytes live at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(result)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._tracked:
                continue
            nbytes = storage.nbytes()
            self._tracked.add(key)
            self.live += nbytes
            weakref.finalize(storage, self._release, key, nbytes)
        self.peak = max(self.peak, self.live)
        return result


def _step(candidate: Candidate, ids: torch.Tensor, mode: str) -> None:
    if mode == "fwd":
        candidate.model.eval()
        with torch.no_grad():
            candidate.call(ids, None)
        return
    candidate.model.train()
    loss = candidate.call(ids, ids).loss
    loss.backward()
    candidate.model.zero_grad(set_to_none=True)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_step_bytes(run_step: Callable[[], None], device: str) -> int:
    """Peak bytes of tensors allocated during ``run_step()`` (see the module docstring)."""
    if device == "cuda":
        _synchronize(device)
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_step()
        _synchronize(device)
        return torch.cuda.max_memory_allocated() - start
    with LiveTensorBytes() as tracker:
        run_step()
    return tracker.peak


def runner(candidate: Candidate, ids: torch.Tensor, mode: str, new_tokens: int, eager=False):
    """``prepare()`` for one timed run of ``candidate``: it does the untimed part (decode's
    prefill) and returns the part to time (``eager``: a decode step not compiled)."""
    if mode == "decode":
        return lambda: candidate.decode(ids, new_tokens, eager=eager)
    return lambda: lambda: _step(candidate, ids, mode)


def time_interleaved(
    candidates, ids, mode, steps, warmup, device, log, new_tokens: int = 1
) -> dict[str, list]:
    """Seconds per timed run of each candidate: every repetition runs all of them in turn."""
    times: dict[str, list[float]] = {c.name: [] for c in candidates}
    for rep in range(warmup + steps):
        shift = rep % len(candidates)
        order = candidates[shift:] + candidates[:shift]
        label = f"warmup {rep + 1}/{warmup}" if rep < warmup else f"step {rep - warmup + 1}/{steps}"
        log(f"[{mode} N={ids.shape[1]}] {label}: " + " -> ".join(c.name for c in order))
        for candidate in order:
            timed = runner(candidate, ids, mode, new_tokens)()
            _synchronize(device)
            start = time.perf_counter()
            timed()
            _synchronize(device)
            if rep >= warmup:
                times[candidate.name].append(time.perf_counter() - start)
    return times


def peak_bytes(candidates, ids, mode, device, new_tokens: int = 1) -> dict[str, int]:
    """One untimed run per candidate: its peak memory (decode: prefill and decode together).
    On the CPU the tracker is a dispatch mode, which ``torch.compile`` cannot trace, so a
    compiled decode step is measured eagerly there (the same tensors, allocated op by op)."""
    peaks = {}
    for c in candidates:
        prepare = runner(c, ids, mode, new_tokens, eager=device == "cpu")
        peaks[c.name] = peak_step_bytes(lambda prepare=prepare: prepare()(), device)
    return peaks


# --------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------
def _spread(seconds: list[float]) -> float:
    """(slowest − fastest) / median of the timed repetitions: how noisy the median is."""
    return (max(seconds) - min(seconds)) / statistics.median(seconds)


def paired_ratio(seconds: list[float], reference_seconds: list[float]) -> float:
    """Median over repetitions of ``reference time / time`` within the same repetition: the
    two runs of a pair are seconds apart, so slow drifts of the machine's load cancel."""
    return statistics.median(r / s for s, r in zip(seconds, reference_seconds, strict=True))


def _records(candidates, mode, seq_len, times, peaks, args, mem_seq_len) -> list[dict[str, Any]]:
    decode = mode == "decode"
    new = args.new_tokens if decode else 1
    tokens = args.batch * (new if decode else seq_len)
    speed = {name: tokens / statistics.median(t) for name, t in times.items()}
    best = {name: tokens / min(t) for name, t in times.items()}
    by_name = {c.name: c for c in candidates}
    name = device_name(args.device)
    peak = peak_tflops(name, args.dtype, args.peak_tflops)
    records = []
    for c in candidates:
        ref = by_name[c.reference]
        flops = c.flops_per_token(mode, seq_len, new)
        bound = ref.flops_per_token(mode, seq_len, new, as_computed=True) / c.flops_per_token(
            mode, seq_len, new, as_computed=True
        )
        records.append(
            {
                "attention": c.name,
                "mode": mode,
                "seq_len": seq_len,
                "tokens_per_s": speed[c.name],
                "peak_mem_bytes": int(peaks[c.name]),
                "mem_seq_len": seq_len if decode else mem_seq_len,
                "params": c.params,
                "ratio_to_baseline": speed[c.name] / speed[c.reference],
                "best_ratio_to_baseline": best[c.name] / best[c.reference],
                "paired_ratio_to_baseline": paired_ratio(times[c.name], times[c.reference]),
                "mem_ratio_to_baseline": peaks[c.name] / max(peaks[c.reference], 1),
                "ratio_reference": c.reference,
                "flop_bound": bound,
                "flops_per_token": flops,
                "mfu": mfu(flops, speed[c.name], peak),
                "peak_tflops": peak,
                "seconds_median": statistics.median(times[c.name]),
                "seconds": times[c.name],
                "spread": _spread(times[c.name]),
                "kernel": c.kernel_in(mode),
                "cache": c.cache if decode else None,
                "prompt_len": seq_len if decode else None,
                "new_tokens": new if decode else None,
                "d_model": args.d_model,
                "layers": args.layers,
                "head_dim": args.head_dim,
                "n_heads": c.config.n_heads,
                "n_kv_heads": c.config.num_kv_heads,
                "vocab": args.vocab,
                "batch": args.batch,
                "device": args.device,
                "device_name": name,
                "threads": torch.get_num_threads(),
                "dtype": args.dtype,
                "backend": args.backend,
                "compiled": bool(args.compile and c.name in ATTENTIONS),
                "torch": torch.__version__,
            }
        )
    return records


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB or GiB, whichever keeps the number below 1024."""
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def format_table(records: list[dict[str, Any]], mode: str, seq_len: int | None = None) -> str:
    """One plain-text table for ``mode`` (at ``seq_len``, when given)."""
    rows = [
        r for r in records if r["mode"] == mode and (seq_len is None or r["seq_len"] == seq_len)
    ]
    with_mfu = any(r["mfu"] is not None for r in rows)
    head = (
        f"{'model':<13} {'kernel':<7} {'params':>12} {'tokens/s':>11} {'spread':>7} "
        f"{'x ref':>6} {'paired':>6} {'best':>6} {'FLOP bound':>10} {'peak mem':>13} {'x ref':>6}"
        + (f" {'MFU':>6}" if with_mfu else "")
        + "  ref"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['attention']:<13} {r['kernel']:<7} {r['params']:>12,} "
            f"{r['tokens_per_s']:>11,.1f} {r['spread']:>7.0%} {r['ratio_to_baseline']:>6.3f} "
            f"{r['paired_ratio_to_baseline']:>6.3f} {r['best_ratio_to_baseline']:>6.3f} "
            f"{r['flop_bound']:>10.3f} {format_bytes(r['peak_mem_bytes']):>13} "
            f"{r['mem_ratio_to_baseline']:>6.3f}"
            + (f" {r['mfu']:>6.1%}" if with_mfu else "")
            + f"  {r['ratio_reference']}"
        )
    return "\n".join(lines)


def _mode_title(mode: str, seq_len: int, args: argparse.Namespace) -> str:
    blocks = "; ours: compiled blocks" if args.compile else ""
    if mode == "fwd":
        return f"forward, torch.no_grad(), N={seq_len}{blocks}"
    if mode == "fwd+bwd":
        return f"forward + backward (loss, backward, zero grads), N={seq_len}{blocks}"
    caches = "ours: static cache" + (", compiled step" if args.compile else "")
    return (
        f"{args.new_tokens} greedy one-token steps after a {seq_len}-token prompt "
        f"(prefill untimed; {caches}; HF: its StaticCache)"
    )


CROSS = (("baseline", "hf_llama"), ("diff_v1", "hf_diffllama"))
"""Our rows and the HF rows they mirror, compared across code bases by :func:`cross_ratios`."""


def cross_ratios(records: list[dict[str, Any]]) -> list[str]:
    """One line per mode and length: our baseline / HF Llama and our DIFF V1 / HF DiffLlama
    throughput (median and fastest runs of the same interleaved run)."""
    rows = {(r["attention"], r["mode"], r["seq_len"]): r for r in records}
    lines = []
    for (_, mode, n), r in rows.items():
        if r["attention"] != "baseline":
            continue
        parts = []
        for ours, theirs in CROSS:
            if (ours, mode, n) in rows and (theirs, mode, n) in rows:
                a, b = rows[ours, mode, n], rows[theirs, mode, n]
                median = a["tokens_per_s"] / b["tokens_per_s"]
                best = min(b["seconds"]) / min(a["seconds"])
                paired = paired_ratio(a["seconds"], b["seconds"])
                parts.append(
                    f"{ours} / {theirs} {median:.3f} (paired {paired:.3f}, best {best:.3f})"
                )
        if parts:
            lines.append(f"across code bases, {mode} N={n}: " + "; ".join(parts))
    return lines


def _report(records, configs, candidates, args) -> str:
    base = configs["baseline"]
    heads = f"heads {base.n_heads}x{args.head_dim}, kv heads {base.num_kv_heads}"
    mem_n = args.mem_seq_len
    out = [
        f"diffattn bench: d_model {args.d_model}, layers {args.layers}, {heads} (V1: "
        f"{base.n_heads // 2} of width 2x{args.head_dim}), d_ff {base.ffn_dim} (V2: "
        f"{configs['diff_v2'].ffn_dim}), vocab {args.vocab}",
        f"batch {args.batch}; device {device_name(args.device)} ({torch.get_num_threads()} "
        f"threads), {args.dtype}, backend {args.backend}; torch {torch.__version__}",
        f"tokens/s = batch*N (decode: batch*new tokens) / median of {args.steps} interleaved "
        f"runs (after {warmup_of(args)} warmup); spread = (slowest - fastest) / median run; "
        "'x ref' = ratio to the row named in 'ref'; 'paired' = median over repetitions of the "
        "ratio within each repetition (slow drifts of load cancel); 'best' = the same ratio "
        "of the fastest runs (less sensitive to other load on the machine)",
        MEMORY_NOTE[args.device]
        + (f"; fwd and fwd+bwd memory measured at N={mem_n}" if mem_n else ""),
        "FLOP bound = FLOPs(ref) / FLOPs(model) per token as each kernel computes them: the "
        "best 'x ref' throughput possible (diffattn.flops); MFU = model FLOPs x tokens/s "
        "/ peak (DIFF V1 counted with QK once)",
    ]
    for n in lengths_of(args):
        for mode in modes_of(args):
            shown = prompt_len_of(args, n) if mode == "decode" else n
            out += ["", f"== {mode}: {_mode_title(mode, shown, args)} =="]
            out.append(format_table(records, mode, shown))
    out += cross_ratios(records)
    v1 = configs["diff_v1"]
    for n in lengths_of(args):
        once = throughput_bound(v1, base, n, "qk_once")
        two = throughput_bound(v1, base, n, "two_call")
        v_once = throughput_bound(v1, base, n, "v_once")
        out.append(
            f"FLOP bound DIFF V1 / baseline at N={n}, d_ff={base.ffn_dim}: {v_once:.3f} with V "
            f"read once (fused, triton: the baseline's attention FLOPs), {once:.3f} with QK once "
            f"and a PV per map (reference), {two:.3f} with QKᵀ at width 2d (sdpa and flash, which "
            "zero-pad Q/K to V's width) or the split-V two-call form (HF DiffLlama)"
        )
    by_name = {c.name: c for c in candidates}
    if "hf_diffllama" in by_name:
        ours, hf = by_name["diff_v1"].params, by_name["hf_diffllama"].params
        note = (
            " (HF DiffLlama has no head-norm weight, 2d per layer)"
            if ours - hf == 2 * args.head_dim * args.layers
            else ""
        )
        out.append(
            f"parameters: diff_v1 {ours:,} vs hf_diffllama {hf:,}{note}; baseline "
            f"{by_name['baseline'].params:,} vs hf_llama {by_name['hf_llama'].params:,}"
        )
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; returns the exit code (2 on bad input)."""

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    problem = _check_arguments(args)
    if problem is None:
        try:
            configs = build_configs(args)
        except ValueError as error:
            problem = str(error)
    if problem is None:
        problem = check_memory(configs, args)
    if problem is not None:
        log(f"diffattn bench: error: {problem}")
        return 2
    try:
        return _run(args, configs, log)
    except (RuntimeError, MemoryError) as error:
        if not _out_of_memory(error):
            raise
        need = estimate_memory(configs, args)["total"]
        first = " ".join(str(error).split())[:200]
        log(
            f"diffattn bench: error: out of memory at d_model {args.d_model}, {args.layers} "
            f"layers, batch {args.batch} x seq_len {max(lengths_of(args))} (at least "
            f"{need / GIB:,.1f} GiB estimated): {first}; lower --d-model, --layers, --seq-len "
            "or --batch"
        )
        return 2


def build_candidates(args: argparse.Namespace, configs: dict[str, ModelConfig], log):
    """Every model the run times, ours first (see :mod:`diffattn.bench.models`)."""
    device, dtype = args.device, DTYPES[args.dtype]
    candidates = our_candidates(configs, device, dtype, compiled=args.compile)
    if args.compile:  # the blocks as the trainer compiles them (fwd and fwd+bwd)
        for candidate in candidates:
            candidate.model.compile_blocks()
    if not args.no_hf:
        hf = hf_candidates(configs, device, dtype)
        if not hf:
            log("transformers is not importable: HF rows skipped")
        candidates += hf
        if args.dex:
            candidates += dex_candidates(next(c for c in hf if c.name == "hf_llama"))
    if args.models is not None:
        candidates = [c for c in candidates if c.name in args.models]
    return candidates


def _ids(args: argparse.Namespace, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, args.vocab, (args.batch, length), generator=generator)
    return ids.to(args.device)


def _run(args: argparse.Namespace, configs: dict[str, ModelConfig], log) -> int:
    candidates = build_candidates(args, configs, log)
    for c in candidates:
        kernels = ", ".join(f"{m} {c.kernel_in(m)}" for m in MODES) if c.mode_kernels else c.kernel
        log(f"{c.name:<13} {c.params:>12,} parameters, attention kernel {kernels}")
    records = []
    for n in lengths_of(args):
        for mode in modes_of(args):
            length = prompt_len_of(args, n) if mode == "decode" else n
            ids = _ids(args, length)
            times = time_interleaved(
                candidates,
                ids,
                mode,
                args.steps,
                warmup_of(args),
                args.device,
                log,
                args.new_tokens,
            )
            mem_n = length if mode == "decode" else (args.mem_seq_len or n)
            log(f"[{mode} N={length}] peak memory at N={mem_n}, one run per model")
            mem_ids = ids if mem_n == length else _ids(args, mem_n)
            peaks = peak_bytes(candidates, mem_ids, mode, args.device, args.new_tokens)
            records += _records(candidates, mode, length, times, peaks, args, mem_n)
    if args.plot is not None:
        from diffattn.bench.plot import plot_sweep

        log(f"wrote {plot_sweep(records, args.plot)}")
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(_report(records, configs, candidates, args))
    return 0
