"""The records and the text report of ``diffattn bench``: one JSON record per model, mode and
length (:data:`RECORD_FIELDS`), the plain-text tables, the cross-code-base ratios and the FLOP
bound lines (:mod:`diffattn.flops`).

Split from :mod:`diffattn.bench.throughput`, which re-exports every public name.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from diffattn.bench.models import HF_ROWS, REFERENCE
from diffattn.bench.options import (
    Options,
    lengths_of,
    modes_of,
    prompt_len_of,
    warmup_of,
)
from diffattn.flops import throughput_bound
from diffattn.hardware import device_name, mfu, peak_tflops

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
                "compiled": bool(args.compile and c.ours),
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


def _mode_title(mode: str, seq_len: int, args: Options) -> str:
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


CROSS = ((REFERENCE, HF_ROWS[0]), ("diff_v1", HF_ROWS[1]))
"""Our rows and the HF rows they mirror, compared across code bases by :func:`cross_ratios`."""


def cross_ratios(records: list[dict[str, Any]]) -> list[str]:
    """One line per mode and length: our baseline / HF Llama and our DIFF V1 / HF DiffLlama
    throughput (median and fastest runs of the same interleaved run)."""
    rows = {(r["attention"], r["mode"], r["seq_len"]): r for r in records}
    lines = []
    for (_, mode, n), r in rows.items():
        if r["attention"] != REFERENCE:
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


def describe_layers(config) -> list[str]:
    """The attention of ``config``'s layers, one line per run of layers of one type
    (``AttentionType.describe``): ``layers 0-3: DIFF V1: ...``; a mixed stack
    (``layer_types``) gets one line per run."""
    runs: list[list[int]] = []
    for i in range(config.n_layers):
        if runs and config.type_of_layer(i) is config.type_of_layer(runs[-1][0]):
            runs[-1].append(i)
        else:
            runs.append([i])
    lines = []
    for run in runs:
        span = f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}-{run[-1]}"
        lines.append(f"{span}: {config.type_of_layer(run[0]).describe(config)}")
    return lines


def _report(records, configs, candidates, args) -> str:
    base = configs[REFERENCE]
    timed = {c.name for c in candidates}
    types = [
        f"attention of {name}: {'; '.join(describe_layers(config))}; d_ff {config.ffn_dim}"
        for name, config in configs.items()
        if name in timed
    ]
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
        *types,
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
