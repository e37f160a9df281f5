"""``train_dex`` pinned where ``test_dex_train`` leaves room: the order of its checks and their
exact messages, what it says on stderr, ``dex_run.json`` and ``summary.json``, and a resumed run
taking T and λ_init from the saved settings."""

from __future__ import annotations

import json

import pytest

from extras import require_extra

pytestmark = require_extra("train", "hf")

from dex_run_setup import tiny_llama_run
from diffattn.dex import train as dex_train
from diffattn.dex.train import DexTrainOptions, train_dex


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_llama_run(tmp_path_factory.mktemp("dex_train_pins"))


@pytest.fixture(scope="module")
def run(setup):
    import contextlib
    import io

    out = setup["root"] / "run"
    options = DexTrainOptions(
        model=setup["model"], out=str(out), heads="entropy", steps=2, lambda_init="0.5",
        overrides=setup["sets"], progress=True,
    )  # fmt: skip
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        result = train_dex(options)
    return out, result, said.getvalue()


def test_what_it_says_and_writes(setup, run):
    out, result, said = run
    table = result.heads.format_table()
    assert f"{table}\nheld-out loss before Dex: {result.loss_before:.4f}\n" in said
    assert said.count("held-out loss before Dex") == 1
    assert json.loads((out / "dex_run.json").read_text()) == {
        "model": setup["model"],
        "heads": "entropy",
        "anneal_steps": 1,
        "lambda_init": 0.5,
        "steps": 2,
        "overrides": setup["sets"],
    }
    assert (out / "dex_run.json").read_text().endswith("\n}\n")
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == [
        "model", "loss_before", "loss_after", "step", "elapsed_s", "wall_s", "parameters",
        "trainable_parameters", "heads", "anneal_steps", "lambda_init", "lambdas",
    ]  # fmt: skip
    assert summary["model"] == setup["model"] and summary["step"] == 2 == result.step
    assert (summary["loss_before"], summary["loss_after"]) == (
        result.loss_before,
        result.loss_after,
    )
    assert summary["elapsed_s"] == result.elapsed_s and summary["wall_s"] > 0
    assert summary["parameters"] == result.parameters
    assert summary["trainable_parameters"] == result.trainable_parameters
    assert summary["heads"] == result.heads.to_dict()
    assert json.loads((out / "heads.json").read_text()) == result.heads.to_dict()
    assert (summary["anneal_steps"], summary["lambda_init"]) == (1, 0.5)
    assert [tuple(x) for x in summary["lambdas"]] == [(step, lam) for step, lam in result.lambdas]
    assert [s for s, _ in result.lambdas] == [1, 2]
    assert result.adapter == out / "adapter" and result.out == out
    assert result.checkpoint is not None and result.model is not None


def test_resume_takes_the_saved_settings(setup, run):
    out, first, _ = run
    options = DexTrainOptions(
        model=setup["model"], out=str(out), heads="all", steps=2, lambda_init="exp",
        anneal_steps=7, overrides=setup["sets"], resume=True, progress=False,
    )  # fmt: skip
    again = train_dex(options)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["anneal_steps"], summary["lambda_init"]) == (1, 0.5)
    assert again.heads.to_dict() == first.heads.to_dict() and again.step == 2
    assert json.loads((out / "dex_run.json").read_text())["heads"] == "entropy"


def test_checks_and_their_order(setup, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("loaded a model before refusing the input")

    monkeypatch.setattr(dex_train, "resolve_source", fail)

    def refused(**changes):
        options = dict(model=setup["model"], out=str(tmp_path / "r"), steps=4, progress=False)
        with pytest.raises(ValueError) as caught:
            train_dex(DexTrainOptions(**{**options, **changes}))
        return str(caught.value)

    assert refused(resume=True, overwrite=True) == "--resume and --overwrite exclude each other"
    (tmp_path / "file").write_text("x")
    assert refused(out=str(tmp_path / "file"), resume=True) == (
        f"--out {tmp_path / 'file'}: exists and is not a directory"
    )
    assert refused(out=str(tmp_path), resume=True) == (
        f"--resume: {tmp_path} holds no dex_run.json; not a dex train run"
    )
    assert "--overwrite" in refused(out=str(tmp_path))
    for bad in (-1, True, 2.5):
        assert refused(anneal_steps=bad) == (
            f"--anneal-steps must be a non-negative integer, got {bad!r}"
        )
    assert refused(lambda_init="big") == "--lambda-init must be 'exp' or a number, got 'big'"
    assert not (tmp_path / "r").exists()
