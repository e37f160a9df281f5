"""The output-directory rule: a non-empty ``--out`` of another run is refused (one line, exit
code 2, nothing touched) unless ``--resume`` continues this run or ``--overwrite`` replaces it
as a whole; an ``--out`` that is a file is one clear error."""

from __future__ import annotations

import argparse

import pytest

from diffattn.cli import main
from diffattn.fileio import CheckpointError, check_output_directory, clear_output_directory
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import tiny_recipe, train_cli, write_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


def _one_error_line(err: str, *words: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _snapshot(directory):
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ----------------------------------------------------------------------------------------
# the helper
def test_check_output_directory_applies_one_rule(tmp_path):
    assert check_output_directory(tmp_path / "absent") is False
    (tmp_path / "empty").mkdir()
    assert check_output_directory(tmp_path / "empty") is False
    full = tmp_path / "full"
    full.mkdir()
    (full / "metrics.jsonl").write_text("old\n")
    with pytest.raises(CheckpointError, match="not empty; choose another"):
        check_output_directory(full, option="--out", hint="choose another")
    assert check_output_directory(full, own=True) is False  # this run's own directory
    assert check_output_directory(full, overwrite=True) is True  # to be replaced
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"^--out .*file: exists and is not a directory"):
        check_output_directory(tmp_path / "file", overwrite=True, option="--out")


def test_clear_output_directory_leaves_nothing_of_the_old_contents(tmp_path):
    out = tmp_path / "out"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    (out / "config.yaml").write_text("old")
    clear_output_directory(out)
    assert out.is_dir() and not any(out.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no hidden leftovers


# ----------------------------------------------------------------------------------------
# diffattn train
@pytest.fixture
def recipe(tmp_path, data_cache):
    return str(write_recipe(tmp_path / "r.yaml", tiny_recipe(data_cache, steps=2)))


def test_train_refuses_a_leftover_tokenizer_and_overwrite_replaces_it(recipe, tmp_path, capsys):
    clean = tmp_path / "clean"
    assert train_cli(recipe, "--out", str(clean)) == 0
    out = tmp_path / "reused"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "tokenizer.json").write_text('{"an": "earlier run"}')
    before = _snapshot(out)
    capsys.readouterr()

    assert train_cli(recipe, "--out", str(out)) == 2
    _one_error_line(capsys.readouterr().err, "diffattn train: error:", str(out), "--overwrite")
    assert _snapshot(out) == before  # nothing written, nothing overwritten

    assert train_cli(recipe, "--out", str(out), "--overwrite") == 0
    step = out / "checkpoints" / "step-00000002"
    fresh = clean / "checkpoints" / "step-00000002"
    assert (step / "tokenizer.json").read_bytes() == (fresh / "tokenizer.json").read_bytes()
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (
        clean / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_train_does_not_overwrite_same_named_files_of_another_run(recipe, tmp_path, capsys):
    out = tmp_path / "other"
    out.mkdir()
    (out / "config.yaml").write_text("steps: 999\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = _snapshot(out)
    assert train_cli(recipe, "--out", str(out)) == 2
    _one_error_line(capsys.readouterr().err, "not empty")
    assert _snapshot(out) == before


def test_train_out_that_is_a_file_is_one_clear_error(recipe, tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("keep me")
    for extra in ([], ["--overwrite"]):
        assert train_cli(recipe, "--out", str(target), *extra) == 2
        _one_error_line(capsys.readouterr().err, str(target), "not a directory")
    assert target.read_text() == "keep me"


def test_train_checkpoints_need_resume_or_overwrite(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_cli(recipe, "--out", str(out)) == 0
    capsys.readouterr()
    assert train_cli(recipe, "--out", str(out)) == 2
    _one_error_line(capsys.readouterr().err, "already holds checkpoints", "--overwrite")
    assert train_cli(recipe, "--out", str(out), "--resume", "--overwrite") == 2
    _one_error_line(capsys.readouterr().err, "exclude each other")
    (out / "stray.txt").write_text("from before")
    assert train_cli(recipe, "--out", str(out), "--overwrite") == 0
    assert not (out / "stray.txt").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "final",
        "latest",
        "step-00000002",
    ]


def test_train_restarts_its_own_run_that_saved_no_checkpoint(recipe, tmp_path):
    """A run stopped before its first checkpoint (config.yaml is this recipe) starts again
    cleanly; ``diffattn compare`` re-runs rely on it."""
    out = tmp_path / "run"
    assert train_cli(recipe, "--out", str(out)) == 0
    import shutil

    shutil.rmtree(out / "checkpoints")
    (out / "tokenizer" / "stale.txt").write_text("left by the stopped start")
    assert train_cli(recipe, "--out", str(out)) == 0
    assert not (out / "tokenizer" / "stale.txt").exists()
    assert (out / "checkpoints" / "step-00000002").is_dir()


# ----------------------------------------------------------------------------------------
# the other commands that write a directory
def test_compare_out_file_and_foreign_directory_are_one_line(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("x")
    assert main(["compare", "--out", str(target), "--quiet"]) == 2
    _one_error_line(capsys.readouterr().err, "not a directory")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "report.md").write_text("someone else's")
    assert main(["compare", "--out", str(foreign), "--quiet"]) == 2
    _one_error_line(capsys.readouterr().err, "--overwrite")
    assert (foreign / "report.md").read_text() == "someone else's"


def test_convert_out_file_or_foreign_directory_is_one_line(tmp_path, capsys, tiny_baseline):
    from diffattn.checkpoint import save_model

    src = save_model(tiny_baseline, tmp_path / "src")
    target = tmp_path / "a-file"
    target.write_text("x")
    assert main(["convert", str(src), str(target), "--to", "hf-llama"]) == 2
    _one_error_line(capsys.readouterr().err, "not a directory")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    assert main(["convert", str(src), str(foreign), "--to", "hf-llama"]) == 2
    _one_error_line(capsys.readouterr().err, "not empty", "--overwrite")
    assert (foreign / "config.json").read_text() == "{}"


def _dex(argv):
    from diffattn.commands import dex

    parser = argparse.ArgumentParser()
    dex.add_arguments(parser)
    return dex.run(parser.parse_args(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "no-such-model", "--out", "{out}", "--quiet"],
        ["compare", "no-such-model", "--out", "{out}", "--quiet"],
        ["merge", "no-such-adapter", "no-such-model", "--out", "{out}"],
    ],
    ids=["train", "compare", "merge"],
)
def test_dex_out_file_or_foreign_directory_is_one_clear_error(argv, tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("{}\n")
    for out, words in ((target, ("not a directory",)), (foreign, ("not empty", "--overwrite"))):
        args = [a.replace("{out}", str(out)) for a in argv]
        with pytest.raises(ValueError) as info:  # diffattn.cli prints it as one line, exit 2
            _dex(args)
        for word in (str(out), *words):
            assert word in str(info.value)
        assert "\n" not in str(info.value)
    assert target.read_text() == "x"
    assert (foreign / "metrics.jsonl").read_text() == "{}\n"


def test_dex_train_resume_and_overwrite_exclude_each_other(tmp_path):
    with pytest.raises(ValueError, match="exclude each other"):
        _dex(["train", "m", "--out", str(tmp_path), "--resume", "--overwrite"])
