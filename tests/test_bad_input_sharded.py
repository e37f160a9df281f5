"""Damaged sharded (DCP) checkpoints: a shard file missing or cut off, an unreadable or a
missing ``.metadata``. Resume, ``diffattn convert``, ``generate`` and ``eval`` name the file in
one line with exit code 2; ``--resume-fallback`` skips the damaged checkpoint to the newest
whole one and says so in one line; a run directory as MODEL passes over it.

One 2-process FSDP2 run (gloo, CPU) with sharded checkpoints at steps 2 and 4 is built per
module; each test damages the checkpoint of step 4 in a copy of it.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from diffattn.checkpoint import CheckpointError, check_sharded_files, load_model
from extras import require_extra

pytestmark = require_extra("train")

from diffattn.cli import main
from diffattn.train.checkpoint import check_checkpoint_files
from diffattn.train.sharded import consolidate
from train_helpers import fsdp_recipe, read_losses, torchrun, train_cli, write_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

ONE_PROCESS = ("--set", "parallel=none")  # a sharded checkpoint resumes in one process too


def _remove(path: Path) -> None:
    path.unlink()


def _truncate(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def _garbage(path: Path) -> None:
    path.write_bytes(b"garbage\n")


# damage: (the file of step 4's sharded/ it concerns, what is done to it)
DAMAGES = {
    "missing-shard": ("__1_0.distcp", _remove),
    "truncated-shard": ("__0_0.distcp", _truncate),
    "garbage-metadata": (".metadata", _garbage),
    "missing-metadata": (".metadata", _remove),
}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, data_cache):
    """The recipe and the directory of a finished 2-process FSDP2 run of 4 steps, sharded
    checkpoints at steps 2 and 4 (``final`` is step 4)."""
    root = tmp_path_factory.mktemp("damaged-sharded")
    path = write_recipe(root / "fsdp.yaml", fsdp_recipe(data_cache))
    result = torchrun([str(path), "--out", str(root / "run"), "--quiet"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return path, root / "run"


@pytest.fixture(params=sorted(DAMAGES))
def damaged(request, sharded_run, tmp_path):
    """``(recipe, run, file)``: a copy of the run whose step-4 checkpoint has ``file``
    damaged as the parameter says."""
    recipe, run = sharded_run
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    name, damage = DAMAGES[request.param]
    file = out / "checkpoints" / "step-00000004" / "sharded" / name
    damage(file)
    return str(recipe), out, file


def _one_line_naming(err: str, file: Path) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(file) in lines[0], err
    return lines[0]


def test_resume_names_the_damaged_file(damaged, capsys):
    recipe, out, file = damaged
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    assert train_cli(recipe, "--out", str(out), "--resume", *ONE_PROCESS) == 2
    line = _one_line_naming(capsys.readouterr().err, file)
    assert "--resume-fallback" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_resume_fallback_skips_the_damaged_checkpoint(damaged, sharded_run, capsys):
    recipe, out, file = damaged
    capsys.readouterr()
    assert train_cli(recipe, "--out", str(out), "--resume-fallback", *ONE_PROCESS) == 0
    line = _one_line_naming(capsys.readouterr().err, file)
    step2 = out / "checkpoints" / "step-00000002"
    assert "skipped step-00000004: " in line and line.endswith(f"resuming from {step2}")
    assert sorted(read_losses(out)) == [1, 2, 3, 4]  # steps 3-4 again, each logged once
    for step in (3, 4):
        assert read_losses(out)[step] == pytest.approx(read_losses(sharded_run[1])[step], abs=1e-5)
    check_checkpoint_files(out / "checkpoints" / "step-00000004")  # replaced by a whole one


def test_convert_names_the_damaged_file(damaged, capsys):
    _, out, file = damaged
    for source in (f"{out}@4", str(out / "checkpoints" / "step-00000004")):
        capsys.readouterr()
        assert main(["convert", source, str(out.parent / "model")]) == 2
        line = _one_line_naming(capsys.readouterr().err, file)
        assert "already a diffattn model directory" not in line
        assert not (out.parent / "model").exists()


def test_generate_names_the_damaged_file(damaged, capsys):
    _, out, file = damaged
    capsys.readouterr()
    assert main(["generate", f"{out}@4", "--prompt", "def", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    _one_line_naming(captured.err, file)
    assert captured.out == ""


def test_eval_names_the_damaged_file(damaged, capsys):
    _, out, file = damaged
    capsys.readouterr()
    assert main(["eval", "loss", f"{out}@4", "--out", str(out.parent / "eval")]) == 2
    _one_line_naming(capsys.readouterr().err, file)
    assert not (out.parent / "eval").exists()


def test_the_run_directory_passes_over_the_damaged_checkpoint(damaged, caplog, capsys):
    """``RUN`` stands for its newest complete checkpoint: ``final`` (step 4) is damaged, so
    it is step 2, with one note naming the damaged file."""
    _, out, file = damaged
    step2 = out / "checkpoints" / "step-00000002"
    with caplog.at_level(logging.WARNING, logger="diffattn.loading"):
        assert main(["convert", str(out), str(out.parent / "model")]) == 0
    notes = [r.getMessage() for r in caplog.records if r.name == "diffattn.loading"]
    assert len(notes) == 1 and str(file) in notes[0] and notes[0].endswith(f"using {step2}")
    expected = load_model(consolidate(step2, out.parent / "step2")).state_dict()
    for name, value in load_model(out.parent / "model").state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_garbled_shard_bytes_are_one_error_naming_the_shards(sharded_run, tmp_path, capsys):
    """A shard of full length whose bytes are garbled passes the file checks; reading it fails
    in DCP (with an error that is no ``Exception``), which is one line naming ``sharded/``."""
    _, run = sharded_run
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    shard = out / "checkpoints" / "step-00000004" / "sharded" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    check_checkpoint_files(shard.parent.parent)  # whole, as far as the files show
    capsys.readouterr()
    assert main(["convert", f"{out}@4", str(tmp_path / "model")]) == 2
    line = _one_line_naming(capsys.readouterr().err, shard.parent)
    assert "the shards do not load" in line
    assert not (tmp_path / "model").exists()


def test_garbled_shard_bytes_on_resume_are_one_line_from_the_torchrun_entry_point(
    sharded_run, tmp_path, capsys
):
    """``python -m diffattn.train`` (what torchrun runs) gives the same one line, exit 2."""
    from diffattn.train.cli import main as train_main

    recipe, run = sharded_run
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    shard = out / "checkpoints" / "step-00000004" / "sharded" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    capsys.readouterr()
    argv = [str(recipe), "--out", str(out), "--resume", "--quiet", *ONE_PROCESS]
    assert train_main([*argv, "--set", "steps=6"]) == 2
    line = _one_line_naming(capsys.readouterr().err, shard.parent)
    assert "the shards do not load" in line


class _RunsACommand:
    """Pickles as a call of ``os.system``: what a hostile ``.metadata`` could hold."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_metadata_that_would_run_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "sharded").mkdir()
    metadata = tmp_path / "sharded" / ".metadata"
    metadata.write_bytes(pickle.dumps(_RunsACommand(f"touch {marker}")))
    with pytest.raises(CheckpointError, match=r"not a readable DCP metadata file .*system"):
        check_sharded_files(tmp_path)
    assert not marker.exists()
