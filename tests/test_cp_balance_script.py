"""scripts/cp_balance.py: the load-balance counts and figure of docs/scaling.md."""

from __future__ import annotations

import importlib.util

from extras import require_extra

pytestmark = require_extra("train")

import pytest

from train_helpers import REPO

SPEC = importlib.util.spec_from_file_location("cp_balance", REPO / "scripts" / "cp_balance.py")
cp_balance = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(cp_balance)


@pytest.mark.parametrize("degree", [2, 3, 4, 8])
def test_two_chunks_a_rank_share_the_causal_pairs_evenly_and_slices_do_not(degree):
    n = 2 * degree * 64
    balanced = cp_balance.shares(n, degree, cp_balance.balanced_positions)
    assert balanced == pytest.approx([1 / degree] * degree, rel=1e-12)
    sliced = cp_balance.shares(n, degree, cp_balance.contiguous_positions)
    assert sum(sliced) == pytest.approx(1.0)
    # the last of CP contiguous slices reads (2 CP - 1) / CP of the mean (exactly as N grows)
    assert max(sliced) * degree == pytest.approx((2 * degree - 1) / degree, rel=2e-3)


def test_the_script_prints_the_table_and_draws_the_figure(tmp_path, capsys):
    png = tmp_path / "balance.png"
    assert cp_balance.main(["--seq-len", "1024", "--degrees", "2", "4", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| 4 | two chunks (diffattn) | 0.2500 0.2500 0.2500 0.2500 | 1.0000 |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
