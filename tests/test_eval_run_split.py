"""``diffattn eval`` on a trained checkpoint reads the run's own held-out split: a flag that would
score training documents as held out is refused, ``--split all`` says so explicitly, and the
report says where each data setting came from."""

from __future__ import annotations

import json

import pytest

from diffattn import cli
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import short_documents_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

FRACTION = 0.001
"""The issue's recipe: ``--set data.valid_fraction=0.001`` (every paper recipe uses it)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_cache):
    """A 2-step run holding out 0.1% of 3,000 short documents; its last checkpoint."""
    from diffattn.train import TrainConfig, train

    root = tmp_path_factory.mktemp("run")
    recipe = short_documents_recipe(
        root, data_cache, steps=2, data={"valid_fraction": FRACTION, "seed": 3}
    )
    train(TrainConfig.from_dict(recipe), root / "run")
    return root / "run" / "checkpoints" / "step-00000002", root / "docs.jsonl"


def held_out(docs_path, fraction, seed) -> int:
    from diffattn.data import is_validation_document, iter_documents

    return sum(
        is_validation_document(d, seed=seed, valid_fraction=fraction)
        for d in iter_documents([str(docs_path)])
    )


def eval_loss(model, out, *flags) -> int:
    return cli.main(
        ["eval", "loss", str(model), "--out", str(out), "--max-tokens", "2000", "--quiet", *flags]
    )


def test_eval_scores_the_runs_held_out_documents(checkpoint, tmp_path):
    model, docs = checkpoint
    assert eval_loss(model, tmp_path / "out") == 0
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["settings"]["valid_fraction"] == FRACTION
    assert record["settings"]["data_seed"] == 3
    assert record["settings"]["data"] == [str(docs)]
    assert record["settings"]["seq_len"] == 32  # the run's window
    assert record["results"]["documents"] == held_out(docs, FRACTION, 3)
    assert record["results"]["documents"] < held_out(docs, 0.02, 0)  # not the old defaults
    recipe = str(model / "train_config.yaml")
    for key in ("data", "valid_fraction", "data_seed", "seq_len"):
        assert record["data_from"][key]["from"] == f"the run's recipe ({recipe})"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| valid_fraction | 0.001 | the run's recipe" in report


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--valid-fraction", "0.02"],
            "--valid-fraction 0.02 contradicts the run of {model}, which held out documents by "
            "valid_fraction 0.001",
        ),
        (["--data-seed", "0"], "--data-seed 0 contradicts the run of {model}"),
        (["--data", "stdlib"], "--data stdlib contradicts the run of {model}"),
    ],
)
def test_a_flag_that_would_leak_training_documents_is_one_line(
    checkpoint, tmp_path, capsys, flags, message
):
    model, _ = checkpoint
    assert eval_loss(model, tmp_path / "out", *flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message.format(model=model) in err
    assert "pass --split all to evaluate every document" in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_split_all_and_matching_or_window_flags_are_taken(checkpoint, tmp_path):
    model, _ = checkpoint
    assert eval_loss(model, tmp_path / "a", "--split", "all", "--valid-fraction", "0.02") == 0
    record = json.loads((tmp_path / "a" / "results.json").read_text())
    assert record["data_from"]["valid_fraction"]["from"] == "--valid-fraction"
    assert (
        eval_loss(model, tmp_path / "b", "--valid-fraction", str(FRACTION), "--seq-len", "16") == 0
    )
    record = json.loads((tmp_path / "b" / "results.json").read_text())
    assert record["settings"]["seq_len"] == 16
    assert record["data_from"]["seq_len"]["from"] == "--seq-len"


def test_a_model_without_a_recipe_keeps_the_evaluations_defaults(checkpoint, tmp_path):
    import shutil

    model, _ = checkpoint
    saved = tmp_path / "saved"
    shutil.copytree(model, saved)
    (saved / "train_config.yaml").unlink()
    assert eval_loss(saved, tmp_path / "out", "--data", str(checkpoint[1]), "--seq-len", "32") == 0
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["settings"]["valid_fraction"] == 0.02
    assert record["data_from"]["valid_fraction"]["from"] == (
        "the evaluation's default (no training recipe with the model)"
    )


def test_models_from_runs_with_different_splits_need_a_flag(checkpoint, tmp_path, capsys):
    import shutil

    import yaml

    model, _ = checkpoint
    other = tmp_path / "other"
    shutil.copytree(model, other)
    recipe = yaml.safe_load((other / "train_config.yaml").read_text())
    recipe["data"]["valid_fraction"] = 0.3
    (other / "train_config.yaml").write_text(yaml.safe_dump(recipe))
    code = cli.main(
        ["eval", "loss", str(model), "--compare", str(other), "--out", str(tmp_path / "o")]
    )
    assert code == 2
    assert "the models' runs held out documents by different valid_fraction" in (
        capsys.readouterr().err
    )


def test_a_training_run_stands_for_its_newest_checkpoint(checkpoint, tmp_path, capsys):
    """``RUN`` and ``RUN@STEP`` as MODEL: eval (with the run's split), generate and the loader."""
    from diffattn.loading import resolve_source, training_run_checkpoint

    model, _ = checkpoint
    run = model.parent.parent
    assert training_run_checkpoint(run) == model
    assert training_run_checkpoint(f"{run}@2") == model
    assert resolve_source(run).kind == "diffattn" and resolve_source(run).path == model
    with pytest.raises(ValueError, match=r"has no complete checkpoint of step 7 \(its steps: 2\)"):
        training_run_checkpoint(f"{run}@7")
    assert eval_loss(run, tmp_path / "out") == 0
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["settings"]["valid_fraction"] == FRACTION  # the run's split, through RUN
    capsys.readouterr()
    assert (
        cli.main(["generate", f"{run}@2", "--prompt", "alpha beta", "--max-new-tokens", "3"]) == 0
    )
    assert capsys.readouterr().out.startswith("alpha beta")


def test_the_python_loader_takes_a_run_as_model_does(checkpoint):
    """``diffattn.load_model`` reads ``RUN`` and ``RUN@STEP`` as the command line does."""
    import torch

    import diffattn
    from diffattn.checkpoint import load_model as load_directory

    model, _ = checkpoint
    run = model.parent.parent
    expected = load_directory(model).state_dict()
    for spec in (run, str(run), f"{run}@2"):
        loaded = diffattn.load_model(spec).state_dict()
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[name], expected[name]) for name in expected)
    with pytest.raises(ValueError, match=r"has no complete checkpoint of step 7 \(its steps: 2\)"):
        diffattn.load_model(f"{run}@7")


def test_a_run_without_checkpoints_is_one_clear_error(tmp_path):
    from diffattn.loading import training_run_checkpoint

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="a training run with no complete checkpoint"):
        training_run_checkpoint(tmp_path / "run")


def test_documents_are_cut_as_the_run_cut_them(tmp_path, data_cache):
    """A run that split its text files into paragraphs held out paragraphs: eval reads
    paragraphs too (not whole files, most of whose paragraphs the run trained on)."""
    import random

    from diffattn.data import is_validation_document, iter_documents
    from diffattn.train import TrainConfig, train
    from train_helpers import tiny_recipe

    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "kappa", "sigma"]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        paragraphs = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(10)]
        (corpus / f"f{i}.txt").write_text("\n\n".join(paragraphs) + "\n")
    data = {"sources": [str(corpus)], "document_split": "paragraph", "valid_fraction": 0.05}
    recipe = tiny_recipe(data_cache, steps=1, data={**data, "max_bytes": None})
    train(TrainConfig.from_dict(recipe), tmp_path / "run")
    assert eval_loss(tmp_path / "run", tmp_path / "out", "--max-tokens", "500") == 0
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    paragraphs = list(iter_documents([str(corpus)], split="paragraph"))
    held = sum(is_validation_document(p, seed=0, valid_fraction=0.05) for p in paragraphs)
    assert record["results"]["documents"] == held
    assert "split=paragraph" in record["data_from"]["documents"]["value"]
