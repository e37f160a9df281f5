"""Weighted pretraining mixtures: each source's share of the training tokens.

A mixture is a source list in which every entry carries a weight, written in a recipe as

.. code-block:: yaml

    data:
      sources:
        - {source: corpus/web.jsonl, weight: 0.7}
        - {source: stdlib, weight: 0.3}

(or ``data.sources`` as plain specs plus ``data.weights: [0.7, 0.3]``; on the command line
``--source A B --weight 0.7 0.3``). There is no one-string spelling: every character a weight
could hang on is taken by a spec form of :mod:`diffattn.data.sources` (``@SPLIT`` and
``:CONFIG`` of ``hf:``, ``?key=value`` of ``hf:`` and ``synthetic:``, ``*?[`` of globs), and a
file path may hold any of them.

**Definition.** Weights are normalised, ``p_s = w_s / Σ w``. Let ``T`` be the training tokens
(EOS included) of all sources as read, each document once (the training split only; the
validation split is decided per document by its hash, as without weights). Source ``s``
contributes ``p_s · T`` training tokens, realised by whole documents (Fu et al. 2024, §3, as
:func:`diffattn.data.upsample.plan_upsampling` does per source): whole passes over the
source's training documents, each pass in a fresh seeded order, until its budget is reached
(the last document may overshoot it by less than one document). A source whose budget is
below its own size is subsampled, one above it is repeated. The selected documents are then
shuffled together (seeded with ``data.seed``), so windows cut from the stream mix sources.
The validation split keeps each source's held-out documents once each, in source order.

Repeated documents keep their text, so every copy falls on the same side of the validation
split: no validation text leaks into training. The weights are part of the preparation's cache
key; plain (unweighted) source lists keep their keys and are prepared as before.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diffattn.data.shards import ShardSet, ShardWriter, WriteResult, write_token_shards
from diffattn.data.sources import SourceStats, iter_documents
from diffattn.data.tokenizers import Tokenizer
from diffattn.data.upsample import _fill

SOURCE_KEY = "source"
WEIGHT_KEY = "weight"


def check_weight(spec: str, weight: object) -> float:
    """``weight`` as a float when it is a positive finite number; else ``ValueError`` naming the
    source ``spec``."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValueError(
            f"mixture weight of source {spec!r} must be a positive finite number, got {weight!r}"
        )
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(
            f"mixture weight of source {spec!r} must be a positive finite number, got {weight!r}"
        )
    return float(weight)


def split_sources(
    entries: Sequence[Any], weights: Sequence[Any] | None
) -> tuple[tuple[Any, ...], tuple[float, ...] | None]:
    """``(specs, weights)`` of a ``data.sources`` list and its optional ``data.weights``.

    An entry is a spec string or a mapping ``{source: SPEC, weight: W}``. Either every entry
    is a mapping with a weight, or none is (then ``weights`` may give them, one per source);
    anything else raises ``ValueError`` naming the source. ``weights`` is ``None`` for a plain
    list."""
    mapped = [e for e in entries if isinstance(e, Mapping)]
    if not mapped:
        if weights is None:
            return tuple(entries), None
        if isinstance(weights, str | bytes) or not isinstance(weights, Sequence):
            raise ValueError(f"weights must be a list of numbers, got {weights!r}")
        if len(weights) != len(entries):
            raise ValueError(
                f"{len(weights)} weight(s) for {len(entries)} source(s) {list(entries)}: "
                "give one weight per source"
            )
        return tuple(entries), tuple(
            check_weight(str(s), w) for s, w in zip(entries, weights, strict=True)
        )
    if weights is not None:
        raise ValueError("weights are given twice: beside each source and in weights")
    specs, found = [], []
    for entry in entries:
        if not isinstance(entry, Mapping):
            raise ValueError(
                f"source {entry!r} has no weight; in a mixture every source needs one "
                f"({{{SOURCE_KEY}: SPEC, {WEIGHT_KEY}: W}})"
            )
        unknown = sorted(set(entry) - {SOURCE_KEY, WEIGHT_KEY})
        if unknown or SOURCE_KEY not in entry:
            raise ValueError(
                f"bad mixture entry {dict(entry)!r}: expected {{{SOURCE_KEY}: SPEC, "
                f"{WEIGHT_KEY}: W}}"
            )
        spec = entry[SOURCE_KEY]
        if WEIGHT_KEY not in entry:
            raise ValueError(f"source {spec!r} has no weight; in a mixture every source needs one")
        specs.append(spec)
        found.append(check_weight(str(spec), entry[WEIGHT_KEY]))
    return tuple(specs), tuple(found)


def join_sources(specs: Sequence[str], weights: Sequence[float] | None) -> list[Any]:
    """The ``data.sources`` list of ``specs`` and ``weights``: plain specs without weights, else
    ``{source, weight}`` mappings (the inverse of :func:`split_sources`)."""
    if weights is None:
        return list(specs)
    return [{SOURCE_KEY: s, WEIGHT_KEY: w} for s, w in zip(specs, weights, strict=True)]


def plan_mixture(
    lengths_by_source: Sequence[Sequence[int]], weights: Sequence[float], seed: int
) -> list[tuple[int, int]]:
    """``(source, document)`` picks giving source ``s`` the share ``w_s / Σ w`` of the tokens.

    ``lengths_by_source``: each source's document lengths in tokens, EOS included. The budget
    is the corpus's own size ``T``; source ``s`` is filled to ``T · w_s / Σ w`` tokens by whole
    seeded passes over its documents (the last pick may overshoot), and all picks are shuffled
    together. See the module docstring."""
    arrays = [np.asarray(x, dtype=np.int64) for x in lengths_by_source]
    if len(arrays) != len(weights):
        raise ValueError(f"{len(weights)} weights for {len(arrays)} sources")
    total = sum(int(a.sum()) for a in arrays)
    rng = np.random.default_rng(seed)
    weight_sum = float(sum(weights))
    picks: list[tuple[int, int]] = []
    for source, (lengths, weight) in enumerate(zip(arrays, weights, strict=True)):
        # _fill counts one EOS per document on top of its length
        chosen = _fill(np.arange(len(lengths)), lengths - 1, total * weight / weight_sum, rng)
        picks += [(source, index) for index in chosen]
    order = rng.permutation(len(picks))
    return [picks[i] for i in order.tolist()]


def _document_lengths(shards: ShardSet) -> np.ndarray:
    """Each document's length in tokens, its EOS included."""
    lengths = []
    for shard in shards.shards:
        offsets = np.asarray(shard.document_offsets, dtype=np.int64)
        lengths.append(np.diff(np.append(offsets, shard.num_tokens)))
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


def _document_ids(shards: ShardSet) -> list[tuple[int, int, int]]:
    """``(shard, start, end)`` of each document (its EOS excluded)."""
    spans = []
    for index, shard in enumerate(shards.shards):
        offsets = shard.document_offsets.tolist()
        for begin, end in zip(offsets, [*offsets[1:], shard.num_tokens], strict=True):
            spans.append((index, begin, end - 1))
    return spans


def write_mixture_shards(
    specs: Sequence[str],
    weights: Sequence[float],
    tokenizer: Tokenizer,
    directory: Path,
    *,
    read: Mapping[str, Any],
    stats: SourceStats,
    valid_fraction: float,
    seed: int,
    shard_tokens: int,
    progress: bool,
) -> tuple[WriteResult, dict[str, Any]]:
    """Tokenise each source once into ``directory/sources/I``, then write the mixture's train
    set (:func:`plan_mixture`) and the sources' valid sets into ``directory/{train,valid}``.

    ``read``: the keyword arguments of :func:`~diffattn.data.sources.iter_documents` besides
    the sources and ``stats`` (``max_bytes`` is shared by all sources together, as without
    weights). Returns the result and the mixture record (per source: natural and mixture
    training tokens, the realised share). A source without training documents raises
    ``ValueError`` naming it."""
    parts = []
    for index, spec in enumerate(specs):
        documents = iter_documents([spec], stats=stats, **read)
        parts.append(
            write_token_shards(
                documents,
                tokenizer,
                directory / "sources" / str(index),
                valid_fraction=valid_fraction,
                seed=seed,
                shard_tokens=shard_tokens,
                progress=progress,
            )
        )
        if parts[-1].train_tokens == 0:
            raise ValueError(
                f"mixture source {spec!r} has no training documents, so its weight "
                f"{weights[index]:g} cannot be met"
            )
    lengths = [_document_lengths(part.train) for part in parts]
    plan = plan_mixture(lengths, weights, seed)
    common = {
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer_name": tokenizer.name,
        "shard_tokens": shard_tokens,
    }
    train_writer = ShardWriter(directory / "train", **common)
    spans = [_document_ids(part.train) for part in parts]
    for source, document in plan:
        shard, begin, end = spans[source][document]
        train_writer.add(parts[source].train.shards[shard].tokens[begin:end])
    valid_writer = ShardWriter(directory / "valid", **common)
    for part in parts:
        for ids in part.valid.documents():
            valid_writer.add(ids)
    train, valid = train_writer.close(), valid_writer.close()
    result = WriteResult(
        train=train,
        valid=valid,
        documents=sum(p.documents for p in parts),
        train_documents=train.num_documents,
        valid_documents=valid.num_documents,
        train_tokens=train.num_tokens,
        valid_tokens=valid.num_tokens,
        text_bytes=sum(p.text_bytes for p in parts),
    )
    parts.clear()  # drops the memory maps of the per-source sets before they go
    shutil.rmtree(directory / "sources")
    return result, _mixture_record(specs, weights, lengths, plan)


def _mixture_record(
    specs: Sequence[str],
    weights: Sequence[float],
    lengths: Sequence[np.ndarray],
    plan: Sequence[tuple[int, int]],
) -> dict[str, Any]:
    """Per source: its weight, target share, natural and mixture training tokens, the realised
    share and the mean number of copies of a document (below 1: subsampled)."""
    taken = [0] * len(specs)
    for source, document in plan:
        taken[source] += int(lengths[source][document])
    total = sum(taken)
    weight_sum = float(sum(weights))
    sources = []
    for spec, weight, own, used in zip(specs, weights, lengths, taken, strict=True):
        natural = int(own.sum())
        sources.append(
            {
                "source": spec,
                "weight": weight,
                "target_share": weight / weight_sum,
                "share": used / total,
                "natural_tokens": natural,
                "tokens": used,
                "copies": used / natural,
            }
        )
    return {"definition": "share of training tokens, whole documents", "sources": sources}
