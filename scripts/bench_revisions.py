"""Two revisions of diffattn side by side: the same numbers bit for bit, and the same speed.

``OLD`` and ``NEW`` are each a git revision of this repository (checked out into a temporary
worktree, removed afterwards) or a directory holding ``src/diffattn``. Two checks, each in fresh
processes with ``PYTHONPATH`` set to one side's ``src``:

* ``--equal``: the logits and the gradient of every parameter of the papers' three types (GQA,
  DIFF V1 without its head norm, DIFF V2's unpaired no-sigmoid ablation) on the ``reference``,
  ``sdpa`` and ``auto`` backends, one seed, length 129, one thread; every tensor must be
  ``torch.equal`` between the two sides.
* the speed (unless ``--no-bench``): ``diffattn bench --json --no-hf`` on each side, ``--rounds``
  times, the order of the two sides alternating between rounds; printed per row and mode, the
  median of NEW / OLD tokens per second with its range over rounds, and each side's median ratio
  to the baseline (measured inside each bench run, interleaved there). Arguments after ``--`` go
  to ``diffattn bench``.

    python scripts/bench_revisions.py HEAD~3 . --equal --rounds 5 -- --mode decode --steps 20 \\
        --new-tokens 64 --seq-len 256 --d-model 256 --layers 2 --batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

EQUAL_CASES = {
    "baseline-gqa": {"attention": "baseline", "n_kv_heads": 2},
    "diff_v1-gqa": {"attention": "diff_v1", "n_kv_heads": 2},
    "diff_v1-no-head-norm": {"attention": "diff_v1", "head_norm": False, "lambda_init": 0.5},
    "diff_v2-gqa": {"attention": "diff_v2", "n_kv_heads": 2},
    "diff_v2-unpaired": {
        "attention": "diff_v2",
        "v2_paired_heads": False,
        "v2_lambda_sigmoid": False,
    },
}
"""The models ``--equal`` compares (each on three backends)."""

EQUAL_CHILD = """
import json, sys, torch
from safetensors.torch import save_file
from diffattn import DiffTransformerLM, ModelConfig
torch.set_num_threads(1)
tensors = {}
for name, fields in json.loads(sys.argv[2]).items():
    for backend in ("reference", "sdpa", "auto"):
        torch.manual_seed(0)
        config = ModelConfig(vocab_size=97, d_model=64, n_layers=3, n_heads=4, max_seq_len=160,
                             backend=backend, **fields)
        model = DiffTransformerLM(config)
        ids = torch.randint(0, 97, (2, 129))
        result = model(ids, labels=ids)
        result.loss.backward()
        tensors[f"{name}/{backend}/logits"] = result.logits.detach().contiguous()
        for key, parameter in model.named_parameters():
            tensors[f"{name}/{backend}/grad/{key}"] = parameter.grad.contiguous()
save_file(tensors, sys.argv[1])
"""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    bench_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="a git revision of this repository, or a source tree")
    parser.add_argument("new", help="a git revision of this repository, or a source tree")
    parser.add_argument("--rounds", type=int, default=5, help="bench runs per side (default 5)")
    parser.add_argument("--equal", action="store_true", help="compare logits and gradients")
    parser.add_argument("--no-bench", action="store_true", help="skip the speed comparison")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.no_bench and not args.equal:
        parser.error("--no-bench leaves nothing to do without --equal")
    return args, bench_args


def source_tree(spec: str, stack: ExitStack) -> Path:
    """``spec``'s tree: a directory with ``src/diffattn``, or a worktree of git revision
    ``spec`` made for this run (removed when ``stack`` closes)."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "src" / "diffattn").is_dir():
            raise SystemExit(f"error: {spec} is a directory without src/diffattn")
        return path.resolve()
    found = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise SystemExit(f"error: {spec!r} is neither a directory nor a git revision")
    tree = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tree"
    git = ["git", "-C", str(REPO), "worktree"]
    revision = found.stdout.strip()
    subprocess.run([*git, "add", "--detach", "--quiet", str(tree), revision], check=True)
    stack.callback(subprocess.run, [*git, "remove", "--force", str(tree)], check=False)
    return tree


def _environment(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree / "src")}


def equal_tensors(old: Path, new: Path) -> list[str]:
    """The names of the tensors of :data:`EQUAL_CASES` that differ between the two trees."""
    from safetensors.torch import load_file

    cases = json.dumps(EQUAL_CASES)
    with tempfile.TemporaryDirectory() as scratch:
        results = []
        for side, tree in (("old", old), ("new", new)):
            path = Path(scratch) / f"{side}.safetensors"
            command = [sys.executable, "-c", EQUAL_CHILD, str(path), cases]
            subprocess.run(command, env=_environment(tree), check=True, cwd=scratch)
            results.append(load_file(path))
    before, after = results
    import torch

    names = sorted(before.keys() | after.keys())
    return [
        n
        for n in names
        if n not in before or n not in after or not torch.equal(before[n], after[n])
    ]


def bench_once(tree: Path, bench_args: list[str]) -> dict[tuple[str, str], dict]:
    """One ``diffattn bench --json --no-hf`` run of ``tree``: its rows by (row, mode)."""
    command = [sys.executable, "-m", "diffattn", "bench", "--json", "--no-hf", *bench_args]
    done = subprocess.run(command, env=_environment(tree), capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"error: diffattn bench failed in {tree}:\n{done.stderr[-3000:]}")
    return {(row["attention"], row["mode"]): row for row in json.loads(done.stdout)}


def bench_table(old: Path, new: Path, rounds: int, bench_args: list[str]) -> list[str]:
    """The interleaved rounds, as printed lines."""
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for index in range(rounds):
        order = (("old", old), ("new", new)) if index % 2 == 0 else (("new", new), ("old", old))
        for side, tree in order:
            print(f"round {index + 1}/{rounds}: {side} ({tree})", file=sys.stderr, flush=True)
            runs[side].append(bench_once(tree, bench_args))
    keys = [k for k in runs["old"][0] if k in runs["new"][0]]
    head = f"{'row':16} {'mode':8} {'new/old tokens/s: median [min, max]':38}"
    lines = [f"{head} to baseline: old -> new"]
    for key in keys:
        pairs = zip(runs["old"], runs["new"], strict=True)
        ratios = [n[key]["tokens_per_s"] / o[key]["tokens_per_s"] for o, n in pairs]
        to_base = {
            side: statistics.median(run[key]["ratio_to_baseline"] for run in runs[side])
            for side in runs
        }
        spread = f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        lines.append(
            f"{key[0]:16} {key[1]:8} {spread:38} {to_base['old']:.3f} -> {to_base['new']:.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args, bench_args = parse_args(argv)
    with ExitStack() as stack:
        old, new = source_tree(args.old, stack), source_tree(args.new, stack)
        failed = False
        if args.equal:
            differ = equal_tensors(old, new)
            total = len(EQUAL_CASES) * 3
            if differ:
                failed = True
                cases = sorted({"/".join(name.split("/")[:2]) for name in differ})
                print(f"NOT EQUAL: {len(differ)} tensors differ, in {', '.join(cases)}")
            else:
                print(f"equal: logits and every gradient of {total} model/backend cases")
        if not args.no_bench:
            print("\n".join(bench_table(old, new, args.rounds, bench_args)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
