"""Context parallelism on the CPU: peak memory per rank, and what the K/V exchange costs.

    python scripts/cp_memory.py [--lengths 8192 16384] [--degrees 1 2 4] [--exchange]

Launches itself under ``torchrun --nproc-per-node C`` (gloo, one thread a rank) once per
(length, degree) and prints one JSON line per rank:

* **memory** (default): a small DIFF V1 model (d_model 128, 2 layers, 8 query and 2 KV
  half-heads of width 32, vocab 256, fp32, the ``auto`` backend: the fused CPU kernel) runs one
  forward and backward of one row of N tokens split over C ranks
  (:func:`diffattn.train.context_parallel.context_parallel_forward`). ``peak_mib`` is the
  process's peak resident memory (``ru_maxrss``), ``step_mib`` its growth over the step (the
  high-water mark before the step is taken after building the model and a short warm-up), and
  ``gathered_kv_mib`` what every rank holds of the whole sequence: the gathered keys and values
  of every layer (kept for backward), the part that does not shrink with C.
* **exchange** (``--exchange``): per layer, the seconds of the K/V all-gather forward and
  backward alone, against the seconds of the layer's whole split attention (gather, both
  chunks' attention, backward), median of 3 after a warm-up.

A measurement, not a test: nothing is asserted. Figures depend on the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MIB = 1024 * 1024


def _config():
    from diffattn.config import ModelConfig

    return ModelConfig(
        attention="diff_v1",
        vocab_size=256,
        d_model=128,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        ffn_hidden=256,
        max_seq_len=1 << 16,
        backend="auto",
    )


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _memory(n: int) -> dict:
    import torch
    import torch.distributed as dist

    from diffattn.model import DiffTransformerLM
    from diffattn.train.context_parallel import context_parallel_forward

    config, group = _config(), dist.group.WORLD
    torch.manual_seed(0)
    model = DiffTransformerLM(config)
    degree = dist.get_world_size()
    warm = torch.randint(0, config.vocab_size, (1, 2 * degree * 8))
    context_parallel_forward(model, warm, group, labels=warm).loss.backward()
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, config.vocab_size, (1, n))
    before = _peak_mib()
    context_parallel_forward(model, ids, group, labels=ids).loss.backward()
    peak = _peak_mib()
    per_token = 2 * config.num_kv_heads * config.dim_per_head * 4  # K and V, fp32
    return {
        "n": n,
        "cp": degree,
        "rank": dist.get_rank(),
        "peak_mib": round(peak),
        "step_mib": round(peak - before),
        "gathered_kv_mib": round(config.n_layers * n * per_token / MIB, 1),
    }


def _timed(step, repeats: int = 3) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _exchange(n: int) -> dict:
    import torch
    import torch.distributed as dist

    from diffattn.attention import build_attention
    from diffattn.attention.context_parallel import ChunkLayout, SequenceSplit, gather_sequence
    from diffattn.layers import RotaryEmbedding

    config, group = _config(), dist.group.WORLD
    layout = ChunkLayout(n, dist.get_world_size(), dist.get_rank())
    split = SequenceSplit(group, layout)
    torch.manual_seed(0)
    attn = build_attention(config, 0)
    x = torch.randn(1, 2 * layout.chunk, config.d_model, requires_grad=True)
    rope = RotaryEmbedding(config.dim_per_head)(layout.positions()[None])
    d = config.dim_per_head
    k = torch.randn(1, config.num_kv_heads, 2 * layout.chunk, d, requires_grad=True)
    v = torch.randn(1, config.num_kv_heads // 2, 2 * layout.chunk, 2 * d, requires_grad=True)

    def gather_only():
        keys, values = gather_sequence(k, layout, group), gather_sequence(v, layout, group)
        (keys.sum() + values.sum()).backward()

    def whole_layer():
        from diffattn.attention.context_parallel import context_parallel
        from diffattn.attention.mask import AttentionMask

        with context_parallel(split):
            attn(x, rope, AttentionMask())[0].sum().backward()

    gather_s, layer_s = _timed(gather_only), _timed(whole_layer)
    return {
        "n": n,
        "cp": layout.degree,
        "rank": layout.rank,
        "gather_s": round(gather_s, 4),
        "layer_s": round(layer_s, 4),
        "gather_share": round(gather_s / layer_s, 3),
    }


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for n in args.lengths:
        row = _exchange(n) if args.exchange else _memory(n)
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(args, n: int, degree: int) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={degree}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        str(Path(__file__).resolve()),
        "--worker",
        "--lengths",
        str(n),
        *(["--exchange"] if args.exchange else []),
    ]
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    rows = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not rows:
        sys.exit(f"cp_memory: N={n} CP={degree} failed:\n{result.stderr[-3000:]}")
    for line in sorted(rows, key=lambda line: json.loads(line)["rank"]):
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--exchange", action="store_true", help="time the K/V exchange")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    for n in args.lengths:
        for degree in args.degrees:
            if args.exchange and degree == 1:
                continue
            _launch(args, n, degree)


if __name__ == "__main__":
    main()
