"""``diffattn eval loss``: validation loss with DIFF V1's fine-grained slices (Table 6, Fig 4).

Every target token falls in one of two slices (after Zoology, which DIFF V1 §3.8 follows):

* **AR-Hit**: the token completes an n-gram (``--ngram``, default 2: the bigram of the previous
  token and this one) that already occurred earlier in the same context window. These are the
  tokens a model can predict by retrieving from context (associative recall). With
  ``--exclude-frequent K --train-data SPEC`` the K most frequent n-grams of the training data
  are left out of AR-Hit (they are predictable without context) and counted with Others.
* **Others**: every other target token.

Documents are tokenized with each model's own tokenizer and cut into non-overlapping windows of
``--seq-len`` tokens; each window is one context. By default only the held-out documents are
read: those the trainer's document-level split puts in validation (same ``--valid-fraction``
and ``--data-seed`` as ``data.valid_fraction`` and ``data.seed`` of the recipe), so the figures
are on text the model did not train on.

Cumulative NLL by position (DIFF V1 Fig 4, long-context evaluation): on documents at least
``--seq-len`` tokens long, the mean NLL of positions 1…p of each document's first window,
averaged over documents, for every p; plotted with a log-scaled position axis.

Results per model (``results.json``): ``loss``, ``ar_hit``, ``others`` (mean NLL in nats),
``counts`` (tokens per slice, windows, documents), ``loss_sem`` (standard error of ``loss``
over windows), ``window_loss`` (mean NLL of each window, in window order: paired differences
between models on the same windows), ``cumulative_nll`` (one value per position).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    command_main,
    markdown_table,
    one_axes,
    require_tokenizer,
    save_axes,
)
from diffattn.eval.text import (
    WINDOW_BOUNDS,
    DataSettings,
    check_seq_len,
    documents,
    open_documents,
    window_nll,
    windows,
)
from diffattn.settings import setting, shared, takes_settings

NAME = "loss"
HELP = "validation loss with AR-Hit / Others slices and cumulative NLL by position (DIFF Tab 6)"


@dataclass(frozen=True)
class LossSettings(DataSettings):
    """The settings of ``diffattn eval loss`` (and of :func:`run`); the document settings'
    defaults are eval loss's own."""

    ngram: int = setting(2, help="n of AR-Hit n-grams (default {default})")
    exclude_frequent: int = setting(
        0, metavar="K", help="leave the K most frequent training n-grams out of AR-Hit"
    )
    train_data: tuple[str, ...] | None = setting(
        None, help="data specs to count frequent n-grams on (with --exclude-frequent)"
    )
    batch_size: int = shared(CommonOptions, "batch_size", error=WINDOW_BOUNDS)
    seed: int = shared(CommonOptions, "seed")

    def check(self) -> None:
        """The one check across settings (frequent n-grams are counted on ``train_data``),
        then every setting's bounds."""
        if self.exclude_frequent and not self.train_data:
            raise ValueError("--exclude-frequent needs --train-data to count n-grams on")
        super().check()


add_arguments = LossSettings.add_arguments


def ar_hit_mask(
    ids: Sequence[int], n: int = 2, exclude: set[tuple[int, ...]] | None = None
) -> list[bool]:
    """Per target position 1…L−1 of ``ids``: whether the token completes an n-gram seen
    earlier in ``ids`` (and not in ``exclude``)."""
    if n < 1:
        raise ValueError(f"ngram must be at least 1, got {n}")
    seen: set[tuple[int, ...]] = set()
    hits = []
    for i in range(1, len(ids)):
        if i < n - 1:
            hits.append(False)
            continue
        gram = tuple(ids[i - n + 1 : i + 1])
        hits.append(gram in seen and not (exclude and gram in exclude))
        seen.add(gram)
    return hits


def frequent_ngrams(token_lists: Iterable[Sequence[int]], n: int, k: int) -> set[tuple[int, ...]]:
    """The ``k`` most frequent n-grams over ``token_lists``."""
    counts: Counter = Counter()
    for ids in token_lists:
        counts.update(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return {gram for gram, _ in counts.most_common(k)}


def evaluate_model(
    model: EvalModel,
    docs: Sequence[str],
    seq_len: int,
    max_tokens: int,
    ngram: int,
    batch_size: int,
    exclude: set | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    tokenizer = require_tokenizer(model)
    token_docs = (tokenizer.encode(d) for d in docs)  # lazily: stops at the budget
    check_seq_len(model, seq_len)
    pieces, owner = windows(token_docs, seq_len, max_tokens)
    if not pieces:
        raise ValueError("no window of at least 2 tokens; use more data or a larger budget")
    return evaluate_windows(model, pieces, owner, seq_len, ngram, batch_size, exclude, quiet)


def evaluate_windows(
    model: EvalModel,
    pieces: Sequence[Sequence[int]],
    owner: Sequence[int],
    seq_len: int,
    ngram: int = LossSettings.ngram,
    batch_size: int = 8,
    exclude: set | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """The results of :func:`evaluate_model` on token windows ``pieces`` (``owner[i]``: the
    document window i comes from)."""
    nlls = window_nll(model, pieces, batch_size, quiet)
    hit_sum = other_sum = 0.0
    hit_n = other_n = 0
    per_window = []
    for piece, nll in zip(pieces, nlls, strict=True):
        hits = torch.tensor(ar_hit_mask(piece, ngram, exclude))
        hit_sum += float(nll[hits].double().sum())
        other_sum += float(nll[~hits].double().sum())
        hit_n += int(hits.sum())
        other_n += int((~hits).sum())
        per_window.append(float(nll.double().mean()))
    total = hit_n + other_n
    loss = (hit_sum + other_sum) / total
    sem = (
        float(torch.tensor(per_window).std() / math.sqrt(len(per_window)))
        if len(per_window) > 1
        else math.nan
    )
    return {
        "loss": loss,
        "loss_sem": sem,
        "ar_hit": hit_sum / hit_n if hit_n else math.nan,
        "others": other_sum / other_n if other_n else math.nan,
        "window_loss": per_window,
        "counts": {
            "ar_hit": hit_n,
            "others": other_n,
            "tokens": total,
            "windows": len(pieces),
            "documents": len(set(owner)),
        },
        "cumulative_nll": cumulative_nll(pieces, nlls, owner, seq_len),
    }


def cumulative_nll(pieces, nlls, owner, seq_len: int) -> list[float]:
    """Mean over long documents' first windows of the running mean NLL at each position."""
    firsts, seen = [], set()
    for piece, nll, doc in zip(pieces, nlls, owner, strict=True):
        if doc not in seen and len(piece) == seq_len:
            firsts.append(nll.double())
        seen.add(doc)
    if not firsts:
        return []
    stacked = torch.stack(firsts)  # (docs, seq_len - 1)
    running = stacked.cumsum(1) / torch.arange(1, stacked.shape[1] + 1)
    return running.mean(0).tolist()


@takes_settings(LossSettings)
def run(models: Sequence[EvalModel], settings: LossSettings, quiet: bool) -> dict[str, Any]:
    """Fine-grained loss of every model on the same documents (see the module docstring);
    ``settings``, or its fields by name (``run(models, seq_len=256)``)."""
    k = settings.exclude_frequent
    docs, results = open_documents(settings, settings.seed)
    train_docs = (
        documents(settings.train_data, "all", settings.valid_fraction, settings.data_seed)
        if k
        else []
    )
    for model in models:
        exclude = None
        if k:
            tokenizer = require_tokenizer(model)
            tokens = (tokenizer.encode(d) for d in train_docs)
            exclude = frequent_ngrams(tokens, settings.ngram, k)
        results["models"][model.name] = evaluate_model(
            model,
            docs,
            settings.seq_len,
            settings.max_tokens,
            settings.ngram,
            settings.batch_size,
            exclude,
            quiet,
        )
    return results


def plot_cumulative(results: dict[str, Any], path: Path) -> Path | None:
    curves = {n: r["cumulative_nll"] for n, r in results["models"].items() if r["cumulative_nll"]}
    if not curves:
        return None
    fig, ax = one_axes()
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name)
    ax.set_xscale("log")
    return save_axes(
        fig,
        ax,
        path,
        "Cumulative NLL by position (DIFF V1 Fig 4)",
        "position in document (tokens)",
        "cumulative mean NLL (nats)",
    )


def report(results: dict[str, Any]) -> str:
    rows = [
        (
            name,
            r["loss"],
            r["loss_sem"],
            r["ar_hit"],
            r["others"],
            r["counts"]["ar_hit"],
            r["counts"]["others"],
            r["counts"]["windows"],
        )
        for name, r in results["models"].items()
    ]
    return (
        "## Fine-grained validation loss (DIFF V1 Table 6)\n\n"
        + markdown_table(
            [
                "model",
                "loss",
                "± s.e.",
                "AR-Hit",
                "Others",
                "AR-Hit tokens",
                "Other tokens",
                "windows",
            ],
            rows,
        )
        + "\nNLL in nats per token; s.e. is the standard error of the mean over windows.\n"
    )


def figures(results: dict[str, Any], out: Path) -> list[Path | None]:
    return [plot_cumulative(results, out / "cumulative_nll.png")]


def main(args: Any) -> int:
    return command_main(args, NAME, LossSettings, run, report, figures)
