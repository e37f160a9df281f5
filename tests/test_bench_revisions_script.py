"""scripts/bench_revisions.py: two source trees compared bit for bit (logits and gradients) and
by ``diffattn bench``; a change of one rounding in DIFF V1's λ is reported as a difference."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_revisions.py"
SPEC = importlib.util.spec_from_file_location("bench_revisions", SCRIPT)
bench_revisions = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench_revisions)


def _copy_of_the_source(root):
    shutil.copytree(REPO / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


@pytest.mark.slow
def test_equal_trees_are_equal_and_one_ulp_in_lambda_is_not(tmp_path):
    same = _copy_of_the_source(tmp_path / "same")
    changed = _copy_of_the_source(tmp_path / "changed")
    diff_v1 = changed / "src" / "diffattn" / "attention" / "diff_v1.py"
    text = diff_v1.read_text()
    before = "return torch.exp(dot1) - torch.exp(dot2) + module.lambda_init"
    assert before in text
    diff_v1.write_text(text.replace(before, f"{before} + 1e-7"))
    done = _run(str(REPO), str(same), "--equal", "--no-bench")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("equal: logits and every gradient of 15 model/backend cases")
    done = _run(str(REPO), str(changed), "--equal", "--no-bench")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stdout.startswith("NOT EQUAL:"), done.stdout
    cases = done.stdout.split(" in ", 1)[1].strip().split(", ")
    differential = ("diff_v1-gqa", "diff_v1-no-head-norm")  # the types that read Eq.2's λ
    assert cases == [f"{m}/{b}" for m in differential for b in ("auto", "reference", "sdpa")]


@pytest.mark.slow
def test_the_bench_rounds_alternate_and_print_a_row_per_model_and_mode(tmp_path):
    bench = ["--mode", "fwd", "--steps", "1", "--warmup", "0", "--seq-len", "32"]
    bench += ["--d-model", "128", "--layers", "1", "--batch", "1"]
    done = _run(str(REPO), str(REPO), "--rounds", "2", "--", *bench)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split(":")[1].strip() for line in done.stderr.splitlines()] == [
        f"old ({REPO})",
        f"new ({REPO})",
        f"new ({REPO})",
        f"old ({REPO})",
    ]
    rows = [line.split()[:2] for line in done.stdout.splitlines()[1:]]
    assert rows == [["baseline", "fwd"], ["diff_v1", "fwd"], ["diff_v2", "fwd"]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["a", "b", "--rounds", "0"], "--rounds must be at least 1"),
        (["a", "b", "--no-bench"], "--no-bench leaves nothing to do"),
    ],
)
def test_bad_arguments_are_one_error(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        bench_revisions.parse_args(argv)
    assert error.value.code == 2 and message in capsys.readouterr().err


def test_a_revision_that_does_not_exist_is_one_error(tmp_path):
    with pytest.raises(SystemExit, match="neither a directory nor a git revision"):
        bench_revisions.source_tree("no-such-revision-xyz", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="without src/diffattn"):
        bench_revisions.source_tree(str(tmp_path / "empty"), None)
