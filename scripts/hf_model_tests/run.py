"""Run Hugging Face's generic model tests against DiffAttnForCausalLM (all three attention types).

Usage:
    python scripts/hf_model_tests/run.py PATH [--with-diffllama] [--junit FILE] [-- PYTEST ARGS]

PATH is a transformers test tree: a checkout of the transformers repository at the tag of the
installed release (its root or its ``tests/`` folder), or an unpacked sdist. The script builds a
scratch directory (``--work``, default a temporary one) that links the tree's files, writes a
test module instantiating HF's ``ModelTesterMixin`` and ``GenerationTesterMixin`` for the
baseline, DIFF V1 and DIFF V2, and runs pytest on it (and, with ``--with-diffllama``, on
transformers' own DiffLlama tests in the same run). Nothing is copied into this repository.

A tree without ``tests/generation/`` (the sdist ships only the top-level test files) runs the
``ModelTesterMixin`` tests alone: the generation mixin is then an empty placeholder, which the
summary line says. The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLACEHOLDERS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
}


def find_tests(path: Path) -> Path:
    for candidate in (path / "tests", path):
        if (candidate / "test_modeling_common.py").is_file():
            return candidate
    raise SystemExit(f"error: {path}: no test_modeling_common.py in it or in its tests/ folder")


def link_tree(source: Path, target: Path) -> list[str]:
    """``target/tests`` mirrors ``source`` by symlinks; missing mixin modules get placeholders.
    Returns the placeholders written."""
    tests = target / "tests"
    tests.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name not in ("models", "generation", "exporters", "__init__.py"):
            (tests / entry.name).symlink_to(entry)
    (tests / "__init__.py").write_text("")
    written = []
    for folder in ("generation", "exporters"):
        (tests / folder).mkdir()
        (tests / folder / "__init__.py").write_text("")
        if (source / folder).is_dir():
            for entry in (source / folder).iterdir():
                if entry.name != "__init__.py":
                    (tests / folder / entry.name).symlink_to(entry)
    for relative, text in PLACEHOLDERS.items():
        if not (tests / relative).exists():
            (tests / relative).write_text(text)
            written.append(relative)
    models = tests / "models"
    models.mkdir()
    (models / "__init__.py").write_text("")
    if (source / "models" / "diffllama").is_dir():
        (models / "diffllama").symlink_to(source / "models" / "diffllama")
    ours = models / "diffattn"
    ours.mkdir()
    (ours / "__init__.py").write_text("")
    (ours / "test_modeling_diffattn.py").write_text(
        (HERE / "test_modeling_diffattn.py.in").read_text()
    )
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path, help="transformers checkout or unpacked sdist")
    parser.add_argument("--with-diffllama", action="store_true", help="also run DiffLlama's tests")
    parser.add_argument("--work", type=Path, help="scratch directory (must not exist)")
    parser.add_argument("--junit", type=Path, help="write pytest's JUnit XML here")
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    source = find_tests(args.path.resolve())
    if args.work is not None and args.work.exists():
        raise SystemExit(f"error: {args.work} exists; give a new scratch directory")
    work = args.work or Path(tempfile.mkdtemp(prefix="diffattn-hf-tests-"))
    placeholders = link_tree(source, work)
    targets = ["tests/models/diffattn/test_modeling_diffattn.py"]
    if args.with_diffllama:
        if not (source / "models" / "diffllama").is_dir():
            raise SystemExit(f"error: {source} has no models/diffllama (an sdist); use a checkout")
        targets.append("tests/models/diffllama/test_modeling_diffllama.py")
    if placeholders:
        print(f"note: {source} lacks {', '.join(placeholders)}: those mixins' tests are not run")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", *targets]
    if args.junit is not None:
        command.append(f"--junitxml={args.junit.resolve()}")
    command += pytest_args
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])
    )
    print(f"running in {work}: {' '.join(command)}", flush=True)
    return subprocess.call(command, cwd=work, env=env)


if __name__ == "__main__":
    sys.exit(main())
