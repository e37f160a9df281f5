"""``diffattn train --quiet``: torch's warnings about what the run does on purpose (FSDP2's
random initialisation of shards that are overwritten, DCP in one process) are left out, and
nothing else is."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from extras import require_extra

pytestmark = require_extra("train")

from diffattn.train.cli import QUIET_WARNINGS, quiet_warnings
from train_helpers import subprocess_env, tiny_recipe, write_recipe

TORCH_WARNINGS = [
    "DTensor random operators may not have complete support on cpu device mesh",
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    "save in a single process.",
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    "load in a single process.",
    "torch.distributed is unavailable or uninitialized, assuming the intent is to load in a "
    "single process.",
]
"""The messages as torch 2.13 words them."""
OTHERS = [
    "DTensor operators may be slow",
    "torch.distributed is disabled",
    "the trainer's own warning: DTensor random operators may not have complete support",
]


def _shown(quiet: bool, messages: list[str]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_warnings(quiet):
            for message in messages:
                warnings.warn(message, UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_quiet_leaves_out_exactly_torchs_warnings_of_what_is_meant():
    assert len(QUIET_WARNINGS) == 2
    assert _shown(True, TORCH_WARNINGS) == []
    assert _shown(False, TORCH_WARNINGS) == TORCH_WARNINGS
    assert _shown(True, OTHERS) == OTHERS


def test_quiet_warnings_are_scoped_to_the_block():
    before = list(warnings.filters)
    with quiet_warnings(True):
        assert len(warnings.filters) == len(before) + len(QUIET_WARNINGS)
    assert warnings.filters == before


@pytest.mark.usefixtures("one_thread")
def test_a_quiet_one_process_sharded_run_prints_nothing(tmp_path, data_cache):
    """Asynchronous sharded saves in one process: DCP warns on every save without --quiet."""
    recipe = tiny_recipe(
        data_cache, steps=2, checkpoint_every=1, checkpoint_format="sharded",
        async_checkpoint=True,
    )  # fmt: skip
    path = write_recipe(tmp_path / "r.yaml", recipe)

    def train(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "diffattn", "train", str(path), *flags]
        return subprocess.run(
            command, capture_output=True, text=True, env=subprocess_env(), timeout=300
        )

    quiet = train("--out", str(tmp_path / "quiet"), "--quiet")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert (quiet.stdout, quiet.stderr) == ("", "")
    loud = train("--out", str(tmp_path / "loud"))
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "assuming the intent is to save in a single process" in loud.stderr
