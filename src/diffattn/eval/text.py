"""Held-out documents cut into token windows: the data of ``eval loss``, ``outliers``,
``heads``, ``hessian`` and ``effective``.

Documents are read as the trainer reads them; by default only those its document-level split
puts in validation (``--valid-fraction`` and ``--data-seed`` are the recipe's
``data.valid_fraction`` and ``data.seed``). Each model tokenizes them with its own tokenizer
and they are cut into non-overlapping windows of ``--seq-len`` tokens, up to ``--max-tokens``
(:func:`model_windows`). :func:`measure_windows` runs one measurement per model on its
windows; :func:`padded_batches` feeds windows to a model in right-padded batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import torch

from diffattn.eval.common import (
    EvalModel,
    batches,
    fingerprint,
    progress,
    require_tokenizer,
    seed_everything,
)
from diffattn.settings import Settings, setting

WINDOW_BOUNDS = "--seq-len and --max-tokens must be at least 2, --batch-size at least 1"
"""The message of ``--seq-len``, ``--max-tokens`` and ``--batch-size`` out of bounds (each
experiment's ``batch_size`` joins it)."""


@dataclass(frozen=True)
class DataSettings(Settings):
    """The document settings of an experiment that reads held-out text: ``--data``,
    ``--split``, ``--valid-fraction``, ``--data-seed`` (as eval loss reads documents),
    ``--seq-len`` and ``--max-tokens``. The first four and ``--seq-len`` default to the
    evaluated run's own recipe (:mod:`diffattn.eval.run_split`), else to these defaults. An
    experiment declares its own ``seq_len`` and ``max_tokens`` defaults with
    :func:`~diffattn.settings.like` (these are eval loss's)."""

    data: tuple[str, ...] = setting(
        ("stdlib",), recipe=True, help="data specs (default: the run's data.sources, else stdlib)"
    )
    split: Literal["valid", "all"] = setting(
        "valid", help="held-out documents only (default) or every document"
    )
    valid_fraction: float = setting(
        0.02,
        recipe=True,
        help="the recipe's data.valid_fraction (default: the run's, else {default})",
    )
    data_seed: int = setting(
        0, recipe=True, help="the recipe's data.seed (default: the run's, else {default})"
    )
    seq_len: int = setting(
        512,
        recipe=True,
        min=2,
        error=WINDOW_BOUNDS,
        help="context window (default: the run's seq_len, else {default})",
    )
    max_tokens: int = setting(
        200_000,
        min=2,
        error=WINDOW_BOUNDS,
        help="token budget over all windows (default {default:,})",
    )


DOCUMENT_READING: ContextVar[dict[str, Any] | None] = ContextVar("document_reading", default=None)
"""How :func:`documents` cuts sources into documents (``text_field``, ``split``,
``max_bytes`` of :func:`diffattn.data.iter_documents`): the trained run's own, set by
``diffattn eval`` for the duration of an experiment (:mod:`diffattn.eval.run_split`), so the
held-out split is decided over the documents the trainer saw; the defaults otherwise."""


def documents(specs: Sequence[str], split: str, valid_fraction: float, seed: int) -> list[str]:
    from diffattn.data import is_validation_document, iter_documents

    docs = list(iter_documents(specs, **(DOCUMENT_READING.get() or {})))
    if split == "valid":
        docs = [
            d for d in docs if is_validation_document(d, seed=seed, valid_fraction=valid_fraction)
        ]
    if not docs:
        raise ValueError(
            f"no documents in {list(specs)} for split={split!r} "
            f"(valid_fraction={valid_fraction}); use --split all or more data"
        )
    return docs


def windows(
    token_docs: Iterable[Sequence[int]], seq_len: int, max_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """Non-overlapping windows of ``seq_len`` tokens (the last one of a document may be
    shorter, at least 2 tokens), up to ``max_tokens``; and the document index of each."""
    out, owner, total = [], [], 0
    for d, ids in enumerate(token_docs):
        for start in range(0, len(ids), seq_len):
            piece = list(ids[start : start + seq_len])
            if len(piece) < 2:
                continue
            if total + len(piece) > max_tokens:
                return out, owner
            out.append(piece)
            owner.append(d)
            total += len(piece)
    return out, owner


def padded(group: Sequence[Sequence[int]], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` of a group of windows."""
    width = max(len(p) for p in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.long)
    for row, piece in enumerate(group):
        ids[row, : len(piece)] = torch.tensor(piece)
        mask[row, : len(piece)] = 1
    return ids.to(device), mask.to(device)


def padded_batches(
    model: EvalModel, pieces: Sequence[Sequence[int]], batch_size: int, label: str, quiet: bool
) -> Iterator[tuple[Sequence[Sequence[int]], torch.Tensor, torch.Tensor]]:
    """Each batch of ``batch_size`` windows of ``pieces`` with its right-padded ``input_ids``
    and ``attention_mask`` (:func:`padded`) on ``model``'s device, under a progress bar named
    ``label``."""
    groups = list(batches(pieces, batch_size))
    for group in progress(groups, len(groups), label, quiet):
        ids, mask = padded(group, model.device)
        yield group, ids, mask


def context_limit(model: EvalModel) -> int | None:
    config = getattr(model.model, "config", None)
    return getattr(config, "max_seq_len", None) or getattr(config, "max_position_embeddings", None)


def check_seq_len(model: EvalModel, seq_len: int) -> None:
    """``ValueError`` when windows of ``seq_len`` tokens do not fit ``model``'s context."""
    limit = context_limit(model) or seq_len
    if seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds {model.name}'s context of {limit} tokens")


def model_windows(
    model: EvalModel, docs: Sequence[str], seq_len: int, max_tokens: int
) -> list[list[int]]:
    """``model``'s tokenization of ``docs`` cut into windows as eval loss cuts them."""
    check_seq_len(model, seq_len)
    tokenizer = require_tokenizer(model)
    pieces, _ = windows((tokenizer.encode(d) for d in docs), seq_len, max_tokens)
    if not pieces:
        raise ValueError("no window of at least 2 tokens; use more data or a larger budget")
    return pieces


@torch.no_grad()
def window_nll(
    model: EvalModel, pieces: Sequence[Sequence[int]], batch_size: int, quiet: bool = True
) -> list[torch.Tensor]:
    """Per window, the ``(len − 1,)`` NLL of each target token (right padding, masked)."""
    from diffattn.probe import token_nll

    out: list[torch.Tensor] = []
    for group, ids, mask in padded_batches(model, pieces, batch_size, f"loss {model.name}", quiet):
        logits = model.model(**model.window_inputs(ids, mask)).logits
        nll = token_nll(logits, ids, mask).cpu()
        out.extend(nll[row, : len(piece) - 1] for row, piece in enumerate(group))
    return out


def open_documents(settings: DataSettings, seed: int) -> tuple[list[str], dict[str, Any]]:
    """Seed, read the documents of ``settings``; the documents and the results dictionary to
    fill (``models``, ``documents``, ``data_fingerprint``)."""
    seed_everything(seed)
    docs = documents(settings.data, settings.split, settings.valid_fraction, settings.data_seed)
    return docs, {"models": {}, "documents": len(docs), "data_fingerprint": fingerprint(docs)}


def measure_windows(
    models: Sequence[EvalModel],
    settings: DataSettings,
    seed: int,
    measure: Callable[[EvalModel, list[list[int]]], dict[str, Any]],
) -> dict[str, Any]:
    """The results of an experiment on held-out windows: :func:`open_documents`' dictionary
    with ``results["models"][model.name] = measure(model, windows)``, each model's windows of
    the documents cut by :func:`model_windows`."""
    docs, results = open_documents(settings, seed)
    for model in models:
        pieces = model_windows(model, docs, settings.seq_len, settings.max_tokens)
        results["models"][model.name] = measure(model, pieces)
    return results
