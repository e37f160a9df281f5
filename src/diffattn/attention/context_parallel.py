"""Context parallelism: the sequence split over ranks, attention exact across the split.

Each rank of a context-parallel (CP) group of ``C`` ranks holds a slice of every row's
sequence; each of its queries must read every earlier key, on any rank. The layout balances
causal work (as in Megatron-LM's and torchtitan's load balancing): a row of ``N`` tokens is cut
into ``2C`` chunks of ``c = N / 2C`` tokens and rank ``r`` holds chunks ``r`` and ``2C − 1 − r``
(:class:`ChunkLayout`), so every rank's queries read ``(2C + 1)·c`` keys in all.

The exchange is an **all-gather of K and V** (the Llama 3 paper's context parallelism, §3.3.2):
each layer gathers the keys and values of every rank (:func:`gather_sequence`; its backward
sums dK/dV over the ranks and returns each rank its own slice) and computes, for each of its two
chunks, the ordinary exact attention rows of those queries over the keys ``[0, end of chunk)``
with the causal-with-offset rule of :class:`~diffattn.attention.mask.AttentionMask`
(``query_offset`` = the chunk's first position; packed documents and padding by their global
ids). The type's own ``attend`` runs unchanged on its backend (reference, sdpa, the fused CPU
kernel, ...), so DIFF V1's two softmax maps are each normalised over the whole visible
sequence by the kernel itself, with no merging of partial softmax statistics. Token-wise parts
(DIFF V2's λ = sigmoid(x W_λ), Gated DIFF's gate, the per-head norms) read only their own
token's ``x`` and need nothing. A ring with online-softmax merging would overlap the exchange
with compute and hold one peer's K/V at a time, but needs a merge rule per kernel and per map
(two for DIFF V1) and its own backward; the gather costs one collective per layer, and GQA keeps
K/V small (``2·H_kv·d`` a token against ``d_model`` for the layer's activations).

Measured on the CPU (gloo over loopback, one thread a rank; ``scripts/cp_memory.py
--exchange``, figures and command in ``docs/scaling.md``, "Context parallelism"): for a small
DIFF V1 layer (8 query and 2 KV half-heads of width 32) the gather's forward and backward take
1.4% (2 ranks) and 3.7% (4 ranks) of the layer's split attention at N = 8,192, and 0.5% and
1.4% at N = 16,384: attention grows as N², the gather as N.

A type says whether it splits (:attr:`~diffattn.attention.types.AttentionType.
context_parallel_reason`): ``None`` when its attention rows depend only on the query's own token
and the visible keys and values. DINT refuses: its integral term averages the first map's
*outputs over earlier query rows*, which live on other ranks and which gathered keys and values
do not determine.

Use: :func:`context_parallel` (a context manager) installs a :class:`SequenceSplit` that
:class:`~diffattn.attention.common.ProjectedAttention` consults; forward *and backward* run
inside it (activation checkpointing recomputes a layer, gather included, in backward). The
model-level forward (sharding inputs, global positions, the loss over all targets) is
:mod:`diffattn.train.context_parallel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diffattn.attention.mask import AttentionMask


def layout_problem(seq_len: int, degree: int) -> str | None:
    """Why a row of ``seq_len`` tokens cannot be cut into ``2·degree`` equal chunks, or ``None``."""
    if degree < 1:
        return f"the context-parallel degree must be a positive integer, got {degree}"
    chunks = 2 * degree
    if seq_len < chunks or seq_len % chunks:
        return (
            f"context parallelism over {degree} ranks cuts each row into {chunks} equal chunks "
            f"(two per rank, for causal load balance), so the sequence length must be a positive "
            f"multiple of {chunks}, got {seq_len}"
        )
    return None


@dataclass(frozen=True)
class ChunkLayout:
    """The load-balanced split of a row of ``seq_len`` tokens over ``degree`` ranks: ``2·degree``
    chunks of :attr:`chunk` tokens, rank ``r`` holding chunks ``r`` and ``2·degree − 1 − r``
    (in that order: its local sequence is the first chunk, then the second)."""

    seq_len: int
    degree: int
    rank: int

    def __post_init__(self) -> None:
        why = layout_problem(self.seq_len, self.degree)
        if why is not None:
            raise ValueError(why)
        if not 0 <= self.rank < self.degree:
            raise ValueError(f"rank {self.rank} is not in a group of {self.degree} ranks")

    @property
    def chunk(self) -> int:
        """Tokens per chunk, ``seq_len / (2·degree)``."""
        return self.seq_len // (2 * self.degree)

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank ``rank`` holds."""
        return rank, 2 * self.degree - 1 - rank

    @property
    def chunks(self) -> tuple[int, int]:
        """This rank's two chunk indices."""
        return self.chunks_of(self.rank)

    def positions_of(self, rank: int, device=None) -> torch.Tensor:
        """The global positions rank ``rank`` holds, in its local order, ``(2c,)`` int64."""
        c = self.chunk
        return torch.cat(
            [torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunks_of(rank)]
        )

    def positions(self, device=None) -> torch.Tensor:
        """The global positions this rank holds, in its local order."""
        return self.positions_of(self.rank, device)

    def global_order(self, device=None) -> torch.Tensor:
        """The index that puts the ranks' local slices, concatenated in rank order, into global
        order (``gathered.index_select(dim, order)``)."""
        held = torch.cat([self.positions_of(r, device) for r in range(self.degree)])
        return torch.argsort(held)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of ``t`` along ``dim`` (a ``(B, N, ...)`` tensor of the whole row)."""
        return t.index_select(dim, self.positions(t.device))


# torch 2.13 names them ``*_single`` and deprecates the older names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (the ranks' slices stacked); backward sums the gradient over the
    ranks and keeps this rank's slice (reduce-scatter where the backend has it, else an
    all-reduce and a slice: gloo)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        t = t.contiguous()
        out = t.new_empty((world * t.shape[0], *t.shape[1:]))
        _ALL_GATHER(out, t, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        size = grad.shape[0] // world
        if dist.get_backend(group) in ("nccl", "xccl"):
            mine = grad.new_empty((size, *grad.shape[1:]))
            _REDUCE_SCATTER(mine, grad, group=group)
            return mine, None
        summed = grad.clone()
        dist.all_reduce(summed, group=group)
        return summed[rank * size : (rank + 1) * size], None


@dataclass(frozen=True)
class SequenceSplit:
    """What a layer needs to attend across the split: the CP ``group``, the :class:`ChunkLayout`
    of this rank, and the whole row's ``document_ids`` (runs, ``(B, N)``) and ``key_padding``
    (``(B, N)`` bool, ``True`` = real token), each ``None`` when absent."""

    group: object
    layout: ChunkLayout
    document_ids: torch.Tensor | None = None
    key_padding: torch.Tensor | None = None

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """:func:`gather_sequence` over this split."""
        return gather_sequence(t, self.layout, self.group)

    def chunk_mask(self, chunk_index: int) -> AttentionMask:
        """The mask of chunk ``chunk_index``'s query rows over the keys ``[0, end)`` of its own
        end: causal with the chunk's first position as query offset, documents and padding by
        their global ids."""
        c = self.layout.chunk
        start, end = chunk_index * c, (chunk_index + 1) * c
        docs = None if self.document_ids is None else self.document_ids[:, :end]
        padding = None if self.key_padding is None else self.key_padding[:, :end]
        return AttentionMask(key_padding=padding, query_offset=start, document_ids=docs)

    def attend(self, module, x, q, k, v, need_weights: bool, cache=None):
        """``module.attend`` over this rank's queries: the gathered K and V, then each local
        chunk's exact rows (module docstring). ``x`` ``(B, 2c, D)``, ``q`` ``(B, Hq, 2c, d)``,
        ``k``/``v`` this rank's ``(B, Hkv, 2c, w)``; returns ``((B, H, 2c, w), None)``."""
        if need_weights:
            raise ValueError(
                "attention maps (output_attentions) are not returned under context "
                "parallelism: each rank holds only its own rows; run without it"
            )
        if cache is not None:
            raise ValueError("context parallelism runs whole sequences without a KV cache")
        keys, values = self.gather(k), self.gather(v)
        c, outs = self.layout.chunk, []
        for j, chunk_index in enumerate(self.layout.chunks):
            rows, end = slice(j * c, (j + 1) * c), (chunk_index + 1) * c
            out, _ = module.attend(
                x[:, rows],
                q[:, :, rows],
                keys[:, :, :end],
                values[:, :, :end],
                self.chunk_mask(chunk_index),
                False,
            )
            outs.append(out)
        return torch.cat(outs, dim=2), None


def gather_sequence(t: torch.Tensor, layout: ChunkLayout, group) -> torch.Tensor:
    """The whole sequence of ``t`` ``(B, H, 2c, w)`` (this rank's slice in local order) from
    every rank of ``group``, in global order, ``(B, H, N, w)``; differentiable (the gradient
    of each rank's slice is the sum over the ranks' gradients of it)."""
    local = t.movedim(2, 0)
    gathered = _GatherSequence.apply(local, group)
    ordered = gathered.index_select(0, layout.global_order(t.device))
    return ordered.movedim(0, 2)


_active: SequenceSplit | None = None
"""The installed split (a module global, which ``torch.compile`` reads as a guarded constant)."""


def active_split() -> SequenceSplit | None:
    """The :class:`SequenceSplit` installed by :func:`context_parallel`, or ``None``."""
    return _active


@contextlib.contextmanager
def context_parallel(split: SequenceSplit) -> Iterator[SequenceSplit]:
    """Run attention layers split over ``split``'s ranks inside the block. Backward needs it
    only where layers are recomputed (activation checkpointing gathers K/V again); the split
    installed before is restored on exit."""
    global _active
    before, _active = _active, split
    try:
        yield split
    finally:
        _active = before


def context_parallel_problem(attention_type) -> str | None:
    """Why layers of ``attention_type`` (a declaration) cannot run split over ranks, or
    ``None``: its declared :attr:`context_parallel_reason`."""
    return attention_type.context_parallel_reason
