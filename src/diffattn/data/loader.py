"""Batches of token windows from a shard set: deterministic, resumable, rank-sliced.

The concatenated token stream of a :class:`~diffattn.data.shards.ShardSet` is cut into
``num_tokens // seq_len`` non-overlapping windows of ``seq_len`` tokens (the tail shorter than
a window is unused). A window is both input and label: the model predicts token t+1 from
tokens ≤ t inside it. Documents are separated by EOS and windows cross document boundaries.

Each epoch visits the windows in a permutation drawn from ``(seed, epoch)``, grouped into
global batches of ``batch_size`` windows (the ``num_windows % batch_size`` left over in an
epoch are skipped; the next permutation differs). Under data parallelism rank r of W takes
rows ``[r*b, (r+1)*b)`` of every global batch, ``b = batch_size // W``, so W ranks together see
exactly the batches one process sees.

Validation (:func:`eval_batches`) reads no permutation: a fixed set of windows spread evenly
over the whole stream (:func:`spread_windows`), so a held-out split that concatenates several
sources is measured in the mix's proportions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from diffattn.data.shards import ShardSet

STATE_FORMAT = "diffattn-batch-loader"
STATE_VERSION = 1

ShardsLike = ShardSet | str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def open_tokens(shards: ShardsLike | Any) -> Any:
    """``shards`` as a token stream: a :class:`ShardSet` or any object that reads like one
    (``num_tokens``, ``read(start, length)``, ``eos_id``, ``fingerprint``; e.g. the
    :class:`~diffattn.data.external.TokenStream` of Megatron-LM or datatrove token files) as
    it is, else :meth:`ShardSet.open` of a directory or a list of shard files."""
    if hasattr(shards, "read") and hasattr(shards, "num_tokens"):
        return shards
    return ShardSet.open(shards)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_ranks(batch_size: int, rank: object, world_size: object) -> int:
    world_size = _positive("world_size", world_size)
    if (
        isinstance(rank, bool)
        or not isinstance(rank, int | np.integer)
        or not 0 <= rank < world_size
    ):
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    if batch_size % world_size:
        raise ValueError(
            f"batch_size {batch_size} (the global batch) is not divisible by "
            f"world_size {world_size}"
        )
    return batch_size // world_size


def _windows(data: ShardSet, seq_len: int, what: str) -> int:
    count = data.num_tokens // seq_len
    if count == 0:
        raise ValueError(
            f"{what}: {data.num_tokens} tokens do not fill one window of seq_len={seq_len}"
        )
    return count


def _gather(data: ShardSet, windows: np.ndarray, seq_len: int) -> torch.Tensor:
    batch = np.empty((len(windows), seq_len), dtype=np.int64)
    for row, window in enumerate(windows.tolist()):
        batch[row] = data.read(window * seq_len, seq_len)
    return torch.from_numpy(batch)


class BatchLoader:
    """An endless iterator of ``torch.LongTensor`` batches of shape ``(batch_size // world_size,
    seq_len)``; epochs roll over automatically.

    ``state_dict()`` after n batches and ``load_state_dict`` on a fresh loader continue with
    batch n + 1 exactly. The state records the data's token count and fingerprint; loading a
    state taken on other data, or with another seed, batch size or sequence length, raises
    ``ValueError``. The world size may change between save and resume.
    """

    def __init__(
        self,
        shards: ShardsLike,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.batch_size = _positive("batch_size", batch_size)
        self.seq_len = _positive("seq_len", seq_len)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)
        self.local_batch_size = _check_ranks(self.batch_size, rank, world_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.data = open_tokens(shards)
        self.num_windows = _windows(self.data, self.seq_len, "BatchLoader")
        if self.num_windows < self.batch_size:
            raise ValueError(
                f"BatchLoader: {self.data.num_tokens} tokens make {self.num_windows} windows of "
                f"seq_len={self.seq_len}, fewer than one global batch of {self.batch_size} "
                f"({self.batch_size * self.seq_len} tokens)"
            )
        self.steps_per_epoch = self.num_windows // self.batch_size
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __len__(self) -> int:
        """Global batches per epoch."""
        return self.steps_per_epoch

    def window_order(self, epoch: int) -> np.ndarray:
        """The permutation of window indices used in ``epoch``."""
        if epoch != self._order_epoch:
            generator = np.random.Generator(np.random.PCG64([self.seed, int(epoch)]))
            self._order = generator.permutation(self.num_windows)
            self._order_epoch = int(epoch)
        return self._order

    def global_windows(self, epoch: int, index: int) -> np.ndarray:
        """Window indices of global batch ``index`` of ``epoch`` (all ranks' rows)."""
        start = index * self.batch_size
        return self.window_order(epoch)[start : start + self.batch_size]

    def __next__(self) -> torch.Tensor:
        if self.index >= self.steps_per_epoch:
            self.epoch += 1
            self.index = 0
        rows = self.global_windows(self.epoch, self.index)
        local = rows[self.rank * self.local_batch_size : (self.rank + 1) * self.local_batch_size]
        self.index += 1
        return _gather(self.data, local, self.seq_len)

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The exact position plus what identifies the data stream."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": self.data.num_tokens,
            "fingerprint": self.data.fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; ``ValueError`` when it belongs to another stream."""
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"not a version-{STATE_VERSION} BatchLoader state: "
                f"format={state.get('format')!r}, version={state.get('version')!r}"
            )
        mine = self.state_dict()
        for key in ("num_tokens", "fingerprint", "seed", "batch_size", "seq_len"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"BatchLoader state does not match this loader: {key} is "
                    f"{state.get(key)!r} in the state and {mine[key]!r} here"
                    + (" (different data)" if key in ("num_tokens", "fingerprint") else "")
                )
        epoch, index = state.get("epoch"), state.get("index")
        if not all(isinstance(v, int) and v >= 0 for v in (epoch, index)) or index > len(self):
            raise ValueError(
                f"BatchLoader state has a bad position: epoch={epoch!r}, index={index!r}"
            )
        self.epoch, self.index = int(epoch), int(index)


def documents_after_eos(batch: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The documents of each window, ``(B, N)``: a new one begins after every EOS (the EOS
    belongs to the document it ends). For training with document masking
    (``TrainConfig.document_masking``), where a window that crosses document boundaries attends
    only within each document (``DiffTransformerLM``'s ``document_ids``)."""
    ends = (batch == eos_id).long()
    return torch.nn.functional.pad(ends[:, :-1].cumsum(-1), (1, 0))


def spread_windows(num_windows: int, count: int) -> np.ndarray:
    """``count`` window indices spread evenly over ``num_windows`` windows, in stream order:
    window ``⌊i · num_windows / count⌋`` for ``i = 0 … count − 1``.

    Every stretch of the stream is represented in proportion to its length, so a stream that
    concatenates several sources (documents of a mix, grouped by source) is sampled in the
    mix's proportions rather than by whichever source comes first. ``count ≥ num_windows``
    gives every window.
    """
    num_windows = _positive("num_windows", num_windows)
    count = min(_positive("count", count), num_windows)
    return np.arange(count, dtype=np.int64) * num_windows // count


def eval_batches(
    shards: ShardsLike,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    spread: bool = True,
) -> Iterator[torch.Tensor]:
    """A fixed, unshuffled sequence of batches of ``seq_len`` windows of ``shards``.

    The number of batches is every full batch of the stream's windows, plus an incomplete last
    one unless ``drop_last`` or ``world_size > 1``, capped at ``max_batches``. The windows they
    hold are spread evenly over the whole stream (:func:`spread_windows`), in stream order,
    batch i holding the i-th ``batch_size`` of them; with ``spread=False`` they are the first
    windows instead. With ``world_size > 1`` each rank gets its rows of every batch. Every call
    yields the same tensors.
    """
    batch_size = _positive("batch_size", batch_size)
    seq_len = _positive("seq_len", seq_len)
    if max_batches is not None:
        max_batches = _positive("max_batches", max_batches)
    local = _check_ranks(batch_size, rank, world_size)
    data = open_tokens(shards)
    num_windows = _windows(data, seq_len, "eval_batches")
    full = num_windows // batch_size
    partial = num_windows % batch_size and not drop_last and world_size == 1
    count = full + (1 if partial else 0)
    if count == 0:
        raise ValueError(
            f"eval_batches: {num_windows} windows of seq_len={seq_len} do not fill one batch "
            f"of {batch_size}; lower batch_size or seq_len, or pass drop_last=False"
        )
    if max_batches is not None:
        count = min(count, max_batches)
    take = min(num_windows, count * batch_size)
    windows = spread_windows(num_windows, take) if spread else np.arange(take, dtype=np.int64)
    for batch in range(count):
        rows = windows[batch * batch_size : (batch + 1) * batch_size]
        if world_size > 1:
            rows = rows[rank * local : (rank + 1) * local]
        yield _gather(data, rows, seq_len)
