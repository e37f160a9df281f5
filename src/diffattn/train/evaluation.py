"""Validation: the mean held-out loss (and per-token losses) of a model over fixed batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from diffattn.model import labels_within_documents
from diffattn.probe import eval_mode, token_nll
from diffattn.train import distributed
from diffattn.train.precision import autocast
from diffattn.train.targets import target_count


# ----------------------------------------------------------------------------------------
# evaluation
@dataclass
class Evaluation:
    """The result of :func:`evaluate` / :meth:`Trainer.evaluate`."""

    loss: float
    """Mean next-token loss over every target of every rank's validation rows."""
    token_losses: torch.Tensor | None = None
    """With ``return_token_losses``: this rank's next-token losses, ``(rows, seq_len - 1)``
    float32 on CPU (row i, column j: −log p(token j+1 | tokens ≤ j))."""


def model_inputs(chunk: torch.Tensor, eos_id: int | None) -> dict[str, torch.Tensor]:
    """``labels`` (the chunk itself), and ``document_ids`` split at each EOS when ``eos_id`` is
    given (``TrainConfig.document_masking``)."""
    if eos_id is None:
        return {"labels": chunk}
    from diffattn.data import documents_after_eos

    return {"labels": chunk, "document_ids": documents_after_eos(chunk, eos_id)}


def inputs_on(
    device: torch.device, chunk: torch.Tensor, inputs: dict[str, torch.Tensor], targets: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``chunk`` and its model ``inputs`` (made on the host, where their targets were counted)
    on ``device``, each tensor copied once (the labels that are the chunk itself are its copy);
    without ``targets`` the labels are left out (a mean over no target is undefined)."""
    moved = chunk.to(device, non_blocking=True)
    on_device = {
        name: moved if value is chunk else value.to(device, non_blocking=True)
        for name, value in inputs.items()
        if targets or name != "labels"
    }
    return moved, on_device


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    micro_batch_size: int,
    device: torch.device,
    dtype: str = "auto",
    return_token_losses: bool = False,
    eos_id: int | None = None,
) -> Evaluation:
    """Mean validation loss of ``model`` over every rank's rows of ``batches`` (each rank holds
    the same number of rows, run in chunks of ``micro_batch_size``), as the trainer measures.
    With ``eos_id`` the windows are masked by document, as ``document_masking`` trains.

    The mean is over every target of every rank: the model's own ``.loss`` of each chunk
    weighted by its number of targets (:func:`~diffattn.train.targets.target_count`; with
    document masking rows hold different numbers), so it does not depend on
    ``micro_batch_size`` or the number of ranks. With ``return_token_losses`` the
    per-token losses are computed from ``.logits`` of the same forward passes.

    Raises:
        ValueError: ``batches`` is empty (the held-out split is too small).
    """
    if not batches:
        raise ValueError(
            "the held-out split is too small for one evaluation batch; use more text "
            "(data.sources) or lower eval_batch_size"
        )
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    token_losses = []
    with eval_mode(model):
        for batch in batches:
            for chunk in batch.split(micro_batch_size):
                inputs = model_inputs(chunk, eos_id)
                count = target_count(inputs)  # on the host: no device sync
                chunk, inputs = inputs_on(device, chunk, inputs, count)
                with autocast(device, dtype):
                    output = model(chunk, **inputs)
                if count:
                    totals[0] += output.loss.double() * count
                    totals[1] += count
                if return_token_losses:
                    targets = chunk
                    if "document_ids" in inputs:  # no target across a boundary, as the loss
                        targets = labels_within_documents(chunk, inputs["document_ids"])
                    token_losses.append(token_nll(output.logits, targets).cpu())
    distributed.all_reduce_sum(totals)
    losses = torch.cat(token_losses) if return_token_losses else None
    if not totals[1]:
        raise ValueError("the validation windows hold no loss target (only one-token documents)")
    return Evaluation(float(totals[0] / totals[1]), losses)
