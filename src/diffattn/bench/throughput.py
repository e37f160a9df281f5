"""``diffattn bench``: throughput, peak memory and MFU of baseline, DIFF V1 and DIFF V2.

Our rows are attention types (``AttentionType.bench_by_default``: the papers' three; ``--models``
adds any registered type by name), each a whole stack of one type: the bench builds its models
from its own sizes and takes no config, so a stack of mixed types (``layer_types``) is not a
row. The models are built at matched parameters: heads of width 64, ``n_heads =
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

The options and their validation are :mod:`diffattn.bench.options`, the records and the text
report :mod:`diffattn.bench.report`; this module re-exports their public names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from diffattn import presets
from diffattn.bench.models import (
    Candidate,
    dex_candidates,
    hf_candidates,
    our_candidates,
)
from diffattn.bench.options import (
    COMPILED_WARMUP,
    DEFAULT_SWEEP,
    DEVICES,
    DTYPES,
    HEAD_DIM,
    MODE_CHOICES,
    MODES,
    REFERENCE,
    BenchSettings,
    Options,
    _check_arguments,
    add_arguments,
    bench_types,
    default_types,
    lengths_of,
    longest,
    modes_of,
    prompt_len_of,
    row_names,
    settings_of,
    warmup_of,
)
from diffattn.bench.report import (
    CROSS,
    MEMORY_NOTE,
    RECORD_FIELDS,
    _records,
    _report,
    cross_ratios,
    format_bytes,
    format_table,
    paired_ratio,
)
from diffattn.config import ModelConfig

__all__ = [
    "COMPILED_WARMUP",
    "CROSS",
    "DEFAULT_SWEEP",
    "DEVICES",
    "DTYPES",
    "GIB",
    "HEAD_DIM",
    "MEMORY_NOTE",
    "MODES",
    "MODE_CHOICES",
    "RECORD_FIELDS",
    "REFERENCE",
    "BenchSettings",
    "LiveTensorBytes",
    "add_arguments",
    "available_memory",
    "bench_types",
    "build_candidates",
    "build_configs",
    "check_memory",
    "cross_ratios",
    "default_types",
    "estimate_memory",
    "format_bytes",
    "format_table",
    "lengths_of",
    "longest",
    "matched_v2",
    "modes_of",
    "paired_ratio",
    "peak_bytes",
    "peak_step_bytes",
    "prompt_len_of",
    "run",
    "runner",
    "settings_of",
    "time_interleaved",
    "warmup_of",
]


def matched_v2(baseline: ModelConfig) -> ModelConfig:
    """The DIFF V2 twin of ``baseline``, SwiGLU narrowed to give back V2's extra parameters."""
    return presets.match_v2_params(baseline.replace(attention="diff_v2"))


def build_configs(args: Options) -> dict[str, ModelConfig]:
    """The configs of our rows (:func:`~diffattn.bench.options.bench_types`: baseline, DIFF V1
    and DIFF V2, and any registered type or ablation of one that ``--models`` names, its
    options applied as :meth:`diffattn.compare.arms.Arm.model_fields` gives them) at matched
    parameters: the
    baseline's shape for every type, and the SwiGLU of a type matched by narrowing it
    (``AttentionType.matches_by_ffn``, as DIFF V2) narrowed as ``presets.match_v2_params``
    does. ``ValueError`` names a type whose heads do not fit the shape."""
    baseline = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // args.head_dim,
        n_kv_heads=getattr(args, "kv_heads", None),
        max_seq_len=longest(args),
        attention=REFERENCE,
        backend=args.backend,
    )
    from diffattn.compare.arms import parse_arm

    configs = {}
    for name in bench_types(args):
        config = baseline.replace(**parse_arm(name).model_fields())
        matched = config.type_of_layer(0).matches_by_ffn(config)
        configs[name] = presets.match_v2_params(config) if matched else config
    return configs


# --------------------------------------------------------------------------------------
# memory needed, checked before anything is allocated
# --------------------------------------------------------------------------------------
GIB = 1024**3


def estimate_memory(configs: dict[str, ModelConfig], args: Options) -> dict[str, int]:
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
    if not args.no_hf:  # HF Llama and DiffLlama mirror our baseline and DIFF V1
        resident += params[REFERENCE] + params["diff_v1"]
    if args.dex:
        resident += 2 * params[REFERENCE]
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


def check_memory(configs: dict[str, ModelConfig], args: Options) -> str | None:
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


def run(args: argparse.Namespace | BenchSettings) -> int:
    """Run the benchmark of ``args`` (the parsed command line, or its
    :class:`~diffattn.bench.options.BenchSettings`); returns the exit code (2 on bad input)."""

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    settings = settings_of(args)
    problem = _check_arguments(settings)
    if problem is None:
        try:
            configs = build_configs(settings)
        except ValueError as error:
            problem = str(error)
    if problem is None:
        problem = check_memory(configs, settings)
    if problem is not None:
        log(f"diffattn bench: error: {problem}")
        return 2
    try:
        return _run(settings, configs, log)
    except (RuntimeError, MemoryError) as error:
        if not _out_of_memory(error):
            raise
        need = estimate_memory(configs, settings)["total"]
        first = " ".join(str(error).split())[:200]
        log(
            f"diffattn bench: error: out of memory at d_model {settings.d_model}, "
            f"{settings.layers} layers, batch {settings.batch} x seq_len "
            f"{max(lengths_of(settings))} (at least "
            f"{need / GIB:,.1f} GiB estimated): {first}; lower --d-model, --layers, --seq-len "
            "or --batch"
        )
        return 2


def build_candidates(args: Options, configs: dict[str, ModelConfig], log):
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
        wanted = set(row_names(args.models))
        candidates = [c for c in candidates if c.name in wanted]
    return candidates


def _ids(args: Options, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, args.vocab, (args.batch, length), generator=generator)
    return ids.to(args.device)


def _run(args: Options, configs: dict[str, ModelConfig], log) -> int:
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
