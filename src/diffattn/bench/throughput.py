"""``diffattn bench``: throughput and peak memory of baseline, DIFF V1 and DIFF V2.

The three models are built at matched parameters: heads of width 64, ``n_heads =
d_model / 64`` baseline heads (DIFF V1 pairs them), and DIFF V2's SwiGLU narrowed as
``presets.get(..., match_params=True)`` does. When ``transformers`` is importable, HF
``DiffLlamaForCausalLM`` and ``LlamaForCausalLM`` at the same size join them; HF rows are
compared with HF Llama, so both comparisons pit a DIFF model against its own code base's
baseline.

Timing: per mode (``fwd`` under ``torch.no_grad()``, ``fwd+bwd`` = loss, backward, zero
grads), every repetition runs all models in turn, starting one model later each time, so
slow drift hits every model alike; the median over the timed repetitions gives
``tokens/s = batch·seq_len / median seconds``.

Peak memory (one extra, untimed step per model and mode): the largest number of bytes held
at once by tensors allocated during the step, above what was live before it (weights of
every resident model). It covers activations, saved tensors, gradients and the tensors ops
return; on CUDA it is ``max_memory_allocated`` minus ``memory_allocated`` at the start, so
it also covers kernel workspaces taken from the caching allocator; on CPU it is tracked by
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
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from diffattn import presets
from diffattn.attention.kernels import flash_available, resolve_backend
from diffattn.bench.flops import throughput_bound, v1_form_for_kernel
from diffattn.config import BACKENDS, ModelConfig
from diffattn.model import DiffTransformerLM

HEAD_DIM = 64
ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
MEMORY_NOTE = {
    "cuda": "peak mem: torch.cuda.max_memory_allocated during one step minus the bytes "
    "allocated before it (weights excluded; activations, gradients, workspaces included)",
    "cpu": "peak mem: most bytes held at once by tensors that aten ops allocated during one "
    "step (tracked per storage; weights excluded; activations, gradients included; scratch "
    "memory inside kernels and allocator overhead not seen); not process RSS",
}


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
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=3, help="timed repetitions per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="attention backend of the diffattn models",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON array of records to stdout (progress to stderr)",
    )
    parser.add_argument(
        "--no-hf", action="store_true", help="skip the Hugging Face DiffLlama and Llama models"
    )


# --------------------------------------------------------------------------------------
# validation and model construction
# --------------------------------------------------------------------------------------
def _check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with ``args`` as a message naming the option, or ``None``."""
    minimum = {"seq_len": 2, "layers": 1, "vocab": 2, "batch": 1, "steps": 1, "warmup": 0}
    why = {"seq_len": " (the loss needs a next token)"}
    for name, low in minimum.items():
        value = getattr(args, name)
        if not isinstance(value, int) or value < low:
            option = "--" + name.replace("_", "-")
            return f"{option} must be an integer >= {low}{why.get(name, '')}, got {value!r}"
    d_model = args.d_model
    if not isinstance(d_model, int) or d_model < 2 * HEAD_DIM or d_model % (2 * HEAD_DIM):
        return (
            f"--d-model must be a positive multiple of {2 * HEAD_DIM} (heads of width "
            f"{HEAD_DIM}, and DIFF V1 pairs them), got {d_model!r}"
        )
    if args.device not in DEVICES:
        return f"--device must be one of {', '.join(DEVICES)}, got {args.device!r}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: CUDA is not available on this machine"
    if args.dtype not in DTYPES:
        return f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}"
    if args.backend not in BACKENDS:
        return f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}"
    if args.backend == "flash" and not (
        flash_available() and args.device == "cuda" and args.dtype == "bf16"
    ):
        return "--backend flash needs --device cuda, --dtype bf16 and the flash-attn package"
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
        n_heads=args.d_model // HEAD_DIM,
        max_seq_len=args.seq_len,
        attention="baseline",
        backend=args.backend,
    )
    return {
        "baseline": baseline,
        "diff_v1": baseline.replace(attention="diff_v1"),
        "diff_v2": matched_v2(baseline),
    }


@dataclass
class Candidate:
    """One model under test and how to call it."""

    name: str
    model: torch.nn.Module
    params: int
    kernel: str
    """Attention kernel actually used: a resolved diffattn backend or HF attn_implementation."""
    reference: str
    """The row this one's ratios are taken against."""
    flop_bound: float
    call: Callable[..., Any]
    """``call(ids, labels)`` -> an output with ``.loss`` (``labels`` may be ``None``)."""


def _our_candidates(configs, device, dtype, seq_len) -> list[Candidate]:
    probe = torch.empty(0, device=device, dtype=dtype)
    out = []
    for name, config in configs.items():
        torch.manual_seed(0)
        model = DiffTransformerLM(config).to(device=device, dtype=dtype)
        kernel = resolve_backend(config.backend, probe)
        bound = throughput_bound(config, configs["baseline"], seq_len, v1_form_for_kernel(kernel))
        out.append(
            Candidate(
                name,
                model,
                model.num_parameters(),
                kernel,
                "baseline",
                bound,
                lambda ids, labels, m=model: m(ids, labels=labels),
            )
        )
    return out


def _hf_candidates(configs, device, dtype, seq_len) -> list[Candidate]:
    """HF Llama and DiffLlama at the size of ``configs``; empty without ``transformers``.

    HF DiffLlama counts heads like our config (``num_attention_heads`` query heads of width
    ``head_dim``, paired h / h+H/2; V has ``num_key_value_heads`` heads of width d), so the
    same numbers give our DIFF V1's shapes. It has no head-norm weight, 2d per layer fewer
    parameters. Its attention runs two SDPA calls, each over all query half-heads against one
    d-wide half of V, so QKᵀ is computed twice (the split-V two-call form of the FLOP count).
    """
    try:
        from transformers import DiffLlamaForCausalLM, LlamaForCausalLM
    except ImportError:
        return []
    from diffattn.convert.diffllama import diffattn_config_to_diffllama
    from diffattn.convert.llama import diffattn_config_to_llama

    base = configs["baseline"]
    specs = (
        ("hf_llama", diffattn_config_to_llama(base), LlamaForCausalLM, "baseline"),
        (
            "hf_diffllama",
            diffattn_config_to_diffllama(configs["diff_v1"]),
            DiffLlamaForCausalLM,
            "diff_v1",
        ),
    )
    out = []
    for name, hf_config, model_cls, ours in specs:
        torch.manual_seed(0)
        impl = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
        model = model_cls._from_config(hf_config, attn_implementation=impl)
        model = model.to(device=device, dtype=dtype)
        bound = throughput_bound(configs[ours], base, seq_len, "two_call")
        out.append(
            Candidate(
                name,
                model,
                sum(p.numel() for p in model.parameters()),
                model.config._attn_implementation,
                "hf_llama",
                bound,
                lambda ids, labels, m=model: m(input_ids=ids, labels=labels, use_cache=False),
            )
        )
    return out


# --------------------------------------------------------------------------------------
# memory needed, checked before anything is allocated
# --------------------------------------------------------------------------------------
GIB = 1024**3
HF_ROWS = 2
"""HF Llama and DiffLlama: about the baseline's and DIFF V1's sizes."""


def estimate_memory(configs: dict[str, ModelConfig], args: argparse.Namespace) -> dict[str, int]:
    """A lower bound on the bytes a bench run holds at its peak, from the configs alone.

    ``weights``: every model under test stays resident (ours, plus HF Llama and DiffLlama
    unless ``--no-hf``). ``step``: one forward+backward of the largest model needs at least
    its gradients, the activations each layer saves (the normed input, Q/K/V, the attention
    output and the residual, about ``6·d_model`` numbers per token, and the three SwiGLU
    projections, ``3·d_ff``) and the fp32 logits with their gradient. Attention maps,
    optimizer-free workspaces and allocator slack come on top, so the true need is higher.
    """
    from diffattn.model import count_parameters

    width = torch.finfo(DTYPES[args.dtype]).bits // 8
    params = {name: count_parameters(config) for name, config in configs.items()}
    resident = sum(params.values())
    if not args.no_hf:
        resident += params["baseline"] + params["diff_v1"]
    tokens = args.batch * args.seq_len
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


def time_interleaved(candidates, ids, mode, steps, warmup, device, log) -> dict[str, list]:
    """Seconds per step of each candidate: every repetition runs all of them in turn."""
    times: dict[str, list[float]] = {c.name: [] for c in candidates}
    for rep in range(warmup + steps):
        shift = rep % len(candidates)
        order = candidates[shift:] + candidates[:shift]
        label = f"warmup {rep + 1}/{warmup}" if rep < warmup else f"step {rep - warmup + 1}/{steps}"
        log(f"[{mode}] {label}: " + " -> ".join(c.name for c in order))
        for candidate in order:
            _synchronize(device)
            start = time.perf_counter()
            _step(candidate, ids, mode)
            _synchronize(device)
            if rep >= warmup:
                times[candidate.name].append(time.perf_counter() - start)
    return times


# --------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------
def _spread(seconds: list[float]) -> float:
    """(slowest − fastest) / median of the timed repetitions: how noisy the median is."""
    return (max(seconds) - min(seconds)) / statistics.median(seconds)


def _records(candidates, mode, times, peaks, args) -> list[dict[str, Any]]:
    tokens = args.batch * args.seq_len
    speed = {name: tokens / statistics.median(t) for name, t in times.items()}
    records = []
    for c in candidates:
        records.append(
            {
                "attention": c.name,
                "mode": mode,
                "seq_len": args.seq_len,
                "tokens_per_s": speed[c.name],
                "peak_mem_bytes": int(peaks[c.name]),
                "params": c.params,
                "ratio_to_baseline": speed[c.name] / speed[c.reference],
                "mem_ratio_to_baseline": peaks[c.name] / max(peaks[c.reference], 1),
                "ratio_reference": c.reference,
                "flop_bound": c.flop_bound,
                "seconds_median": statistics.median(times[c.name]),
                "seconds": times[c.name],
                "spread": _spread(times[c.name]),
                "kernel": c.kernel,
                "d_model": args.d_model,
                "layers": args.layers,
                "vocab": args.vocab,
                "batch": args.batch,
                "device": args.device,
                "dtype": args.dtype,
                "backend": args.backend,
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


def format_table(records: list[dict[str, Any]], mode: str) -> str:
    """One plain-text table for ``mode``."""
    head = (
        f"{'model':<13} {'kernel':<7} {'params':>12} {'tokens/s':>11} {'spread':>7} "
        f"{'x ref':>6} "
        f"{'FLOP bound':>10} {'peak mem':>13} {'x ref':>6}  ref"
    )
    lines = [head, "-" * len(head)]
    for r in (r for r in records if r["mode"] == mode):
        lines.append(
            f"{r['attention']:<13} {r['kernel']:<7} {r['params']:>12,} "
            f"{r['tokens_per_s']:>11,.1f} {r['spread']:>7.0%} {r['ratio_to_baseline']:>6.3f} "
            f"{r['flop_bound']:>10.3f} {format_bytes(r['peak_mem_bytes']):>13} "
            f"{r['mem_ratio_to_baseline']:>6.3f}  {r['ratio_reference']}"
        )
    return "\n".join(lines)


def _report(records, configs, candidates, args) -> str:
    mode_titles = {
        "fwd": "forward, torch.no_grad()",
        "fwd+bwd": "forward + backward (loss, backward, zero grads)",
    }
    base, v1 = configs["baseline"], configs["diff_v1"]
    n = args.seq_len
    out = [
        f"diffattn bench: d_model {args.d_model}, layers {args.layers}, heads "
        f"{base.n_heads}x{HEAD_DIM} (V1: {base.n_heads // 2} of width 2x{HEAD_DIM}), d_ff "
        f"{base.ffn_dim} (V2: {configs['diff_v2'].ffn_dim}), vocab {args.vocab}",
        f"batch {args.batch} x seq {n}; device {args.device} ({torch.get_num_threads()} "
        f"threads), {args.dtype}, backend {args.backend}; torch {torch.__version__}",
        f"tokens/s = batch*seq_len / median of {args.steps} interleaved steps "
        f"(after {args.warmup} warmup); spread = (slowest - fastest) / median step; "
        "'x ref' = ratio to the row named in 'ref'",
        MEMORY_NOTE[args.device],
        "FLOP bound = FLOPs(ref's baseline) / FLOPs(model) per token: the best 'x ref' "
        "throughput possible (diffattn.bench.flops)",
    ]
    for mode in MODES:
        out += ["", f"== {mode}: {mode_titles[mode]} ==", format_table(records, mode)]
    once = throughput_bound(v1, base, n, "qk_once")
    two = throughput_bound(v1, base, n, "two_call")
    out += [
        "",
        f"FLOP bound DIFF V1 / baseline at N={n}, d_ff={base.ffn_dim}: {once:.3f} "
        f"with QK once (reference), {two:.3f} with QKᵀ at width 2d (sdpa and flash, which "
        "zero-pad Q/K to V's width) or the split-V two-call form (HF DiffLlama)",
    ]
    by_name = {c.name: c for c in candidates}
    if "hf_diffllama" in by_name:
        ours, hf = by_name["diff_v1"].params, by_name["hf_diffllama"].params
        note = (
            " (HF DiffLlama has no head-norm weight, 2d per layer)"
            if ours - hf == 2 * HEAD_DIM * args.layers
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
            f"layers, batch {args.batch} x seq_len {args.seq_len} (at least {need / GIB:,.1f} "
            f"GiB estimated): {first}; lower --d-model, --layers, --seq-len or --batch"
        )
        return 2


def _run(args: argparse.Namespace, configs: dict[str, ModelConfig], log) -> int:

    device, dtype = args.device, DTYPES[args.dtype]
    candidates = _our_candidates(configs, device, dtype, args.seq_len)
    if not args.no_hf:
        hf = _hf_candidates(configs, device, dtype, args.seq_len)
        if not hf:
            log("transformers is not importable: HF rows skipped")
        candidates += hf
    for c in candidates:
        log(f"{c.name:<13} {c.params:>12,} parameters, attention kernel {c.kernel}")

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator)
    ids = ids.to(device)
    records = []
    for mode in MODES:
        times = time_interleaved(candidates, ids, mode, args.steps, args.warmup, device, log)
        log(f"[{mode}] peak memory, one step per model")
        peaks = {
            c.name: peak_step_bytes(lambda c=c, m=mode: _step(c, ids, m), device)
            for c in candidates
        }
        records += _records(candidates, mode, times, peaks, args)

    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(_report(records, configs, candidates, args))
    return 0
