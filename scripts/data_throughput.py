"""Text throughput of ``diffattn data prepare``: the local path against ``--engine ray``.

    python scripts/data_throughput.py [--source stdlib:all] [--workers 1 2] [--rounds 3]
                                      [--task-bytes 1048576] [--tokenizer bpe:8192]

Trains the tokenizer once (not timed), starts one embedded Ray with as many CPUs as the
largest ``--workers`` (its start-up is printed, not counted), then prepares the same sources
``--rounds`` times per arm, the arms interleaved within each round (local, ray at each worker
count), each into a fresh cache: what is timed is :func:`diffattn.data.prepare_data` reading,
tokenising and writing the shards. Prints MB/s of UTF-8 text (median, min and max over the
rounds), the share of a ray run's wall time the driver spent unpacking results and writing
shards (median), and checks that every arm wrote the same shards (the same fingerprint).

A measurement, not a test; run it on a quiet machine (``uptime``: load below 1).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", nargs="+", default=["stdlib:all"], help="source specs")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="ray arms")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--task-bytes", type=int, default=1 << 20, help="ray input per task")
    parser.add_argument("--tokenizer", default="bpe:8192", help="tokenizer spec")
    return parser.parse_args()


def _tokenizer(args: argparse.Namespace, root: Path) -> str:
    """An ``hf:DIR`` spec of the tokenizer ``--tokenizer`` gives on these sources (a BPE is
    trained here, once), so that no timed run trains one."""
    from diffattn.data import DataConfig, prepare_data

    config = DataConfig(sources=args.source, tokenizer=args.tokenizer, cache_dir=str(root))
    prepared = prepare_data(config, progress=False)
    saved = root / "tokenizer"
    prepared.tokenizer.save(saved)
    return f"hf:{saved}"


def _time_arm(args, root: Path, tokenizer: str, engine) -> tuple[float, int, str, float]:
    from diffattn.data import DataConfig, prepare_data

    cache = Path(tempfile.mkdtemp(dir=root))
    config = DataConfig(sources=args.source, tokenizer=tokenizer, cache_dir=str(cache))
    started = time.perf_counter()
    prepared = prepare_data(config, progress=False, engine=engine)
    seconds = time.perf_counter() - started
    shutil.rmtree(cache)
    writing = 0.0 if engine is None else engine.progress["write_ms"] / 1000 / seconds
    return seconds, prepared.stats.text_bytes, prepared.stats.fingerprint, writing


def main() -> None:
    args = _arguments()
    import ray

    from diffattn.data.ray_engine import RayEngine

    load = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="diffattn-throughput-"))
    try:
        tokenizer = _tokenizer(args, root)
        started = time.perf_counter()
        cpus = max(args.workers)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        print(f"ray start-up: {time.perf_counter() - started:.1f} s (not counted)")
        arms = {"local": None}
        for workers in args.workers:
            engine = RayEngine(workers=workers, task_bytes=args.task_bytes).connect()
            arms[f"ray, {workers} worker(s)"] = engine
        for engine in arms.values():  # warm the workers (their imports) before timing
            if engine is not None:
                _time_arm(args, root, tokenizer, engine)
        rates: dict[str, list[float]] = {name: [] for name in arms}
        writing: dict[str, list[float]] = {name: [] for name in arms}
        fingerprints = set()
        for _ in range(args.rounds):
            for name, engine in arms.items():
                seconds, text_bytes, fingerprint, share = _time_arm(args, root, tokenizer, engine)
                rates[name].append(text_bytes / seconds / 1e6)
                writing[name].append(share)
                fingerprints.add(fingerprint)
        ray.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"sources {args.source}: {text_bytes / 1e6:.1f} MB of text, {args.rounds} rounds")
    print(f"load average before: {load:.2f}; {os.cpu_count()} CPUs")
    print(f"{'arm':<22} {'MB/s median':>12} {'min':>8} {'max':>8} {'driver writing':>15}")
    for name, values in rates.items():
        median, share = statistics.median(values), statistics.median(writing[name])
        shown = "" if arms[name] is None else f"{share:.1%}"
        print(f"{name:<22} {median:>12.2f} {min(values):>8.2f} {max(values):>8.2f} {shown:>15}")
    print("same shards in every arm:", "yes" if len(fingerprints) == 1 else "NO")


if __name__ == "__main__":
    main()
