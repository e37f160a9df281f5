"""A :class:`~diffattn.DiffTransformerLM` forward with its sequence split over a
context-parallel (CP) group (:mod:`diffattn.attention.context_parallel`: the load-balanced
layout and the exact attention across the split).

Every rank of the group is given the same whole rows (token ids are small) and keeps its own
two chunks of them. What crosses chunk boundaries is computed on the whole row first, so each
rank's slice is exactly the slice of the one-process computation:

* RoPE positions are global: ``0 … N−1``, restarting per packed document
  (:func:`~diffattn.model.positions_in_documents`), counting real tokens under padding;
* documents are the whole row's runs (:func:`~diffattn.model.document_runs`), so a query reads
  keys of its own document on any rank;
* the next-token targets are shifted on the whole row (the target of a chunk's last token is
  the first label of the next chunk, held by another rank) and the target crossing a document
  boundary is dropped (:func:`~diffattn.model.labels_within_documents`).

The loss is the mean over every target of the whole rows: each rank sums the cross-entropy of
its own targets and divides by the global target count. The returned ``loss`` has that global
mean as its value (one all-reduce of a scalar) and, as its gradient, this rank's share only, so
``loss.backward()`` leaves each rank the part of every parameter's gradient that flows through
its tokens (the K/V gather's backward already returns each rank dK/dV from every rank's queries);
the sum of those parts over the CP ranks is the one-process gradient. A bare model sums them
with :func:`reduce_context_parallel_gradients`; under DDP or FSDP2 over every rank (the
trainer, ``cp: N``), which average gradients, :func:`context_parallel_backward` scales each
rank's part by the CP degree, so that their average over a CP group is that sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from diffattn.attention.context_parallel import (
    ChunkLayout,
    SequenceSplit,
    context_parallel,
    context_parallel_problem,
    layout_problem,
)
from diffattn.model import (
    IGNORE_INDEX,
    document_runs,
    labels_within_documents,
    position_ids_from_mask,
    positions_in_documents,
)


@dataclass
class ContextParallelOutput:
    """What :func:`context_parallel_forward` returns.

    Attributes:
        logits: this rank's logits ``(B, 2c, vocab)``, its chunks in local order.
        loss: the mean next-token loss over every target of the whole rows (value), with this
            rank's share as gradient; ``None`` without labels or without a target.
        target_count: the targets of the whole rows (the loss's denominator).
        split: the :class:`SequenceSplit` the forward ran under: install it again
            (:func:`~diffattn.attention.context_parallel.context_parallel`) around
            ``backward`` when the model checkpoints activations (recomputed layers gather).
    """

    logits: torch.Tensor
    loss: torch.Tensor | None
    target_count: int
    split: SequenceSplit

    @property
    def layout(self) -> ChunkLayout:
        """This rank's :class:`ChunkLayout`."""
        return self.split.layout


def model_problem(config, degree: int) -> str | None:
    """Why a model of ``config`` cannot run split over ``degree`` ranks: the first layer whose
    attention type declares it cannot (:attr:`context_parallel_reason`), or ``None``."""
    if degree == 1:
        return None
    for index in range(config.n_layers):
        declaration = config.type_of_layer(index)
        why = context_parallel_problem(declaration)
        if why is not None:
            return f"attention type {declaration.name!r} cannot split the sequence: {why}"
    return None


def recipe_problem(recipe, config) -> str | None:
    """Why a training recipe (a :class:`~diffattn.train.config.TrainConfig`: ``cp``,
    ``parallel``, ``seq_len``, ``document_masking``) cannot split its rows over ``cp`` ranks
    with a model of ``config``, or ``None`` (``tp`` combines: its own check asks for ``fsdp``)."""
    cp = recipe.cp
    if cp == 1:
        return None
    if recipe.parallel not in ("ddp", "fsdp"):
        return (
            f"{cp} combines with parallel: ddp or fsdp (the ranks of a context-parallel group "
            f"hold the same rows, and their gradients are reduced together), not with "
            f"{recipe.parallel}"
        )
    why = layout_problem(recipe.seq_len, cp) or model_problem(config, cp)
    if why is not None:
        return why
    if config.backend == "flash" and recipe.document_masking:
        return (
            "backend 'flash' takes packed documents only without a query offset, which every "
            "chunk after a row's first has under context parallelism; use backend auto or sdpa"
        )
    return None


def _whole_row_inputs(input_ids, labels, document_ids, attention_mask):
    """``(positions, runs or None, padding or None, targets or None)`` of whole rows."""
    bsz, n = input_ids.shape
    runs = None
    if document_ids is not None:
        runs = document_runs(document_ids.to(input_ids.device))
        if bool((runs == 0).all()):
            runs = None
    padding = None if attention_mask is None else attention_mask.to(input_ids.device).bool()
    if runs is not None:
        positions = positions_in_documents(runs, padding)
    elif padding is not None:
        positions = position_ids_from_mask(padding)
    else:
        positions = torch.arange(n, device=input_ids.device).expand(bsz, n)
    if padding is not None and bool(padding.all()):
        padding = None
    targets = None
    if labels is not None:  # shifted on the whole row: a chunk's last target is on another rank
        kept = labels if runs is None else labels_within_documents(labels, runs)
        targets = F.pad(kept[:, 1:], (0, 1), value=IGNORE_INDEX)
    return positions, runs, padding, targets


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision logits (as :func:`~diffattn.model.next_token_loss`), else
    their own dtype (float64 stays float64)."""
    return torch.promote_types(logits.dtype, torch.float32)


def context_parallel_forward(
    model,
    input_ids: torch.Tensor,
    group,
    labels: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> ContextParallelOutput:
    """Run ``model`` on this rank's chunks of the whole rows ``input_ids`` ``(B, N)`` (the same
    on every rank of ``group``), attention exact across the split; ``labels``,
    ``document_ids`` and a 2-D ``attention_mask`` (1 = real token) as the model takes them.

    Refuses (``ValueError``, one line) a length that does not cut into ``2·C`` equal chunks, one
    over ``max_seq_len``, and a model with a type that cannot split. With activation
    checkpointing, run ``backward`` inside ``context_parallel(output.split)``.
    """
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    n = input_ids.shape[1]
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"context parallelism takes a 2-D attention_mask shaped as input_ids "
            f"{(*input_ids.shape,)} (1 = real token), got {(*attention_mask.shape,)}"
        )
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} are not shaped as input_ids {(*input_ids.shape,)}"
        )
    config = getattr(model, "module", model).config  # under DDP, the wrapped model's
    why = layout_problem(n, degree) or model_problem(config, degree)
    if why is not None:
        raise ValueError(why)
    if n > config.max_seq_len:
        raise ValueError(
            f"sequence length {n} exceeds max_seq_len={config.max_seq_len} of this model"
        )
    layout = ChunkLayout(n, degree, rank)
    positions, runs, padding, targets = _whole_row_inputs(
        input_ids, labels, document_ids, attention_mask
    )
    split = SequenceSplit(group, layout, document_ids=runs, key_padding=padding)
    local_ids = layout.shard(input_ids)
    with context_parallel(split):
        logits = model(
            local_ids,
            # the split carries the whole row's documents and padding; a local mask of ones
            # keeps the model from reading documents off the chunks' restarting positions
            attention_mask=torch.ones_like(local_ids),
            position_ids=layout.shard(positions),
        ).logits
    if targets is None:
        return ContextParallelOutput(logits, None, 0, split)
    count = int((targets != IGNORE_INDEX).sum())
    if count == 0:  # every label ignored: no loss (the trainer runs backward through logits)
        return ContextParallelOutput(logits, None, 0, split)
    local = (
        F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).to(_loss_dtype(logits)),
            layout.shard(targets).reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        / count
    )
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    loss = local + (total - local.detach())  # the global mean; the gradient of this rank's share
    return ContextParallelOutput(logits, loss, count, split)


def gather_logits(logits: torch.Tensor, layout: ChunkLayout, group) -> torch.Tensor:
    """The whole rows' logits ``(B, N, vocab)`` from every rank's ``(B, 2c, vocab)`` (no
    gradient), in global order."""
    parts = [torch.empty_like(logits) for _ in range(layout.degree)]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    return torch.cat(parts, dim=1).index_select(1, layout.global_order(logits.device))


def reduce_context_parallel_gradients(model, group) -> None:
    """Sum every parameter's gradient over the CP ranks (each holds the part that flows through
    its own tokens; module docstring). For a model not wrapped by DDP or FSDP over those ranks."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=group)


# --------------------------------------------------------------------------------------------
# the trainer's part
def context_parallel_group(degree: int, world: int, rank: int, stride: int = 1):
    """The CP group of ``rank``. Ranks are laid out ``(data-parallel, cp, tp)``, tp fastest
    (a tensor-parallel group is ``stride`` consecutive ranks, as
    :func:`~diffattn.train.tensor_parallel.device_meshes` makes them): the group holds the
    ranks of one data-parallel index and one tp index, ``stride`` apart (consecutive without
    tp). Collective: every rank creates every group, in the same order."""
    mine = None
    for first in range(0, world, degree * stride):
        for offset in range(stride):
            ranks = [first + offset + c * stride for c in range(degree)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


class SplitRows(nn.Module):
    """``model`` run split over ``group`` where it is called on whole rows: what validation
    calls (``evaluate``), which reads ``.loss``, the mean over the rows' targets. The logits
    are this rank's chunks only, so per-token losses (``return_token_losses``) are refused."""

    def __init__(self, model: nn.Module, group, return_token_losses: bool = False) -> None:
        super().__init__()
        if return_token_losses:
            raise ValueError(
                "per-token validation losses are not returned under context parallelism (each "
                "rank holds the logits of its own chunks); evaluate without cp"
            )
        self.model, self.group = model, group

    def forward(self, input_ids, labels=None, document_ids=None) -> ContextParallelOutput:
        return context_parallel_forward(
            self.model, input_ids, self.group, labels=labels, document_ids=document_ids
        )


def context_parallel_backward(loss: torch.Tensor, output: ContextParallelOutput, degree: int):
    """``loss.backward()`` for a model wrapped by DDP or FSDP2 over every rank (data- and
    context-parallel ones together), inside the forward's split (recomputed layers gather).

    Those wrappers average the ranks' gradients; a CP rank's gradient is only its tokens'
    share of its rows' gradient (module docstring), so the average over a group's ``degree``
    ranks is ``1/degree`` of that gradient: the backward runs on ``degree·loss`` (same value
    reported, gradient scaled by ``degree``)."""
    scaled = loss * degree - loss.detach() * (degree - 1)
    with context_parallel(output.split):
        scaled.backward()
