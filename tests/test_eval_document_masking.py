"""``diffattn eval`` on a run trained with ``document_masking`` masks its windows by document
as the run trained (a new document after every EOS, here the EOS text inside documents), and
the report says which masking each model got; a run trained without it is evaluated as before."""

from __future__ import annotations

import json
import random

import pytest
import torch

from diffattn import cli
from diffattn.data.tokenizers import EOS_TOKEN
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import tiny_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "def", "return"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Two 1-step runs, with and without document masking, on documents that hold the EOS
    text (each such document is several documents to the trainer); their checkpoints."""
    from diffattn.train import TrainConfig, train

    root = tmp_path_factory.mktemp("masked")
    rng = random.Random(0)
    path = root / "docs.jsonl"
    with path.open("w") as f:
        for _ in range(2000):
            parts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(3)]
            f.write(json.dumps({"text": f" {EOS_TOKEN} ".join(parts)}) + "\n")
    made = {}
    for masking in (True, False):
        recipe = tiny_recipe(
            data_cache,
            steps=1,
            document_masking=masking,
            data={"sources": [str(path)], "max_bytes": None, "valid_fraction": 0.05},
        )
        out = root / f"masking-{masking}"
        train(TrainConfig.from_dict(recipe), out)
        made[masking] = out / "checkpoints" / "step-00000001"
    return made


def _eval_loss(model, out, monkeypatch):
    from helpers import record_documents

    seen = record_documents(monkeypatch)
    code = cli.main(
        ["eval", "loss", str(model), "--out", str(out), "--max-tokens", "3000", "--quiet"]
    )
    assert code == 0
    return seen, json.loads((out / "results.json").read_text())


def test_a_run_trained_with_document_masking_is_evaluated_within_documents(
    runs, tmp_path, monkeypatch
):
    from diffattn.data import documents_after_eos

    seen, record = _eval_loss(runs[True], tmp_path / "masked", monkeypatch)
    boundaries = 0
    for ids, documents in seen:
        assert documents is not None
        assert torch.equal(documents, documents_after_eos(ids, 0))
        boundaries += int((documents[:, 1:] != documents[:, :-1]).sum())
    assert boundaries > 0  # the windows do hold several documents
    entry = record["data_from"]["document_masking"]
    assert entry["value"] == "within documents"
    assert entry["from"] == f"the run's recipe ({runs[True] / 'train_config.yaml'})"
    report = (tmp_path / "masked" / "report.md").read_text()
    assert "| document_masking | within documents | the run's recipe" in report


def test_a_run_trained_without_it_attends_across_documents_as_it_trained(
    runs, tmp_path, monkeypatch
):
    seen, record = _eval_loss(runs[False], tmp_path / "plain", monkeypatch)
    assert seen and all(documents is None for _, documents in seen)
    assert record["data_from"]["document_masking"]["value"] == "across documents"


def test_models_of_both_kinds_get_each_their_own_masking(runs, tmp_path, monkeypatch):
    from diffattn.eval.common import load_models

    masked, plain = load_models([str(runs[True]), str(runs[False])])
    assert masked.document_eos == 0 and plain.document_eos is None
    ids = torch.tensor([[5, 6, 0, 7, 8]])
    mask = torch.ones_like(ids)
    assert masked.window_inputs(ids, mask)["document_ids"].tolist() == [[0, 0, 0, 1, 1]]
    assert "document_ids" not in plain.window_inputs(ids, mask)
