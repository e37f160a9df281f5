"""Where the time of a training step or of a decode run goes, per model (torch.profiler).

The models are those of ``diffattn bench`` (matched parameters, heads of width 64, default
backends unless ``--backend``); each is profiled alone after one warm-up run, and the table of
aten ops by self CPU time is printed per model. docs/performance.md quotes its output.

    python scripts/profile_models.py --mode fwd+bwd --seq-len 4096 --models baseline,diff_v1
    python scripts/profile_models.py --mode fwd+bwd --seq-len 4096 --by-shape
    python scripts/profile_models.py --mode decode --seq-len 1024 --new-tokens 64 --kv-heads 4

``--rms-norm reference`` runs RMSNorm through autograd's plain ops instead of its hand-written
backward (``diffattn.layers.rms_norm_reference``), to compare the two.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import diffattn.layers as layers
from diffattn.bench.models import our_candidates
from diffattn.bench.throughput import build_configs, runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("fwd+bwd", "decode"), default="fwd+bwd")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens (decode: the prompt)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--models", default="baseline,diff_v1,diff_v2")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=2, help="runs inside the profile")
    parser.add_argument("--rows", type=int, default=16, help="table rows per model")
    parser.add_argument("--by-shape", action="store_true", help="group ops by input shapes")
    parser.add_argument("--rms-norm", choices=("fast", "reference"), default="fast")
    # what diffattn.bench.throughput.build_configs reads besides the options above
    parser.set_defaults(sweep=None, plot=None, prompt_len=None, mem_seq_len=None, device="cpu")
    args = parser.parse_args(argv)
    if args.rms_norm == "reference":
        layers.rms_norm = layers.rms_norm_reference
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, args.seq_len), generator=generator)
    configs = build_configs(args)
    names = args.models.split(",")
    unknown = sorted(set(names) - set(configs))
    if unknown:
        raise SystemExit(f"error: --models: unknown {', '.join(unknown)} ({', '.join(configs)})")
    chosen = {name: configs[name] for name in names}
    print(f"{args.mode}, N={args.seq_len}, {torch.get_num_threads()} threads, {args.steps} runs")
    for candidate in our_candidates(chosen, "cpu", torch.float32):
        prepare = runner(candidate, ids, args.mode, args.new_tokens)
        prepare()()  # warm-up: the compiled kernel's build, allocator state
        runs = [prepare() for _ in range(args.steps)] if args.mode == "decode" else None
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.by_shape) as prof:
            for i in range(args.steps):
                (runs[i] if runs is not None else prepare())()
        events = prof.key_averages(group_by_input_shape=args.by_shape)
        total = sum(e.self_cpu_time_total for e in events) / 1e3
        print(f"===== {candidate.name}: self CPU total {total:.1f} ms")
        print(
            events.table(
                sort_by="self_cpu_time_total",
                row_limit=args.rows,
                max_name_column_width=44,
                max_shapes_column_width=80,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
