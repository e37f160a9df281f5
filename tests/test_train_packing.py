"""Training with document masking (``document_masking: true``): each window attends only within
its documents (split after every EOS), training and validation alike, and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from diffattn.data import documents_after_eos
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import read_losses, short_documents_recipe, train_cli, write_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

EOS_ID = 0
"""The EOS of the tiny recipe's BPE (``<eos>``, its first special token)."""


def test_documents_begin_after_each_eos():
    batch = torch.tensor([[5, 0, 7, 8, 0, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    assert documents_after_eos(batch, eos_id=0).tolist() == [
        [0, 0, 1, 1, 1, 2, 3],
        [0, 0, 0, 0, 0, 0, 0],
    ]


def test_the_trainer_hands_the_documents_to_the_model(tmp_path, data_cache, monkeypatch):
    from diffattn.train import TrainConfig, train
    from helpers import record_documents

    seen = record_documents(monkeypatch)
    recipe = short_documents_recipe(
        tmp_path, data_cache, steps=2, eval_every=2, document_masking=True
    )
    train(TrainConfig.from_dict(recipe), tmp_path / "run")
    assert len(seen) >= 4 + 2  # 2 steps × 2 micro batches, then validation
    boundaries = 0
    for ids, documents in seen:
        assert torch.equal(documents, documents_after_eos(ids, EOS_ID))
        boundaries += int((documents[:, 1:] != documents[:, :-1]).sum())
    assert boundaries > 0  # the windows seen do cross documents


def test_resume_with_document_masking_repeats_the_losses(tmp_path, data_cache):
    recipe = write_recipe(
        tmp_path / "tiny.yaml",
        short_documents_recipe(tmp_path, data_cache, steps=6, document_masking=True),
    )
    a, b = tmp_path / "A", tmp_path / "B"
    assert train_cli(str(recipe), "--steps", "6", "--out", str(a)) == 0
    assert train_cli(str(recipe), "--steps", "3", "--out", str(b)) == 0
    assert train_cli(str(recipe), "--steps", "6", "--out", str(b), "--resume") == 0
    full, resumed = read_losses(a), read_losses(b)
    assert sorted(resumed) == list(range(1, 7))
    assert max(abs(full[s] - resumed[s]) for s in range(4, 7)) <= 1e-6


@pytest.mark.extra("hf")
def test_document_masking_is_refused_for_a_model_that_takes_no_documents(tmp_path, data_cache):
    """A Hugging Face model's forward swallows unknown keywords: it would train across
    documents while the recipe says otherwise."""
    from diffattn.train import ConfigError, TrainConfig, train
    from helpers import tiny_hf

    recipe = short_documents_recipe(tmp_path, data_cache, steps=1, document_masking=True)
    with pytest.raises(ConfigError, match="document_masking: the model_factory model"):
        train(
            TrainConfig.from_dict(recipe),
            tmp_path / "run",
            progress=False,
            model_factory=lambda: tiny_hf("llama", vocab_size=512),
        )
