"""The GPU check: one command that measures what a short GPU loan can tell, most valuable first.

    PYTHONPATH=src python scripts/gpu_check.py              # everything, at most about 8 minutes
    PYTHONPATH=src python scripts/gpu_check.py --quick      # a shorter version
    PYTHONPATH=src python scripts/gpu_check.py --steps a,c  # the CUDA tests and the bench only
    PYTHONPATH=src python scripts/gpu_check.py --dry-run    # the plan and its budgets

Steps, in this order:

a. the CUDA tests (``pytest -m gpu``, which replaces the default ``-m 'not slow and not gpu'``
   of ``pyproject.toml``): every CUDA backend and compiled path against the reference;
b. ``diffattn backends --time`` on CUDA;
c. ``diffattn bench`` in bf16, d_model 2048, 4 layers: fwd+bwd at N = 2048, 4096, 8192 with
   heads of width 64 and 128, compiled (at N = 4096) and not; decode (prompt 2048, 64 new
   tokens, 8 KV heads, batch 4), compiled and not; GDA at 1:1 (which must run at DIFF V1's
   speed on the Triton kernel) and 3:1 beside DIFF V1 at N = 4096, 8 KV heads; ``--json``, so
   the report holds the ratios;
d. a profile of each model's training step (``scripts/profile_models.py``, CUDA time);
e. a compiled bf16 training run (``diffattn train configs/tiny.yaml``, a few steps).

Each command runs with this interpreter and ``PYTHONPATH=<checkout>/src`` (nothing needs to be
installed), under its own time budget: a step that fails or runs out of time is recorded and
the next one starts. ``--budget`` (default 475 s) caps the whole run; a step that would start
with less than :data:`MIN_STEP_S` left is skipped. The report,
``docs/gpu/YYYY-MM-DD-<device>.md``, names the device and the versions and gives each step's
command, wall time, status, ratio tables and output; the raw results are beside it in a
``.json`` file of the same name. On a machine without CUDA the script says so and writes
nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 475
LIMIT_S = 480
"""The most the whole check may take (8 minutes): ``--budget`` cannot exceed it."""
MIN_STEP_S = 20
"""A step is skipped when less than this is left of the budget."""
OUTPUT_LINES = 60
"""Lines of each step's output kept in the markdown report (the JSON keeps the full text)."""
COLLECT = ["--continue-on-collection-errors"]
"""A test module that cannot be imported there (a missing extra) does not stop the others."""
TRAIN_SETTINGS = [
    "--device",
    "cuda",
    "--set",
    "dtype=bf16",
    "--set",
    "compile=true",
    "--steps",
    "20",
    "--quiet",
]
BENCH = ["--dtype", "bf16", "--device", "cuda", "--d-model", "2048", "--layers", "4"]


@dataclass(frozen=True)
class Step:
    """One command of the check."""

    key: str
    """``a`` … ``e`` (``--steps`` selects by this letter), with a number within a letter."""
    title: str
    argv: list[str]
    budget_s: int
    """Its timeout: the step is stopped (and recorded) when it runs longer."""
    json_stdout: bool = False
    """Its stdout is a JSON array of bench records."""

    @property
    def letter(self) -> str:
        return self.key[0]

    @property
    def command(self) -> str:
        """The command as one would type it in the checkout (``python`` for this one)."""
        return " ".join(["python", *self.argv])


@dataclass
class StepResult:
    """What one step did."""

    key: str
    title: str
    command: str
    budget_s: int
    status: str
    """``ok``, ``failed`` (non-zero exit), ``timeout`` or ``skipped``."""
    wall_s: float = 0.0
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    records: list[dict] | None = None
    note: str = ""


def _bench(key, title, budget, *options) -> Step:
    return Step(key, title, ["-m", "diffattn", "bench", *BENCH, *options, "--json"], budget, True)


def plan(quick: bool = False, train_out: str = "<tmp>") -> list[Step]:
    """Every step of the check, most valuable first; ``quick`` shortens each."""
    lengths = "2048,4096" if quick else "2048,4096,8192"
    timed = ["--steps", "3" if quick else "5", "--warmup", "2", "--batch", "2"]
    decode = ["--mode", "decode", "--seq-len", "2048", "--new-tokens", "64", "--kv-heads", "8"]
    decode += ["--batch", "4", "--steps", "3", "--warmup", "1"]
    steps = [
        Step(
            "a", "CUDA tests", ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:xdist", *COLLECT], 100
        ),
        Step(
            "b",
            "attention backends, timed",
            ["-m", "diffattn", "backends", "--device", "cuda", "--time", "--dtype", "bf16"],
            35,
        ),
        _bench("c1", "fwd+bwd, heads of 64", 60, "--mode", "fwd+bwd", "--sweep", lengths, *timed),
        _bench(
            "c2",
            "fwd+bwd, heads of 128",
            45,
            "--mode",
            "fwd+bwd",
            "--sweep",
            lengths,
            "--head-dim",
            "128",
            "--no-hf",
            *timed,
        ),
        _bench(
            "c3",
            "fwd+bwd compiled, heads of 64",
            80,
            "--mode",
            "fwd+bwd",
            "--seq-len",
            "4096",
            "--no-hf",
            "--compile",
            *timed,
        ),
        _bench("c4", "decode", 20, *decode),
        _bench("c5", "decode compiled (CUDA graphs)", 40, *decode, "--no-hf", "--compile"),
        _bench(
            "c6",
            "GDA 1:1 and 3:1 beside DIFF V1, fwd+bwd",
            25,
            "--mode",
            "fwd+bwd",
            "--seq-len",
            "4096",
            "--models",
            "baseline,diff_v1,gda:ratio=1,gda",
            "--kv-heads",
            "8",  # 3:1 needs its 8 noise heads to split evenly over the KV groups
            "--no-hf",
            *timed,
        ),
        Step(
            "d",
            "profile of each model's training step",
            [
                "scripts/profile_models.py",
                "--device",
                "cuda",
                "--dtype",
                "bf16",
                "--d-model",
                "2048",
                "--layers",
                "4",
                "--seq-len",
                "2048" if quick else "4096",
                "--rows",
                "20",
            ],
            35,
        ),
        Step(
            "e",
            "compiled bf16 training run",
            ["-m", "diffattn", "train", "configs/tiny.yaml", *TRAIN_SETTINGS, "--out", train_out],
            35,
        ),
    ]
    if quick:
        steps = [s for s in steps if s.key not in ("c2",)]
        steps = [Step(s.key, s.title, s.argv, s.budget_s * 2 // 3, s.json_stdout) for s in steps]
    return steps


def select(steps: list[Step], letters: str | None) -> list[Step]:
    """The steps whose letter is in the comma-separated ``letters`` (all when ``None``)."""
    if letters is None:
        return steps
    wanted = {part.strip() for part in letters.split(",") if part.strip()}
    known = {s.letter for s in steps}
    if not wanted or wanted - known:
        raise ValueError(f"--steps: choose among {', '.join(sorted(known))}, got {letters!r}")
    return [s for s in steps if s.letter in wanted]


def run_step(step: Step, timeout_s: float, env: dict[str, str], cwd: Path) -> StepResult:
    """Run ``step`` with this interpreter; stop its process group after ``timeout_s``."""
    result = StepResult(step.key, step.title, step.command, step.budget_s, "ok")
    start = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, *step.argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: a timeout stops its children too
    )
    try:
        result.stdout, result.stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        result.stdout, result.stderr = process.communicate()
        result.status = "timeout"
        result.note = f"stopped after {timeout_s:.0f} s"
    result.wall_s = time.monotonic() - start
    result.returncode = process.returncode
    if result.status == "ok" and process.returncode != 0:
        result.status = "failed"
    if step.json_stdout and result.stdout.strip():
        try:
            result.records = json.loads(result.stdout)
        except json.JSONDecodeError:
            result.note = (result.note + "; " if result.note else "") + "stdout is not JSON"
    return result


def run_plan(
    steps: list[Step],
    budget_s: float,
    runner: Callable[[Step, float], StepResult],
    log: Callable[[str], None] = print,
) -> list[StepResult]:
    """Run every step in turn, each for at most its budget and what is left of ``budget_s``.
    A failure or timeout is recorded and the next step runs."""
    results = []
    start = time.monotonic()
    for step in steps:
        left = budget_s - (time.monotonic() - start)
        if left < MIN_STEP_S:
            results.append(StepResult(step.key, step.title, step.command, step.budget_s, "skipped"))
            results[-1].note = f"{left:.0f} s of the budget left"
            log(f"[{step.key}] skipped: {results[-1].note}")
            continue
        log(f"[{step.key}] {step.title}: {step.command}")
        result = runner(step, min(step.budget_s, left))
        log(f"[{step.key}] {result.status} in {result.wall_s:.1f} s")
        results.append(result)
    return results


# ----------------------------------------------------------------------------------------
# the report
def device_info() -> dict[str, str]:
    """The CUDA device and the versions that matter, as strings."""
    import torch

    props = torch.cuda.get_device_properties(0)
    info = {
        "device": torch.cuda.get_device_name(0),
        "capability": "{}.{}".format(*torch.cuda.get_device_capability(0)),
        "memory": f"{props.total_memory / 1024**3:.1f} GiB",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": sys.version.split()[0],
    }
    for package in ("triton", "transformers"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = "not installed"
    return info


def slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


RATIO_COLUMNS = (
    ("model", "attention"),
    ("N", "seq_len"),
    ("head", "head_dim"),
    ("compiled", "compiled"),
    ("tokens/s", "tokens_per_s"),
    ("paired ratio", "paired_ratio_to_baseline"),
    ("FLOP bound", "flop_bound"),
    ("memory ratio", "mem_ratio_to_baseline"),
    ("MFU", "mfu"),
    ("ref", "ratio_reference"),
)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if value >= 100 else f"{value:.3f}"
    return "" if value is None else str(value)


def ratio_table(records: list[dict]) -> list[str]:
    """A markdown table of bench records, one row per model and length."""
    lines = [
        "| " + " | ".join(title for title, _ in RATIO_COLUMNS) + " |",
        "|" + "---|" * len(RATIO_COLUMNS),
    ]
    for record in records:
        cells = (_cell(record.get(key)) for _, key in RATIO_COLUMNS)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _tail(text: str, lines: int = OUTPUT_LINES) -> str:
    kept = text.rstrip().splitlines()
    cut = len(kept) - lines
    return "\n".join(([f"[{cut} earlier lines in the JSON]"] if cut > 0 else []) + kept[-lines:])


def render_markdown(run: dict) -> str:
    """The report of a recorded run (``run``: what :func:`write_report` stores as JSON)."""
    info = run["device"]
    out = [
        f"# GPU check, {run['date']}: {info['device']}",
        "",
        f"- device: {info['device']}, compute capability {info['capability']}, {info['memory']}",
        f"- torch {info['torch']} (CUDA {info['cuda']}), triton {info['triton']}, "
        f"transformers {info['transformers']}, Python {info['python']}",
        f"- command: `{run['command']}`; budget {run['budget_s']} s, total {run['wall_s']:.0f} s",
        "",
        "| step | what | status | wall time | budget |",
        "|---|---|---|---|---|",
    ]
    for r in run["steps"]:
        status = r["status"] + (f" ({r['note']})" if r["note"] else "")
        out.append(
            f"| {r['key']} | {r['title']} | {status} | {r['wall_s']:.1f} s | {r['budget_s']} s |"
        )
    for r in run["steps"]:
        out += ["", f"## {r['key']}. {r['title']}: {r['status']}", "", f"`{r['command']}`"]
        if r["status"] == "skipped":
            continue
        out += ["", f"exit code {r['returncode']}, {r['wall_s']:.1f} s"]
        if r["records"]:
            out += ["", *ratio_table(r["records"])]
        shown = r["stderr"] if r["records"] else r["stdout"] + r["stderr"]
        if shown.strip():
            out += ["", "```text", _tail(shown), "```"]
    return "\n".join(out) + "\n"


def write_report(run: dict, folder: Path) -> tuple[Path, Path]:
    """Write ``<date>-<device slug>.md`` and ``.json`` into ``folder`` (a number is added
    when a report of that day and device exists); returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{run['date']}-{slug(run['device']['device'])}"
    name, n = stem, 1
    while (folder / f"{name}.md").exists() or (folder / f"{name}.json").exists():
        n += 1
        name = f"{stem}-{n}"
    markdown, raw = folder / f"{name}.md", folder / f"{name}.json"
    raw.write_text(json.dumps(run, indent=1) + "\n")
    markdown.write_text(render_markdown(run))
    return markdown, raw


# ----------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default=None, help="the letters of the steps to run (a,b,…)")
    parser.add_argument("--quick", action="store_true", help="a shorter version of every step")
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for the whole check (default {DEFAULT_BUDGET_S}, at most {LIMIT_S})",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "gpu", help="report folder (docs/gpu)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 0 < args.budget <= LIMIT_S:
        print(f"error: --budget must be in (0, {LIMIT_S}] seconds, got {args.budget}")
        return 2
    try:
        steps = select(plan(args.quick), args.steps)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    if args.dry_run:
        total = 0
        for step in steps:
            total += step.budget_s
            print(f"[{step.key}] {step.budget_s:>4} s  {step.title}: {step.command}")
        print(f"planned {total} s of at most {args.budget:.0f} s (the limit is {LIMIT_S} s)")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} sees none; nothing run, nothing written")
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-train-") as train_out:
        steps = select(plan(args.quick, train_out), args.steps)
        results = run_plan(
            steps, args.budget, lambda step, timeout: run_step(step, timeout, env, ROOT)
        )
    run = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "scripts/gpu_check.py", *(argv or sys.argv[1:])]),
        "budget_s": args.budget,
        "wall_s": time.monotonic() - started,
        "device": device_info(),
        "steps": [asdict(r) for r in results],
    }
    markdown, raw = write_report(run, args.out)
    print(f"wrote {markdown} and {raw}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
