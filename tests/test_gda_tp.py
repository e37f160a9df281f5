"""GDA under tensor parallelism (CPU, gloo, torchrun on 127.0.0.1): two ranks, one KV group
each, equal one process (``gda_tp_worker.py``); the plan splits whole KV groups."""

from __future__ import annotations

import json

import pytest

from diffattn import ModelConfig
from diffattn.train.tensor_parallel import kv_groups, tp_problem
from extras import require_extra

pytestmark = [require_extra("train"), pytest.mark.usefixtures("one_thread")]

from train_helpers import REPO, torchrun_target

TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("backends", ["reference", "sdpa,fused"])
def test_tp2_equals_one_process(backends):
    script = str(REPO / "tests" / "gda_tp_worker.py")
    result = torchrun_target([script, "gda", backends], 2, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(backends.split(","))
    for row in rows:
        assert row["missing_grads"] == [] and row["sharded"] > 0, row
        for key in ("loss_diff", "logit_diff", "grad_diff", "cache_diff"):
            assert row[key] <= TOLERANCE, row


def test_tp_splits_whole_kv_groups():
    config = ModelConfig(
        attention="gda", attention_options={"gda": {"ratio": 3}}, n_heads=16, n_kv_heads=4
    )
    assert kv_groups(config) == 2
    assert tp_problem(config, 2) is None
    assert "KV groups" in tp_problem(config, 4)
