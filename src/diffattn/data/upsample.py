"""Length upsampling of a corpus for long-context training (DIFF V1 §3.3, after Fu et al. 2024).

DIFF V1 extends its 3B models to 64K tokens on a corpus "up-sampled according to sequence
length (Fu et al., 2024)". Fu et al. ("Data Engineering for Scaling Language Models to 128K
Context", §3) find that *per-source length upsampling* works best: keep each source's share of
the tokens (the domain mixture), and within every source raise the share of tokens that come
from long documents; training sequences are then cut from the concatenated documents, so a
long document fills whole sequences.

:func:`plan_upsampling` does this on token counts. For source s with a share w_s of all tokens,
a budget of B·w_s tokens is split into a long part, ``max(long_share, s's own long share)`` of
it, filled from the documents of at least ``threshold`` tokens, and a short part filled from
the others. Each part is filled by whole passes over its documents, each pass in a fresh
seeded order, until the part's budget is reached (the last document may overshoot it), so a
document appears ⌊r⌋ or ⌈r⌉ times for a repetition factor r. A source without long documents
keeps its own mix. The selected documents are then shuffled together (seeded).

:func:`upsample_corpus` applies the plan to text sources and writes a JSON-lines corpus
(``{"text": ...}`` per line, a ``data.sources`` entry for training) and its statistics: the
token share of long documents and a length histogram before and after, and, for windows of
``target_len`` tokens cut from the document stream as the trainer's loader cuts it, the share
of windows lying inside one document and the mean number of documents per window.

Repeated documents keep their text, so the trainer's hash-based validation split puts every
copy on the same side: no validation text leaks into training.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class CorpusShape:
    """Length statistics of a document sequence (token counts, EOS between documents)."""

    documents: int
    tokens: int
    long_share: float
    """Share of the tokens in documents of at least ``threshold`` tokens."""
    window_single_document: float
    """Share of ``target_len`` windows of the stream that lie inside one document."""
    documents_per_window: float
    """Mean number of documents a ``target_len`` window touches."""
    histogram: dict[str, float] = field(default_factory=dict)
    """Share of the tokens by document length, in power-of-two bins (``"<256"``, ...)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values; a statistic without any window is ``None``."""
        return {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in asdict(self).items()
        }


def _bins(target_len: int) -> list[int]:
    edges, edge = [], 256
    while edge < target_len:
        edges.append(edge)
        edge *= 2
    return [*edges, target_len]


def corpus_shape(lengths: Sequence[int], threshold: int, target_len: int) -> CorpusShape:
    """The :class:`CorpusShape` of documents of ``lengths`` tokens, in this order.

    The stream is the documents joined by one EOS each (the document's own length counts its
    EOS here), cut into consecutive windows of ``target_len`` tokens from the start."""
    lengths_array = np.asarray(lengths, dtype=np.int64) + 1  # each document ends with EOS
    total = int(lengths_array.sum())
    if total == 0:
        raise ValueError("corpus_shape: no documents")
    raw = lengths_array - 1
    long_share = float(lengths_array[raw >= threshold].sum() / total)
    ends = np.cumsum(lengths_array)
    starts = ends - lengths_array
    windows = total // target_len
    single, touched = 0, 0
    if windows:
        window_starts = np.arange(windows, dtype=np.int64) * target_len
        window_ends = window_starts + target_len
        # the first and last document each window touches
        first = np.searchsorted(ends, window_starts, side="right")
        last = np.searchsorted(starts, window_ends, side="left") - 1
        count = last - first + 1
        single = int((count == 1).sum())
        touched = int(count.sum())
    edges = _bins(target_len)
    histogram: dict[str, float] = {}
    lower = 0
    for edge in [*edges, math.inf]:
        label = (
            f"<{edge}"
            if lower == 0
            else (f">={lower}" if edge == math.inf else f"{lower}-{edge - 1}")
        )
        mask = (raw >= lower) & (raw < edge)
        histogram[label] = float(lengths_array[mask].sum() / total)
        lower = edge
    return CorpusShape(
        documents=len(lengths_array),
        tokens=total,
        long_share=long_share,
        window_single_document=single / windows if windows else math.nan,
        documents_per_window=touched / windows if windows else math.nan,
        histogram=histogram,
    )


def _fill(pool: np.ndarray, lengths: np.ndarray, budget: float, rng: np.random.Generator):
    """Whole seeded passes over ``pool`` (document indices) until ``budget`` tokens."""
    chosen: list[int] = []
    if budget <= 0 or len(pool) == 0:
        return chosen
    used = 0
    while used < budget:
        for index in rng.permutation(pool).tolist():
            chosen.append(index)
            used += int(lengths[index]) + 1
            if used >= budget:
                break
    return chosen


def plan_upsampling(
    lengths_by_source: Sequence[Sequence[int]],
    threshold: int,
    long_share: float,
    budget: int | None = None,
    seed: int = 0,
) -> list[tuple[int, int]]:
    """Per-source length upsampling (Fu et al. 2024, §3): ``(source, document)`` indices.

    Args:
        lengths_by_source: token counts of the documents of each source.
        threshold: documents of at least this many tokens are "long".
        long_share: target share of each source's tokens from long documents, in [0, 1]; a
            source already above it keeps its own share.
        budget: tokens to select in all (EOS included); default: the corpus's own size.
        seed: seed of the passes and of the final shuffle.
    """
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must lie in [0, 1], got {long_share}")
    if threshold < 1:
        raise ValueError(f"threshold must be at least 1 token, got {threshold}")
    arrays = [np.asarray(x, dtype=np.int64) for x in lengths_by_source]
    totals = [int((a + 1).sum()) for a in arrays]
    corpus = sum(totals)
    if corpus == 0 or not any(len(a) for a in arrays):
        raise ValueError("plan_upsampling: no documents")
    if budget is not None and budget < 1:
        raise ValueError(f"budget must be a positive number of tokens, got {budget}")
    budget = corpus if budget is None else int(budget)
    rng = np.random.default_rng(seed)
    selected: list[tuple[int, int]] = []
    for source, (lengths, total) in enumerate(zip(arrays, totals, strict=True)):
        if total == 0:
            continue
        share = budget * total / corpus
        is_long = lengths >= threshold
        own_long = float((lengths[is_long] + 1).sum() / total)
        long_pool, short_pool = np.flatnonzero(is_long), np.flatnonzero(~is_long)
        if len(long_pool) == 0:
            long_budget = 0.0
        elif len(short_pool) == 0:
            long_budget = share
        else:
            long_budget = share * max(long_share, own_long)
        picks = _fill(long_pool, lengths, long_budget, rng)
        picks += _fill(short_pool, lengths, share - long_budget, rng)
        selected += [(source, index) for index in picks]
    order = rng.permutation(len(selected))
    return [selected[i] for i in order.tolist()]


@dataclass
class UpsampleResult:
    path: Path
    """The JSON-lines corpus written."""
    stats_path: Path
    before: CorpusShape
    after: CorpusShape
    settings: dict[str, Any]
    repeats: dict[str, float]
    """Mean and maximum copies of a selected long and short document."""


def upsample_corpus(
    sources: Sequence[str],
    tokenizer: Any,
    out: str | Path,
    target_len: int,
    threshold: int | None = None,
    long_share: float = 0.5,
    budget: int | None = None,
    seed: int = 0,
    text_field: str = "text",
    document_split: str = "file",
    max_bytes: int | None = None,
) -> UpsampleResult:
    """Length-upsample the documents of ``sources`` into ``out/train.jsonl``.

    ``tokenizer`` (with ``encode``) measures lengths: use the model's own. ``threshold``
    defaults to ``target_len // 4`` (Fu et al. call documents above 4K long for a 4K→128K
    extension; here "long" is relative to the target). Writes ``out/train.jsonl`` and
    ``out/upsample.json`` (settings and :class:`CorpusShape` before and after).
    ``max_bytes`` caps the text read from each source.
    """
    from diffattn.data.sources import iter_documents

    if target_len < 2:
        raise ValueError(f"target_len must be at least 2 tokens, got {target_len}")
    threshold = max(1, target_len // 4) if threshold is None else threshold
    texts: list[list[str]] = []
    lengths: list[list[int]] = []
    for spec in sources:
        docs = list(
            iter_documents([spec], text_field=text_field, split=document_split, max_bytes=max_bytes)
        )
        texts.append(docs)
        lengths.append([len(tokenizer.encode(d)) for d in docs])
    if not any(texts):
        raise ValueError(f"no documents in sources {list(sources)}")
    plan = plan_upsampling(lengths, threshold, long_share, budget, seed)
    flat_before = [n for per in lengths for n in per]
    before = corpus_shape(flat_before, threshold, target_len)
    after = corpus_shape([lengths[s][i] for s, i in plan], threshold, target_len)
    copies: dict[tuple[int, int], int] = {}
    for key in plan:
        copies[key] = copies.get(key, 0) + 1
    repeats = {}
    for name, wanted in (("long", True), ("short", False)):
        counts = [c for (s, i), c in copies.items() if (lengths[s][i] >= threshold) == wanted]
        repeats[f"{name}_mean"] = float(np.mean(counts)) if counts else 0.0
        repeats[f"{name}_max"] = float(max(counts)) if counts else 0.0
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train.jsonl"
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for s, i in plan:
            handle.write(json.dumps({"text": texts[s][i]}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    settings = {
        "sources": list(sources),
        "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__),
        "target_len": target_len,
        "threshold": threshold,
        "long_share": long_share,
        "budget": budget,
        "seed": seed,
        "max_bytes": max_bytes,
    }
    stats_path = out / "upsample.json"
    record = {
        "settings": settings,
        "before": before.to_dict(),
        "after": after.to_dict(),
        "repeats": repeats,
    }
    stats_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return UpsampleResult(path, stats_path, before, after, settings, repeats)


__all__ = ["CorpusShape", "UpsampleResult", "corpus_shape", "plan_upsampling", "upsample_corpus"]
