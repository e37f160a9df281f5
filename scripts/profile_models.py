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
from diffattn.bench.models import our_decode
from diffattn.bench.throughput import matched_v2
from diffattn.config import ModelConfig
from diffattn.model import DiffTransformerLM


def build(args: argparse.Namespace) -> dict[str, DiffTransformerLM]:
    longest = args.seq_len + (args.new_tokens if args.mode == "decode" else 0)
    base = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 64,
        n_kv_heads=args.kv_heads,
        max_seq_len=longest,
        attention="baseline",
        backend=args.backend,
    )
    configs = {
        "baseline": base,
        "diff_v1": base.replace(attention="diff_v1"),
        "diff_v2": matched_v2(base),
    }
    models = {}
    for name in args.models.split(","):
        if name not in configs:
            raise SystemExit(f"error: --models: unknown {name!r} (baseline, diff_v1, diff_v2)")
        torch.manual_seed(0)
        models[name] = DiffTransformerLM(configs[name])
    return models


def runner(model: DiffTransformerLM, args: argparse.Namespace, ids: torch.Tensor):
    """``prepare()``: does the untimed part (decode's prefill) and returns what to profile."""
    if args.mode == "decode":
        prepare = our_decode(model, "static", compiled=False)
        return lambda: prepare(ids, args.new_tokens)

    def step() -> None:
        model.train()
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return lambda: step


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
    args = parser.parse_args(argv)
    if args.rms_norm == "reference":
        layers.rms_norm = layers.rms_norm_reference
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, args.seq_len), generator=generator)
    models = build(args)
    print(f"{args.mode}, N={args.seq_len}, {torch.get_num_threads()} threads, {args.steps} runs")
    for name, model in models.items():
        prepare = runner(model, args, ids)
        prepare()()  # warm-up: the compiled kernel's build, allocator state
        runs = [prepare() for _ in range(args.steps)] if args.mode == "decode" else None
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.by_shape) as prof:
            for i in range(args.steps):
                (runs[i] if runs is not None else prepare())()
        events = prof.key_averages(group_by_input_shape=args.by_shape)
        total = sum(e.self_cpu_time_total for e in events) / 1e3
        print(f"===== {name}: self CPU total {total:.1f} ms")
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
