"""scripts/gpu_check.py on the CPU: the no-CUDA exit, the plan and its budgets, a step runner
that records failures and timeouts and goes on, and the report of a recorded run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def test_without_cuda_it_says_so_and_writes_nothing(gpu_check, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "gpu")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("no CUDA device: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("quick", [False, True])
def test_dry_run_lists_every_step_within_the_eight_minutes(gpu_check, quick, capsys):
    assert gpu_check.main(["--dry-run", *(["--quick"] if quick else [])]) == 0
    out = capsys.readouterr().out
    for letter in "abcde":
        assert f"[{letter}" in out
    steps = gpu_check.plan(quick)
    # most valuable first, in the documented order
    assert [s.letter for s in steps] == sorted(s.letter for s in steps)
    total = sum(s.budget_s for s in steps)
    assert total <= gpu_check.DEFAULT_BUDGET_S <= gpu_check.LIMIT_S == 8 * 60
    assert f"planned {total} s" in out
    commands = [s.argv for s in steps]
    assert all(argv[0] in ("-m", "scripts/profile_models.py") for argv in commands)
    assert "diffattn" not in [argv[0] for argv in commands]  # never the console script
    bench = [s for s in steps if s.letter == "c"]
    assert all("--json" in s.argv for s in bench) and any("--compile" in s.argv for s in bench)
    if not quick:
        assert any("128" in s.argv for s in bench)


def test_steps_selects_by_letter_and_refuses_unknown_ones(gpu_check, capsys):
    assert gpu_check.main(["--dry-run", "--steps", "a,e"]) == 0
    out = capsys.readouterr().out
    assert "[a]" in out and "[e]" in out and "[c1]" not in out
    assert gpu_check.main(["--dry-run", "--steps", "a,z"]) == 2
    assert "--steps" in capsys.readouterr().out
    assert gpu_check.main(["--dry-run", "--budget", "600"]) == 2


def _python(gpu_check, key, code, budget):
    return gpu_check.Step(key, f"fake {key}", ["-c", code], budget)


def test_a_failing_or_hanging_step_is_recorded_and_the_next_one_runs(gpu_check, tmp_path):
    steps = [
        _python(gpu_check, "a", "import time; time.sleep(30)", 1),
        _python(gpu_check, "b", "import sys; print('half'); sys.exit(3)", 20),
        _python(gpu_check, "c", "import time; time.sleep(3); print('[{\"attention\": 1}]')", 20),
        _python(gpu_check, "d", "print('never')", 20),
    ]
    steps[2] = gpu_check.Step("c", "fake c", steps[2].argv, 20, json_stdout=True)

    def runner(step, timeout):
        return gpu_check.run_step(step, timeout, {}, tmp_path)

    results = gpu_check.run_plan(steps, budget_s=gpu_check.MIN_STEP_S + 3, runner=runner)
    assert [r.status for r in results] == ["timeout", "failed", "ok", "skipped"]
    assert results[0].wall_s < 10 and "stopped after 1 s" in results[0].note
    assert results[1].returncode == 3 and results[1].stdout == "half\n"
    assert results[2].records == [{"attention": 1}]  # parsed from its stdout
    assert results[3].returncode is None


def _recorded_run(gpu_check):
    record = {
        "attention": "diff_v1",
        "seq_len": 4096,
        "head_dim": 64,
        "compiled": True,
        "tokens_per_s": 123456.7,
        "paired_ratio_to_baseline": 0.912,
        "flop_bound": 1.0,
        "mem_ratio_to_baseline": 1.04,
        "mfu": 0.41,
        "ratio_reference": "baseline",
    }
    steps = [
        gpu_check.StepResult("a", "CUDA tests", "python -m pytest -m gpu", 100, "ok", 42.0, 0,
                             "12 passed\n"),
        gpu_check.StepResult("c3", "fwd+bwd compiled", "python -m diffattn bench --compile", 80,
                             "timeout", 80.0, -9, "", "warmup 1/2\n", [record],
                             "stopped after 80 s"),
        gpu_check.StepResult("e", "training", "python -m diffattn train", 35, "skipped",
                             note="3 s of the budget left"),
    ]  # fmt: skip
    device = {
        "device": "NVIDIA H200",
        "capability": "9.0",
        "memory": "139.8 GiB",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "python": "3.12.3",
        "triton": "3.6.0",
        "transformers": "5.17.0",
    }
    return {
        "date": "2026-11-26",
        "command": "python scripts/gpu_check.py",
        "budget_s": 450,
        "wall_s": 125.0,
        "device": device,
        "steps": [gpu_check.asdict(s) for s in steps],
    }


def test_the_report_of_a_recorded_run(gpu_check, tmp_path):
    run = _recorded_run(gpu_check)
    markdown, raw = gpu_check.write_report(run, tmp_path)
    assert (
        markdown.name == "2026-11-26-nvidia-h200.md" and raw.name == "2026-11-26-nvidia-h200.json"
    )
    assert json.loads(raw.read_text()) == run
    text = markdown.read_text()
    assert text.startswith("# GPU check, 2026-11-26: NVIDIA H200\n")
    assert "compute capability 9.0, 139.8 GiB" in text
    assert "torch 2.11.0+cu130 (CUDA 13.0), triton 3.6.0, transformers 5.17.0" in text
    assert "| a | CUDA tests | ok | 42.0 s | 100 s |" in text
    assert "| c3 | fwd+bwd compiled | timeout (stopped after 80 s) | 80.0 s | 80 s |" in text
    assert "| e | training | skipped (3 s of the budget left) | 0.0 s | 35 s |" in text
    assert (
        "| diff_v1 | 4096 | 64 | True | 123,456.7 | 0.912 | 1.000 | 1.040 | 0.410 | baseline |"
        in (text)
    )
    assert "`python -m diffattn bench --compile`" in text and "12 passed" in text
    again, _ = gpu_check.write_report(run, tmp_path)  # a second run that day
    assert again.name == "2026-11-26-nvidia-h200-2.md"
