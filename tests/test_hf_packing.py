"""Hugging Face's padding-free formats on ``DiffAttnForCausalLM``: ``DataCollatorWithFlattening``
rows (restarting ``position_ids``, and with ``return_flash_attn_kwargs=True`` the ``cu_seq_lens``
arguments) compute what the same documents compute padded and masked, in forward and in HF's
``Trainer``."""

from __future__ import annotations

import pytest
import torch

from extras import require_extra

pytestmark = require_extra("hf")

from transformers import DataCollatorWithFlattening

from diffattn.hf import DiffAttnConfig, DiffAttnForCausalLM
from helpers import ATTENTIONS, TINY_VOCAB, tiny_config

LENGTHS = (5, 1, 12, 7)
TOL = dict(rtol=1e-5, atol=1e-5)


def hf_model(attention: str) -> DiffAttnForCausalLM:
    torch.manual_seed(0)
    return DiffAttnForCausalLM(DiffAttnConfig.from_model_config(tiny_config(attention))).eval()


def features(lengths=LENGTHS, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(2, TINY_VOCAB, (n,), generator=generator).tolist()}
        for n in lengths
    ]


def padded(batch: list[dict]) -> dict:
    """The same documents right-padded, masked, labels -100 on padding."""
    n = max(len(f["input_ids"]) for f in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(batch):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def per_document_logits(model, batch: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits[batch["attention_mask"].bool()]


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_flattened_rows_compute_what_padded_documents_compute(attention, flash_kwargs):
    model = hf_model(attention)
    batch = features()
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_tensors="pt")(
        batch
    )
    assert ("cu_seq_lens_q" in flat) == flash_kwargs
    with torch.no_grad():
        flat_out = model(**flat)
        pad = padded(batch)
        expected = per_document_logits(model, pad)
        torch.testing.assert_close(flat_out.logits[0], expected, **TOL)
        torch.testing.assert_close(flat_out.loss, model(**pad).loss, **TOL)


def test_flash_kwargs_that_do_not_describe_the_row_are_refused():
    model = hf_model("diff_v1")
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(
        features()
    )
    bad = dict(flat, cu_seq_lens_q=flat["cu_seq_lens_q"][:-1])
    with pytest.raises(ValueError, match="cu_seq_lens_q must run from 0 to the row's 25 tokens"):
        model(**bad)
    with pytest.raises(ValueError, match="max_length_q=3 is not the longest document"):
        model(**dict(flat, max_length_q=3))
    two_rows = dict(flat, input_ids=flat["input_ids"].expand(2, -1))
    two_rows.pop("labels"), two_rows.pop("position_ids")
    with pytest.raises(ValueError, match="one row of packed documents"):
        model(**two_rows)


class RecordingTrainer:
    """HF's ``Trainer`` whose ``compute_loss`` keeps each step's loss (unrounded)."""

    @staticmethod
    def run(model, collator, dataset, steps: int) -> list[float]:
        from transformers import Trainer, TrainingArguments

        losses: list[float] = []

        class Recording(Trainer):
            def compute_loss(self, model, inputs, *args, **kwargs):
                loss = super().compute_loss(model, inputs, *args, **kwargs)
                value = loss[0] if isinstance(loss, tuple) else loss
                losses.append(value.item())
                return loss

        args = TrainingArguments(
            output_dir="unused",
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            dataloader_num_workers=0,
            seed=0,
            remove_unused_columns=False,
        )
        Recording(model=model, args=args, train_dataset=dataset, data_collator=collator).train()
        return losses


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_trainer_with_the_flattening_collator_trains_as_padded(attention, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dataset = features((5, 1, 12, 7, 9, 3, 14, 2, 6, 8, 4, 10), seed=3)

    def pad_collate(batch):
        return padded(batch)

    flat = RecordingTrainer.run(
        hf_model(attention).train(), DataCollatorWithFlattening(return_tensors="pt"), dataset, 3
    )
    pad = RecordingTrainer.run(hf_model(attention).train(), pad_collate, dataset, 3)
    assert len(flat) == len(pad) == 3
    torch.testing.assert_close(torch.tensor(flat), torch.tensor(pad), rtol=1e-5, atol=1e-5)


def test_a_flattened_row_returns_no_cache_in_eval_mode():
    """HF's eval-mode forward would start a cache; a packed row must not fill one (the next
    token would attend to every document)."""
    model = hf_model("diff_v2")
    flat = DataCollatorWithFlattening(return_tensors="pt")(features())
    with torch.no_grad():
        out = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"])
    assert out.past_key_values is None


@pytest.mark.parametrize("fa_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_left_padded_bf16_batch_matches_its_padding_free_row(
    attention, implementation, fa_kwargs, tmp_path
):
    """The conditions of transformers' generic ``test_{eager,sdpa}_padding_matches_padding_free
    _with_position_ids`` check: a saved model reloaded in bf16 with ``attn_implementation``, a
    left-padded batch (padding holds the pad token) against its real tokens flattened into one
    row with restarting positions (and ``cu_seq_lens``), logits within bf16's epsilon."""
    hf_model(attention).save_pretrained(tmp_path)
    model = DiffAttnForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation=implementation
    ).eval()
    lengths = [9, 4, 13]
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, -n:] = 1
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(2, TINY_VOCAB, mask.shape, generator=generator)
    ids[mask == 0] = model.config.pad_token_id or 0
    flat = {
        "input_ids": ids[mask.bool()][None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
    }
    if fa_kwargs:
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        flat.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13, max_length_k=13)
    with torch.no_grad():
        padded_logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        flat_logits = model(**flat, use_cache=False).logits
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(padded_logits[mask.bool()], flat_logits[0], rtol=eps, atol=eps)
