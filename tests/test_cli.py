"""The ``diffattn`` command line."""

from __future__ import annotations

import subprocess
import sys

from diffattn.cli import main


def test_presets_verb_prints_counts(capsys):
    assert main(["presets", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "2,523,776" in out
    # DIFF V2 matched: 384 − (8·16 + 8)/3 = 338.67 hidden units -> 320, the nearest multiple
    # of 64; (320 − 338.67)·3·128·2 = −14,336 parameters, −0.568% of 2,523,776.
    row = out.splitlines()[1].split()
    assert row[-3:] == ["2,509,440", "320", "-0.568%"]


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
