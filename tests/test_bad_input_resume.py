"""A corrupt newest checkpoint on ``--resume``: refused with the file named, or, with
``--resume-fallback``, the run continues from the newest valid checkpoint and says so."""

from __future__ import annotations

import os

import pytest

from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import read_losses, tiny_recipe, train_cli, write_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


def _truncate(path):
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


@pytest.fixture
def corrupted_run(tmp_path, data_cache):
    recipe = write_recipe(
        tmp_path / "r.yaml", tiny_recipe(data_cache, steps=4, checkpoint_every=2, keep_last=None)
    )
    out = tmp_path / "run"
    assert train_cli(str(recipe), "--out", str(out)) == 0
    losses = read_losses(out)
    newest = out / "checkpoints" / "step-00000004" / "model.safetensors"
    _truncate(newest)
    return str(recipe), out, losses, newest


def test_resume_refuses_a_truncated_newest_checkpoint_naming_it(corrupted_run, capsys):
    recipe, out, _, newest = corrupted_run
    capsys.readouterr()
    before = newest.stat().st_size
    assert train_cli(recipe, "--out", str(out), "--resume", "--steps", "6") == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(newest) in lines[0] and "--resume-fallback" in lines[0]
    assert newest.stat().st_size == before


def test_resume_fallback_continues_from_the_newest_valid_checkpoint(corrupted_run, capsys):
    recipe, out, losses, newest = corrupted_run
    capsys.readouterr()
    assert train_cli(recipe, "--out", str(out), "--resume-fallback") == 0
    err = capsys.readouterr().err
    assert f"skipped step-00000004: {newest}" in err and "truncated" in err
    assert f"resuming from {out / 'checkpoints' / 'step-00000002'}" in err
    resumed = read_losses(out)
    assert sorted(resumed) == [1, 2, 3, 4]  # steps 3-4 trained again, each logged once
    for step in (3, 4):
        assert resumed[step] == pytest.approx(losses[step], abs=1e-6)
    # the corrupt checkpoint was replaced by a complete one
    older = out / "checkpoints" / "step-00000002" / newest.name
    assert newest.stat().st_size == older.stat().st_size


def test_resume_fallback_with_no_valid_checkpoint_names_each(corrupted_run, capsys):
    recipe, out, _, _ = corrupted_run
    older = out / "checkpoints" / "step-00000002" / "trainer_state.pt"
    _truncate(older)
    capsys.readouterr()
    assert train_cli(recipe, "--out", str(out), "--resume-fallback") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "no valid checkpoint" in err and "step-00000004" in err and os.fspath(older) in err
