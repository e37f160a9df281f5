"""The measurements ``diffattn compare`` takes of every trained model (the ``diffattn eval``
experiments, run in-process on the run's final checkpoint).

On the trainer's validation stream (held-out documents of the training mix, as tokens, cut into
windows of the training length and spread evenly over the stream):

* ``val_loss``, ``ar_hit``, ``others``: mean next-token NLL, and its AR-Hit / Others slices
  (DIFF V1 Table 6; :mod:`diffattn.eval.loss`), with ``window_loss`` kept for paired
  standard errors between models;
* ``logit_top1``/``logit_median`` and ``hidden_top1``/``hidden_median``: the largest and the
  median |attention logit| and |hidden state| (Table 5; :mod:`diffattn.eval.outliers`);
* ``quant_loss_<b>``: the loss with attention logits quantized to b bits by dynamic absmax
  (Fig 8), and ``quant_gap_<b>`` = quant_loss_b − val_loss.

On fresh associative-recall episodes (the mix's ``synthetic:recall`` format):

* ``recall_acc``: the share of queries whose value greedy decoding gets right (MQAR accuracy).

On needle prompts at the trained length (:mod:`diffattn.eval.needle`; the synthetic haystack,
answer needles at several depths):

* ``needle_<N>_<R>``: accuracy for N needles, R of them asked (Table 2), and ``needle_acc``
  their mean;
* ``answer_share`` / ``noise_share``: the share of the last prompt token's attention that falls
  on the answer needles / on the context outside every needle, mean over layers, heads, depths
  and cells (Table 3). Shares are the raw masses divided by the row's total mass, because a
  differential map sums to 1 − λ rather than 1: raw masses would make DIFF's noise look lower
  and its answer attention lower by that factor alone.

Results are cached per run in ``eval.json`` with a fingerprint of the checkpoint and the
settings, so a re-run reuses them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diffattn.settings import Settings, setting

EVAL_NAME = "eval.json"


@dataclass(frozen=True)
class EvalSettings:
    """What is measured; part of every cached result's fingerprint."""

    needle_cells: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (4, 2), (6, 2))
    """(N, R) pairs: N needles, R asked (DIFF V1 Table 2)."""
    needle_depths: tuple[float, ...] = (0.0, 50.0, 100.0)
    needle_samples: int = 8
    """Samples per (depth, cell)."""
    needle_digits: int = 7
    """Digits of each needle's number (set it to the training mix's ``synthetic:needle``)."""
    recall_episodes: int = 24
    """Associative-recall episodes, each asking every one of its queries."""
    recall_pairs: int = 8
    recall_queries: int = 8
    """Pairs listed and queries asked per episode (set them to the mix's ``synthetic:recall``)."""
    max_tokens: int | None = None
    """Token budget of the held-out windows for loss, outliers and quantization; ``None``
    (the default) takes exactly the trainer's validation windows (``eval_batches ×
    eval_batch_size`` of them), so the claims table and the training summary report one
    validation loss."""
    bits: tuple[int, ...] = (8, 6, 4)
    batch_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.needle_cells or any(not 1 <= r <= n for n, r in self.needle_cells):
            raise ValueError(f"needle cells must be (N, R) with 1 <= R <= N: {self.needle_cells}")
        if not 1 <= self.recall_queries <= self.recall_pairs or self.recall_episodes < 1:
            raise ValueError("recall needs 1 <= queries <= pairs and at least one episode")
        if (
            self.needle_samples < 1
            or (self.max_tokens is not None and self.max_tokens < 2)
            or self.batch_size < 1
        ):
            raise ValueError("needle_samples, batch_size >= 1 and max_tokens >= 2 are required")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> EvalSettings:
        data = dict(data or {})
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"eval: unknown setting(s) {sorted(unknown)}")
        if "needle_cells" in data:
            data["needle_cells"] = tuple(tuple(int(x) for x in c) for c in data["needle_cells"])
        for key in ("needle_depths", "bits"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


@dataclass(frozen=True)
class MeasurementOptions(Settings):
    """The options of ``diffattn compare`` that set :class:`EvalSettings` (its
    ``eval_settings``), defaulting to its own."""

    needle_samples: int = setting(
        EvalSettings.needle_samples,
        cli_default=None,
        parse=int,
        type=int,
        help="needle prompts per (depth, N, R) cell (default {default})",
    )
    eval_tokens: int | None = setting(
        EvalSettings.max_tokens,
        help="held-out tokens for loss, outliers and quantization (default: the trainer's "
        "validation windows, eval_batches × eval_batch_size × seq_len)",
    )

    def eval_settings(self) -> EvalSettings:
        """What is measured: :class:`EvalSettings` with ``needle_samples`` and ``max_tokens``
        these options'."""
        return EvalSettings(needle_samples=self.needle_samples, max_tokens=self.eval_tokens)


@dataclass
class HeldOut:
    """The held-out token windows every model of a comparison is measured on."""

    windows: list[list[int]]
    seq_len: int
    fingerprint: str = ""


def held_out_windows(valid: Any, seq_len: int, max_tokens: int) -> HeldOut:
    """Windows of the trainer's validation shards (``valid``, a
    :class:`~diffattn.data.shards.ShardSet`): the stream the trainer validates on, cut into
    ``seq_len`` windows, up to ``max_tokens`` of them spread evenly over the whole stream
    (:func:`diffattn.data.loader.spread_windows`, the rule the trainer's validation follows),
    so every source of the mix counts in proportion to its tokens."""
    from diffattn.data.loader import spread_windows
    from diffattn.eval.common import fingerprint

    count = valid.num_tokens // seq_len
    if count < 1:
        raise ValueError(
            f"the validation set holds {valid.num_tokens} tokens, less than one window of "
            f"{seq_len}; raise data.valid_fraction"
        )
    take = min(count, max(1, max_tokens // seq_len))
    starts = [int(i) * seq_len for i in spread_windows(count, take)]
    windows = [[int(t) for t in valid.read(start, seq_len)] for start in starts]
    return HeldOut(windows, seq_len, fingerprint(windows))


def _needle(model: Any, settings: EvalSettings, seq_len: int) -> dict[str, Any]:
    from diffattn.eval import needle

    out: dict[str, Any] = {"cells": {}}
    accuracies, answer, noise = [], [], []
    for n, r in settings.needle_cells:
        max_new = (settings.needle_digits + 3) * r + 2
        result = needle.run(
            [model],
            needles=n,
            queries=r,
            lengths=[seq_len - max_new],
            depths=settings.needle_depths,
            samples=settings.needle_samples,
            seed=settings.seed,
            batch_size=settings.batch_size,
            max_new_tokens=max_new,
            digits=settings.needle_digits,
        )["models"][model.name]
        shares = [
            (s["answer_mass"] / s["total_mass"], s["noise_mass"] / s["total_mass"])
            for cell in result["cells"]
            for s in cell["per_sample_attention"]
            if s["total_mass"]
        ]
        cell = {
            "accuracy": result["accuracy"],
            "answer_share": _mean([a for a, _ in shares]),
            "noise_share": _mean([z for _, z in shares]),
            "by_depth": {str(c["depth"]): c["accuracy"] for c in result["cells"]},
        }
        out["cells"][f"{n}_{r}"] = cell
        out[f"needle_{n}_{r}"] = cell["accuracy"]
        accuracies.append(cell["accuracy"])
        answer.append(cell["answer_share"])
        noise.append(cell["noise_share"])
    out["needle_acc"] = _mean(accuracies)
    out["answer_share"] = _mean(answer)
    out["noise_share"] = _mean(noise)
    return out


def _recall(model: Any, settings: EvalSettings) -> dict[str, Any]:
    """Multi-query associative recall accuracy (MQAR, after Zoology; the retrieval behind DIFF
    V1 Table 6's AR-Hit slice): episodes drawn apart from the training documents, each query
    asked with the episode and the earlier answers as context, greedy decoding, correct when
    the output starts with the listed value."""
    import random

    from diffattn.data.synthetic import recall_example, recall_text
    from diffattn.eval.common import batches, require_tokenizer
    from diffattn.eval.needle import greedy

    tokenizer = require_tokenizer(model)
    rng = random.Random(f"recall-eval:{settings.seed}")
    prompts, answers = [], []
    for _ in range(settings.recall_episodes):
        listed, asked = recall_example(rng, settings.recall_pairs, settings.recall_queries)
        for i, (key, value) in enumerate(asked):
            text = recall_text(listed, [*asked[:i], (key, "")])
            prompts.append(tokenizer.encode(text, special=True))
            answers.append(value)
    pad = tokenizer.eos_token_id or 0
    correct = []
    for group in batches(list(range(len(prompts))), settings.batch_size):
        outputs = greedy(model, [prompts[i] for i in group], 3, pad)
        for i, tokens in zip(group, outputs, strict=True):
            decoded = tokenizer.decode(tokens).strip()
            correct.append(decoded[: len(answers[i])] == answers[i])
    return {"recall_acc": sum(correct) / len(correct), "recall_n": len(correct)}


def _text(model: Any, settings: EvalSettings, held_out: HeldOut) -> dict[str, Any]:
    from diffattn.eval import loss, outliers

    pieces = held_out.windows
    owner = list(range(len(pieces)))
    result = loss.evaluate_windows(model, pieces, owner, held_out.seq_len, 2, settings.batch_size)
    stats = outliers.outlier_stats(model, pieces, settings.batch_size)
    out: dict[str, Any] = {
        "val_loss": result["loss"],
        "val_loss_sem": result["loss_sem"],
        "ar_hit": result["ar_hit"],
        "others": result["others"],
        "window_loss": result["window_loss"],
        "counts": result["counts"],
        "logit_top1": stats["logits"]["top1"],
        "logit_median": stats["logits"]["median"],
        "hidden_top1": stats["hidden"]["top1"],
        "hidden_median": stats["hidden"]["median"],
    }
    for bits in settings.bits:
        quantized = outliers.quantized_loss(model, pieces, bits, settings.batch_size)
        out[f"quant_loss_{bits}"] = quantized
        out[f"quant_gap_{bits}"] = quantized - result["loss"]
    return out


def evaluate_checkpoint(
    checkpoint: Path,
    run_dir: Path,
    settings: EvalSettings,
    held_out: HeldOut,
    device: str = "cpu",
) -> dict[str, Any]:
    """Every measurement of one trained model; cached in ``run_dir/eval.json``."""
    from diffattn.eval.common import fingerprint, load_models
    from diffattn.fileio import write_json

    key = fingerprint(
        [str(Path(checkpoint).name), asdict(settings), held_out.fingerprint, held_out.seq_len]
    )
    cache = Path(run_dir) / EVAL_NAME
    cached = cached_results(cache, key)
    if cached is not None:
        return cached
    (model,) = load_models([str(checkpoint)], device=device)
    results = {
        **_text(model, settings, held_out),
        **_recall(model, settings),
        **_needle(model, settings, held_out.seq_len),
    }
    write_json(cache, {"fingerprint": key, "results": results})
    return results


def cached_results(cache: Path, key: str) -> dict[str, Any] | None:
    """The results stored in ``cache`` (JSON) under fingerprint ``key``; ``None`` when the file
    is missing, unreadable or holds another fingerprint."""
    from diffattn.fileio import read_json

    if not cache.is_file():
        return None
    try:
        cached = read_json(cache)
    except ValueError:
        return None
    return cached["results"] if cached.get("fingerprint") == key else None


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan
