"""``diffattn backends``: what ``auto`` runs each attention call on here, and the timing
behind it.

Without options it lists the registered backends (usable here or why not) and, for every
attention entry point (``softmax``: the baseline and every type built on softmax attention;
``diff_v1``; ``diff_v2``: ``AttentionType.entry`` names the one a type calls) and call shape
(:class:`~diffattn.attention.auto.Call`: training, prefill, one-token decode, each with and
without padding; a custom 4-D mask; a traced static-cache decode step), the backend ``auto``
resolves to on this machine, by the same function the models call
(:func:`diffattn.attention.auto.choose`), at the head width of ``--head-dim`` (``auto``'s CUDA
order depends on it), and the route the ``sdpa`` backend takes for DIFF V1's calls (native
widths on cuDNN, or Q and K zero-padded; :func:`diffattn.attention.backends.sdpa.diff_v1_route`).

``--time`` measures what the choice rests on: for every case it times each backend with its
own kernel for that entry point, interleaved (each repetition runs all of them, starting one
later each time), and prints the median time and the paired ratio to ``sdpa`` (the median over
repetitions of ``sdpa``'s time over the backend's time within the repetition: above 1 is
faster). Shapes follow ``diffattn bench`` (heads of width 64; DIFF V1: ``h/2`` differential
heads, V of width 128).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from diffattn.attention import auto
from diffattn.attention.backends.sdpa import diff_v1_route
from diffattn.attention.kernels import (
    differential_attention,
    differential_attention_v2,
    softmax_attention,
)
from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import (
    ENTRY_DIFF,
    ENTRY_DIFF_V2,
    ENTRY_SOFTMAX,
    backend_names,
    get_backend,
)
from diffattn.settings import Settings, setting

HEAD_DIM = 64
"""Width of the baseline's heads, in ``diffattn bench`` and here (DIFF V1 pairs them)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The dtypes ``diffattn bench`` and ``diffattn backends`` run in, by option value."""
DEVICES = ("cpu", "cuda")
CASES = (
    "train",
    "prefill",
    "decode",
    "train + padding",
    "prefill + padding",
    "decode + padding",
    "custom mask",
    "traced",
)
"""The calls listed; ``traced`` (a static-cache decode step inside ``torch.compile``) is not
timed."""
LISTED = ("sdpa", "fused", "triton", "flash", "reference")
"""The order backends are timed in (others registered follow in registration order)."""


def own_kernels(entry: str) -> tuple[str, ...]:
    """``sdpa`` and the backends with a kernel of their own for ``entry`` (the others run
    ``sdpa``'s: :func:`diffattn.attention.auto.brings_own_kernel`), in :data:`LISTED` order."""
    names = [n for n in backend_names() if n != "auto"]
    ordered = [n for n in LISTED if n in names] + [n for n in names if n not in LISTED]
    return tuple(n for n in ordered if n == "sdpa" or auto.brings_own_kernel(n, entry))


@dataclass(frozen=True)
class BackendsSettings(Settings):
    """The settings of ``diffattn backends``, in the order ``--help`` lists them (``min``:
    each size's lower bound, checked in the order of :data:`BOUNDED`)."""

    device: str = setting("cpu", choices=DEVICES)
    dtype: str = setting("all", choices=(*DTYPES, "all"), help="default: fp32 and bf16")
    time: bool = setting(False, help="time every candidate per case, interleaved")
    entries: str = setting(",".join(auto.ENTRIES), help="entry points to time")
    cases: str = setting(",".join(CASES[:-1]), help="cases to time")
    seq_len: int = setting(2048, min=2, help="--time: keys per call")
    heads: int = setting(8, min=1, help="--time: baseline query heads")
    kv_heads: int | None = setting(None, help="--time: default --heads")
    batch: int = setting(1, min=1)
    head_dim: int = setting(HEAD_DIM, min=1, help="head width")
    repeats: int = setting(5, min=1, help="--time: timed repetitions")
    reference: bool = setting(False, help="--time: time the reference kernel too")
    json: bool = setting(False, help="--time: JSON records on stdout")


add_arguments = BackendsSettings.add_arguments
"""Add the options of ``diffattn backends`` to ``parser``."""
BOUNDED = ("seq_len", "heads", "batch", "repeats", "head_dim")
"""The sizes with a lower bound (their setting's ``min``), in the order they are checked."""


@dataclass(frozen=True)
class Shape:
    """Sizes of the timed calls: ``heads`` query heads of width 64 for the baseline; by
    default those of ``diffattn backends`` (``kv_heads``: as many as ``heads``)."""

    seq_len: int = BackendsSettings.seq_len
    heads: int = BackendsSettings.heads
    kv_heads: int = BackendsSettings.heads
    batch: int = BackendsSettings.batch
    head_dim: int = BackendsSettings.head_dim


def _mask(case: str, batch: int, n: int, s: int, device) -> AttentionMask:
    offset = s - n
    padding = None
    if "padding" in case:
        padding = torch.ones(batch, s, dtype=torch.bool, device=device)
        padding[:, : max(1, s // 8)] = False  # left padding: an eighth of every row
    if case == "custom mask":
        # two packed documents, each causal within itself
        half = n // 2
        doc = (torch.arange(n, device=device) >= half).long()
        allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        allowed &= doc[:, None] == doc[None, :]
        return AttentionMask(allowed=allowed[None, None])
    if case == "traced":
        return AttentionMask(key_padding=padding, query_offset=torch.tensor(offset))
    return AttentionMask(key_padding=padding, query_offset=offset)


def make_call(
    entry: str, case: str, shape: Shape, device, dtype
) -> tuple[Callable[[str], torch.Tensor], tuple]:
    """``(run(backend), inputs)`` for one entry point and case: ``run`` calls the entry point
    on ``backend`` (forward, plus backward in ``train`` cases) and returns the output."""
    decode = case.startswith("decode") or case == "traced"  # static-cache steps
    b, h, kv, s = shape.batch, shape.heads, shape.kv_heads, shape.seq_len
    n = 1 if decode else s
    grad = case.startswith("train")
    mask = _mask(case, b, n, s, device)
    d = shape.head_dim
    scale = d**-0.5

    def t(*size):
        return torch.randn(*size, device=device, dtype=dtype).requires_grad_(grad)

    if entry == ENTRY_SOFTMAX:
        inputs = (t(b, h, n, d), t(b, kv, s, d), t(b, kv, s, d))

        def fn(backend):
            return softmax_attention(*inputs, mask, scale, backend)[0]

    elif entry == ENTRY_DIFF:
        hd, kvd = h // 2, max(1, kv // 2)
        qs = (t(b, hd, n, d), t(b, hd, n, d))
        ks = (t(b, kvd, s, d), t(b, kvd, s, d))
        lam = torch.tensor(0.3, device=device).requires_grad_(grad)
        inputs = (*qs, *ks, t(b, kvd, s, 2 * d), lam)

        def fn(backend):
            return differential_attention(*inputs, mask, scale, backend)[0]

    elif entry == ENTRY_DIFF_V2:
        lam = torch.rand(b, h, n, 1, device=device, dtype=dtype).requires_grad_(grad)
        inputs = (t(b, 2 * h, n, d), t(b, kv, s, d), t(b, kv, s, d), lam)

        def fn(backend):
            return differential_attention_v2(*inputs, mask, scale, backend)

    else:
        raise ValueError(f"entry must be one of {', '.join(auto.ENTRIES)}, got {entry!r}")

    def run(backend: str) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            out = fn(backend)
            if grad:
                out.float().sum().backward()
        return out

    return run, inputs


def _tiny_call(entry: str, case: str, device, dtype, head_dim: int):
    """Inputs, mask and key tensor of a small call of ``entry`` and ``case``."""
    shape = Shape(seq_len=8, heads=4, kv_heads=2, batch=2, head_dim=head_dim)
    _, inputs = make_call(entry, case, shape, device, dtype)
    decode = case.startswith("decode") or case == "traced"
    mask = _mask(case, 2, 1 if decode else 8, 8, device)
    return inputs, mask, inputs[2] if entry == ENTRY_DIFF else inputs[1]


def auto_choice(entry: str, case: str, device, dtype, head_dim: int = HEAD_DIM) -> str:
    """What ``auto`` resolves a call of ``entry`` and ``case`` to here (small tensors, the
    same resolution as a model's calls)."""
    inputs, mask, k = _tiny_call(entry, case, device, dtype, head_dim)
    with torch.set_grad_enabled(case.startswith("train")):
        call = auto.Call.of(entry, inputs, mask)
    if case == "traced":  # what a call inside torch.compile sees
        call = dataclasses.replace(call, traced=True)
    return auto.choose(call, inputs[0], k, mask)


def sdpa_diff_v1_route(case: str, device, dtype, head_dim: int = HEAD_DIM) -> str:
    """The route the ``sdpa`` backend takes for DIFF V1 calls of ``case`` here."""
    inputs, mask, k = _tiny_call(ENTRY_DIFF, case, device, dtype, head_dim)
    with torch.set_grad_enabled(case.startswith("train")):
        return diff_v1_route(inputs[0], k, inputs[4], mask)


def usable_here(name: str, device, dtype) -> str | None:
    """Why backend ``name`` cannot run on ``device``/``dtype`` here, or ``None``."""
    return get_backend(name).why_unusable(torch.empty(0, device=device, dtype=dtype))


def listing(device: str, dtypes: list[str], head_dim: int = HEAD_DIM) -> str:
    """The backends and ``auto``'s table for ``device`` in each of ``dtypes``, at heads of
    width ``head_dim``, with the route of ``sdpa``'s DIFF V1 calls."""
    lines = [f"attention backends on {device} (torch {torch.__version__}):"]
    for name in backend_names():
        if name == "auto":
            continue
        backend = get_backend(name)
        why = usable_here(name, device, DTYPES[dtypes[0]])
        state = "usable" if why is None else f"not usable: {why}"
        lines.append(f"  {name:<10} {state}; {backend.description}")
    for dtype in dtypes:
        lines += ["", f"auto on {device}, {dtype}, heads of width {head_dim}:"]
        lines.append((f"  {'call':<19}" + "".join(f"{e:<10}" for e in auto.ENTRIES)).rstrip())
        for case in CASES:
            picks = [auto_choice(e, case, device, DTYPES[dtype], head_dim) for e in auto.ENTRIES]
            lines.append((f"  {case:<19}" + "".join(f"{p:<10}" for p in picks)).rstrip())
        lines.append(f"sdpa's DIFF V1 calls on {device}, {dtype}:")
        for case in ("train", "prefill", "decode"):
            route = sdpa_diff_v1_route(case, device, DTYPES[dtype], head_dim)
            lines.append(f"  {case:<19}{route}")
    return "\n".join(lines)


def candidates(entry: str, case: str, device, dtype, with_reference: bool) -> list[str]:
    """Backends timed for ``entry`` and ``case``: those with their own kernel, usable here."""
    names = [n for n in own_kernels(entry) if usable_here(n, device, dtype) is None]
    if not with_reference:
        names = [n for n in names if n != "reference"]
    return names


def time_case(
    entry: str, case: str, shape: Shape, device, dtype, repeats: int, with_reference: bool
) -> dict[str, Any]:
    """Interleaved timing of every candidate for one case (see the module docstring)."""
    run, _ = make_call(entry, case, shape, device, dtype)
    names = candidates(entry, case, device, dtype, with_reference)
    calls = 32 if case.startswith("decode") or case == "traced" else 1
    times: dict[str, list[float]] = {n: [] for n in names}
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    for rep in range(repeats + 1):  # the first repetition warms up
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                run(name)
            sync()
            if rep:
                times[name].append((time.perf_counter() - start) / calls)
    base = times.get("sdpa")
    rows = {}
    for name, seconds in times.items():
        paired = (
            statistics.median(b / s for s, b in zip(seconds, base, strict=True)) if base else 1.0
        )
        rows[name] = {"median_s": statistics.median(seconds), "paired_vs_sdpa": paired}
    return {
        "entry": entry,
        "case": case,
        "auto": auto_choice(entry, case, device, dtype),
        "timings": rows,
    }


def _problem(args: BackendsSettings) -> str | None:
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: CUDA is not available on this machine"
    entries = args.entries.split(",")
    if any(e not in auto.ENTRIES for e in entries):
        return f"--entries: choose among {', '.join(auto.ENTRIES)}, got {args.entries!r}"
    if any(c not in CASES[:-1] for c in args.cases.split(",")):
        return f"--cases: choose among {', '.join(CASES[:-1])}, got {args.cases!r}"
    for name in BOUNDED:
        low = BackendsSettings.__dataclass_fields__[name].metadata["setting"].min
        if getattr(args, name) < low:
            return f"--{name.replace('_', '-')} is too small: {getattr(args, name)}"
    kv = args.kv_heads or args.heads
    if args.heads % 2 or kv % 2 or args.heads % kv:
        return f"--heads and --kv-heads must be even, kv dividing heads, got {args.heads}, {kv}"
    return None


def run(args: argparse.Namespace | BackendsSettings) -> int:
    """``diffattn backends`` with the parsed command line (or its :class:`BackendsSettings`);
    returns the exit code (2 on bad input)."""
    settings = args if isinstance(args, BackendsSettings) else BackendsSettings.from_args(args)
    problem = _problem(settings)
    if problem is not None:
        print(f"diffattn backends: error: {problem}", file=sys.stderr)
        return 2
    dtypes = list(DTYPES) if settings.dtype == "all" else [settings.dtype]
    if not settings.time:
        print(listing(settings.device, dtypes, settings.head_dim))
        return 0
    shape = Shape(
        settings.seq_len,
        settings.heads,
        settings.kv_heads or settings.heads,
        settings.batch,
        settings.head_dim,
    )
    records = []
    for dtype in dtypes:
        for entry in settings.entries.split(","):
            for case in settings.cases.split(","):
                print(f"timing {entry} {case} {dtype}", file=sys.stderr, flush=True)
                record = time_case(
                    entry,
                    case,
                    shape,
                    settings.device,
                    DTYPES[dtype],
                    settings.repeats,
                    settings.reference,
                )
                records.append({**record, "dtype": dtype, "threads": torch.get_num_threads()})
    if settings.json:
        print(json.dumps(records, indent=1))
        return 0
    print(f"{shape}, {settings.repeats} interleaved repetitions, {torch.get_num_threads()} threads")
    print(f"{'dtype':<5} {'entry':<8} {'call':<18} {'auto':<7} backend: median ms (paired x sdpa)")
    for r in records:
        cells = "  ".join(
            f"{name}: {t['median_s'] * 1e3:.2f} ({t['paired_vs_sdpa']:.2f})"
            for name, t in r["timings"].items()
        )
        print(f"{r['dtype']:<5} {r['entry']:<8} {r['case']:<18} {r['auto']:<7} {cells}")
    return 0
