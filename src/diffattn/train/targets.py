"""The loss of a global batch is the mean over all of its targets, however it is split.

A model's ``.loss`` is the mean next-token cross-entropy over the targets of the rows it was
given. Rows hold different numbers of targets as soon as some labels are ignored: a packed
window with document masking loses the target that would cross each document boundary
(:func:`~diffattn.model.labels_within_documents`), padding and ``-100`` labels count nothing.
A mean of per-micro-batch (and per-rank) means then weights a target by how few others share
its micro batch, so the loss and the gradient would change with ``micro_batch_size``, gradient
accumulation and the number of ranks.

The trainer instead weights each micro batch's mean loss by ``world · count / total``, where
``total`` is the count summed over every rank before the first forward (one small all-reduce;
tensor-parallel ranks hold the same rows, so it is the global count times the TP degree, as
is the sum of the ranks' losses). Summed over the micro batches and averaged over the
data-parallel ranks (DDP's all-reduce, FSDP2's reduce-scatter), that is the mean over all
targets of the global batch,
for the loss and for every gradient (the normalisation HF's ``Trainer`` applies with
``num_items_in_batch``). With every micro batch holding the same number of targets the weight
is exactly ``1 / accumulation``, the plain mean of means.
"""

from __future__ import annotations

import torch

from diffattn.model import IGNORE_INDEX


def target_count(inputs: dict[str, torch.Tensor]) -> int:
    """The number of next-token targets a causal LM's loss averages over, for the keyword
    arguments ``inputs`` of its forward: positions ``t`` of each ``(B, N)`` row whose next
    label ``labels[:, t + 1]`` is not ``-100`` (padding and ignored labels count nothing), less
    those whose next token starts another document of ``document_ids`` (the target a packed
    row never trains on, as :meth:`~diffattn.DiffTransformerLM.forward` masks it)."""
    labels, documents = inputs["labels"], inputs.get("document_ids")
    counted = labels[:, 1:] != IGNORE_INDEX
    if documents is not None:
        counted = counted & (documents[:, 1:] == documents[:, :-1])
    return int(counted.sum())


def weighted_loss(output, count: int, share: torch.Tensor) -> torch.Tensor:
    """A micro batch's contribution to the loss of the global batch: its mean loss divided by
    ``share`` (``total / (world · count)``, a 0-dim tensor, so that one division gives exactly
    the former ``loss / accumulation`` where the split is even).

    A micro batch with no target contributes nothing, but still runs backward through its
    logits (zero gradients), so that every rank takes part in the gradient reduction; the
    model's own mean over no target would be NaN."""
    if count:
        return output.loss / share
    logits = getattr(output, "logits", None)
    if logits is None:
        raise ValueError(
            "a micro batch has no loss target (every label is ignored) and the model returns "
            "no logits to run backward through"
        )
    return logits.float().sum() * 0.0
