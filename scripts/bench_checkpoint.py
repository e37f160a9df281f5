"""Checkpoint save cost and FSDP2 mixed-precision memory, measured on two CPU processes.

    python scripts/bench_checkpoint.py [--d-model 768 --layers 8] [--repeats 3] [--out F.json]

Launches itself under ``torchrun --nproc-per-node 2`` (gloo) once per configuration and prints:

* **save**: per rank, the seconds a save blocks training and the bytes it writes, for the
  gathered full checkpoint (rank 0 gathers and writes everything), the sharded DCP checkpoint
  (each rank its shards), and the asynchronous sharded one (blocking part, then the time until
  the background writes finish). Median of ``--repeats`` saves, interleaved.
* **memory**: per rank, the peak resident memory (``ru_maxrss``) of a process that builds the
  FSDP2 model and runs one bf16-autocast forward and backward with and without the
  mixed-precision policy (bf16 parameters in compute, fp32 reduction). Each configuration runs
  in a fresh process, since the peak only grows.

A measurement, not a test: nothing is asserted. Figures depend on the machine's disk and cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _model(args):
    import torch

    from diffattn.config import ModelConfig
    from diffattn.train.parallel import build_model

    config = ModelConfig(
        vocab_size=8192,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 64,
        max_seq_len=args.seq_len,
        attention="diff_v1",
    )
    policy = torch.bfloat16 if args.worker == "memory-mp" else None
    return build_model(
        config, mode="fsdp", device=torch.device("cpu"), seed=0, mixed_precision=policy
    ), config


def _step(model, optimizer, args, autocast: bool):
    import torch

    ids = torch.randint(0, 8192, (2, args.seq_len))
    context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with context:
        loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _save_worker(args) -> dict:
    import torch
    import torch.distributed as dist

    from diffattn.train import checkpoint as ckpt
    from diffattn.train.parallel import full_model_state, full_optimizer_state
    from diffattn.train.sharded import ShardedCheckpointer

    model, config = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optimizer, args, autocast=False)
    root = Path(args.root)
    rank = dist.get_rank()
    times: dict[str, list] = {"full": [], "sharded": [], "async_blocking": [], "async_total": []}
    sizes: dict[str, int] = {}
    for repeat in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        state, optim = full_model_state(model), full_optimizer_state(model, optimizer)
        if rank == 0:
            trainer = {"step": repeat, "optimizer": optim, "rank_states": []}
            ckpt.save_checkpoint(root / "full", repeat, config, state, trainer, "")
        dist.barrier()
        times["full"].append(time.perf_counter() - t0)
        for kind, asynchronous in (("sharded", False), ("async", True)):
            saver = ShardedCheckpointer(root / kind, asynchronous)
            dist.barrier()
            t0 = time.perf_counter()
            saver.save(repeat, model, optimizer, lambda tmp: None, lambda path: None)
            blocked = time.perf_counter() - t0
            saver.wait()
            total = time.perf_counter() - t0
            times["sharded" if kind == "sharded" else "async_blocking"].append(blocked)
            if kind == "async":
                times["async_total"].append(total)
    for kind in ("full", "sharded", "async"):
        shard = root / kind / f"step-{args.repeats - 1:08d}"
        mine = sorted(shard.rglob(f"__{rank}_*.distcp")) if kind != "full" else None
        sizes[kind] = (
            (_bytes(shard) if rank == 0 else 0)
            if kind == "full"
            else sum(p.stat().st_size for p in mine)
        )
    return {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "bytes_written": sizes,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _memory_worker(args) -> dict:
    import torch

    model, _ = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optimizer, args, autocast=True)
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = _save_worker(args) if args.worker == "save" else _memory_worker(args)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        Path(args.report).write_text(json.dumps(results))
    dist.destroy_process_group()


def _launch(args, worker: str, root: str) -> list[dict]:
    report = Path(root) / f"{worker}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={29400 + os.getpid() % 500}",
        __file__, "--worker", worker, "--report", str(report), "--root", root,
        "--d-model", str(args.d_model), "--layers", str(args.layers),
        "--seq-len", str(args.seq_len), "--repeats", str(args.repeats),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    subprocess.run(command, check=True, env=env)
    return json.loads(report.read_text())


def _print(save: list[dict], memory: dict[str, list[dict]]) -> None:
    print(f"parameters: {save[0]['parameters']:,}")
    print("| rank | full s | sharded s | async blocking s | async total s | full MB | shard MB |")
    print("|---|---|---|---|---|---|---|")
    for rank, r in enumerate(save):
        s, b = r["seconds"], r["bytes_written"]
        print(
            f"| {rank} | {s['full']:.2f} | {s['sharded']:.2f} | {s['async_blocking']:.2f} | "
            f"{s['async_total']:.2f} | {b['full'] / 2**20:.0f} | {b['sharded'] / 2**20:.0f} |"
        )
    print("| rank | peak RSS MiB, fp32 all-gathers | peak RSS MiB, bf16 policy |")
    print("|---|---|---|")
    for rank, (plain, mp) in enumerate(zip(memory["memory"], memory["memory-mp"], strict=True)):
        print(f"| {rank} | {plain['peak_rss_mib']:.0f} | {mp['peak_rss_mib']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the measurements as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as root:
        save = _launch(args, "save", root)
        memory = {w: _launch(args, w, root) for w in ("memory", "memory-mp")}
    _print(save, memory)
    if args.out:
        Path(args.out).write_text(json.dumps({"save": save, **memory}, indent=2))


if __name__ == "__main__":
    main()
