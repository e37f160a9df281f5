"""The ``diffattn`` command line."""

from __future__ import annotations

import subprocess
import sys

from diffattn.cli import main


def test_presets_verb_prints_counts(capsys):
    assert main(["presets", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "2,523,776" in out


def test_unknown_preset_is_one_clear_error(capsys):
    assert main(["presets", "7B"]) == 2
    assert "unknown preset '7B'" in capsys.readouterr().err


def test_bench_bad_option_exits_2(capsys):
    assert main(["bench", "--seq-len", "0"]) == 2
    assert "--seq-len" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "diffattn", "--version"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and result.stdout.startswith("diffattn ")
