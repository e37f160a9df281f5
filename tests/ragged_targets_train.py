"""``python tests/ragged_targets_train.py ARGS``: ``python -m diffattn.train ARGS`` on rows that
hold different numbers of loss targets.

A test helper, not part of the library. Each row the trainer (and its validation) hands to the
model is right-padded and has some labels ignored, both decided by the row's own tokens, so any
split of a batch into micro batches or ranks gives every row the same targets:

* padding: the last ``row[0] % 9`` positions (``attention_mask`` 0, label ``-100``);
* ignored labels: every other position whose token is a multiple of 7 (label ``-100``).

With ``document_masking`` the documents come on top, as the trainer computes them.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def ragged_inputs(chunk: torch.Tensor, eos_id: int | None) -> dict[str, torch.Tensor]:
    """The trainer's model inputs for ``chunk``, with padding and ignored labels added."""
    from diffattn.data import documents_after_eos

    n = chunk.shape[1]
    padding = (chunk[:, :1] % 9).expand_as(chunk)
    positions = torch.arange(n, device=chunk.device).expand_as(chunk)
    padded = positions >= n - padding
    ignored = (chunk % 7 == 0) & (positions % 2 == 1)
    labels = chunk.masked_fill(padded | ignored, IGNORE_INDEX)
    inputs = {"labels": labels, "attention_mask": (~padded).long()}
    if eos_id is not None:
        inputs["document_ids"] = documents_after_eos(chunk, eos_id)
    return inputs


def install() -> None:
    """Make the trainer and its validation use :func:`ragged_inputs`."""
    from diffattn.train import evaluation, trainer

    trainer.model_inputs = ragged_inputs
    evaluation.model_inputs = ragged_inputs


if __name__ == "__main__":
    from diffattn.train.cli import main
    from diffattn.train.distributed import exit_process

    install()
    exit_process(main())
