"""Peak memory of the capture probe on a long sequence (a command, not a timed test).

``python -m diffattn.bench.probe_memory`` builds a 4-layer, d_model 256 model of each attention
type (``--attention``: any registered ones; by default the papers' three), runs one forward of
``--seq-len`` tokens (4,096 by default) on CPU under a probe that captures the attention mass
on a key span (:class:`~diffattn.probe.SpanMass`) and the top-100 |logits|
(:class:`~diffattn.probe.LogitStats`), and prints the process's peak resident memory.
Each type runs in a fresh process, so peaks do not mix; the figure includes Python and torch
(see the ``idle`` column: the peak of a process that only built the model).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from diffattn.settings import Settings, setting


@dataclass(frozen=True)
class ProbeMemorySettings(Settings):
    """The options of ``python -m diffattn.bench.probe_memory`` (``child`` and ``idle``: how
    the command runs one measurement in a fresh process; not listed by ``--help``)."""

    seq_len: int = setting(4096)
    block_rows: int = setting(128)
    threads: int = setting(2)
    attention: tuple[str, ...] | None = setting(
        None, help="attention types to measure (default: those diffattn bench times by default)"
    )
    child: str | None = setting(None, suppress=True)
    idle: bool = setting(False, suppress=True)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(attention: str, seq_len: int, block_rows: int, forward: bool) -> dict:
    """One measurement in this process: build, optionally probe one forward, read the peak."""
    from diffattn.config import ModelConfig
    from diffattn.model import DiffTransformerLM
    from diffattn.probe import LogitStats, Probe, SpanMass

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=8192,
        d_model=256,
        n_layers=4,
        n_heads=8,
        attention=attention,
        max_seq_len=seq_len,
        backend="sdpa",
    )
    model = DiffTransformerLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, seq_len))
    result = {"attention": attention, "seq_len": seq_len, "block_rows": block_rows}
    if forward:
        span = SpanMass(spans=[(seq_len // 2, seq_len // 2 + 32)])
        stats = LogitStats(top_k=100)
        start = time.perf_counter()
        with torch.no_grad(), Probe(model, [span, stats], block_rows=block_rows):
            model(ids)
        result["forward_s"] = time.perf_counter() - start
        result["top1_logit"] = stats.result()["all"]["top1"]
        result["span_mass_shape"] = list(span.result()[0][0]["applied"].shape)
    result["peak_rss_mib"] = _peak_mib()
    return result


def _child(args: ProbeMemorySettings, attention: str, forward: bool) -> dict:
    command = [
        sys.executable,
        "-m",
        "diffattn.bench.probe_memory",
        "--child",
        attention,
        "--seq-len",
        str(args.seq_len),
        "--block-rows",
        str(args.block_rows),
        "--threads",
        str(args.threads),
    ] + ([] if forward else ["--idle"])
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffattn.bench.probe_memory")
    ProbeMemorySettings.add_arguments(parser)
    args = ProbeMemorySettings.from_args(parser.parse_args(argv))
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args.child, args.seq_len, args.block_rows, not args.idle)))
        return 0
    print(
        f"probe memory: 4 layers, d_model 256, {args.seq_len} tokens, SpanMass + LogitStats "
        f"top-100, block_rows {args.block_rows}, CPU, torch {torch.__version__}"
    )
    print(f"{'attention':>10} {'idle MiB':>10} {'peak MiB':>10} {'forward s':>10}")
    from diffattn.bench.options import default_types

    for attention in args.attention or default_types():
        idle = _child(args, attention, forward=False)["peak_rss_mib"]
        probed = _child(args, attention, forward=True)
        peak, seconds = probed["peak_rss_mib"], probed["forward_s"]
        print(f"{attention:>10} {idle:>10.0f} {peak:>10.0f} {seconds:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
