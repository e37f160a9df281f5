"""Where the time of a training step or of a decode run goes, per model (torch.profiler).

The models are those of ``diffattn bench`` (matched parameters, heads of width
``--head-dim``, default backends unless ``--backend``); each is profiled alone after warm-up
runs, and the table of ops by self time is printed per model: CPU time on the CPU, CUDA
kernel time with ``--device cuda`` (the table a GPU run needs). ``--compile`` compiles the
models as ``diffattn bench --compile`` does. docs/performance.md quotes its output.

    python scripts/profile_models.py --mode fwd+bwd --seq-len 4096 --models baseline,diff_v1
    python scripts/profile_models.py --mode fwd+bwd --seq-len 4096 --by-shape
    python scripts/profile_models.py --mode decode --seq-len 1024 --new-tokens 64 --kv-heads 4
    python scripts/profile_models.py --device cuda --dtype bf16 --d-model 2048 --seq-len 4096

``--rms-norm reference`` runs RMSNorm through autograd's plain ops instead of its hand-written
backward (``diffattn.layers.rms_norm_reference``), to compare the two.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import diffattn.layers as layers
from diffattn.bench.models import our_candidates
from diffattn.bench.throughput import DTYPES, HEAD_DIM, build_configs, runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("fwd+bwd", "decode"), default="fwd+bwd")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens (decode: the prompt)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="the baseline's head width")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--compile", action="store_true", help="as diffattn bench --compile")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--models", default="baseline,diff_v1,diff_v2")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=2, help="runs inside the profile")
    parser.add_argument("--rows", type=int, default=16, help="table rows per model")
    parser.add_argument("--by-shape", action="store_true", help="group ops by input shapes")
    parser.add_argument("--rms-norm", choices=("fast", "reference"), default="fast")
    # what diffattn.bench.throughput.build_configs reads besides the options above
    parser.set_defaults(sweep=None, plot=None, prompt_len=None, mem_seq_len=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available on this machine")
    if args.rms_norm == "reference":
        layers.rms_norm = layers.rms_norm_reference
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, args.seq_len), generator=generator).to(args.device)
    configs = build_configs(args)
    names = args.models.split(",")
    unknown = sorted(set(names) - set(configs))
    if unknown:
        raise SystemExit(f"error: --models: unknown {', '.join(unknown)} ({', '.join(configs)})")
    chosen = {name: configs[name] for name in names}
    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    clock = "device" if cuda else "cpu"  # the self-time column the table is sorted by
    print(
        f"{args.mode}, N={args.seq_len}, {args.device} {args.dtype}, "
        f"{torch.get_num_threads()} threads, {args.steps} runs, compiled: {args.compile}"
    )
    candidates = our_candidates(chosen, args.device, DTYPES[args.dtype], compiled=args.compile)
    for candidate in candidates:
        if args.compile:
            candidate.model.compile_blocks()
        prepare = runner(candidate, ids, args.mode, args.new_tokens)
        for _ in range(2 if args.compile else 1):  # the kernels' builds, allocator state
            prepare()()
        runs = [prepare() for _ in range(args.steps)] if args.mode == "decode" else None
        with profile(activities=activities, record_shapes=args.by_shape) as prof:
            for i in range(args.steps):
                (runs[i] if runs is not None else prepare())()
            if cuda:
                torch.cuda.synchronize()
        events = prof.key_averages(group_by_input_shape=args.by_shape)
        total = sum(getattr(e, f"self_{clock}_time_total") for e in events) / 1e3
        print(f"===== {candidate.name}: self {clock.upper()} total {total:.1f} ms")
        print(
            events.table(
                sort_by=f"self_{clock}_time_total",
                row_limit=args.rows,
                max_name_column_width=44,
                max_shapes_column_width=80,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
