"""``diffattn compare``: train baseline, DIFF V1 and DIFF V2 the same way and report."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from diffattn.compare import ATTENTIONS, PARTS
from diffattn.compare.evaluate import EvalSettings
from diffattn.settings import Settings, setting
from diffattn.train.cli import recipe_overrides

DESCRIPTION = (
    "Train a Transformer baseline, DIFF V1 and DIFF V2 at matched parameter count on the same "
    "data, in the same order, with the same seeds, in two parts: language modelling (AR-Hit "
    "loss, multi-needle retrieval, attention to answer and noise, outliers, quantized logits, λ) "
    "and token-level retrieval among look-alike distractors (accuracy against the number of "
    "pairs, attention to the queried pair and to distractors, accuracy under quantized logits, "
    "λ); judge the papers' claims from the spread over seeds. Writes OUT/report.md, "
    "results.json and PNGs. With no arguments: the embedded recipe (docs/compare.md), both "
    "parts, within 10 minutes on 2 CPU cores."
)


@dataclass(frozen=True)
class CompareSettings(Settings):
    """The options of ``diffattn compare``; ``None`` keeps the recipe's value. The measurement
    settings default to :class:`~diffattn.compare.evaluate.EvalSettings`' own."""

    out: str = setting("runs/compare", help="output directory")
    part: str = setting(
        "all",
        choices=PARTS,
        help="lm: language modelling; retrieval: the token-level retrieval experiment "
        "(scale it with --set retrieval.steps=..., retrieval.seeds=..., retrieval.grid=[...]); "
        "all: both (default)",
    )
    config: str | None = setting(None, help="a YAML recipe (default: the embedded compare recipe)")
    steps: int | None = setting(
        None, help="optimizer steps per language-modelling run (retrieval: --set retrieval.steps=N)"
    )
    preset: str | None = setting(None, help="model preset (see `diffattn presets`)")
    seeds: int = setting(
        3,
        help="seeds per model in the language-modelling part (default {default}; verdicts need "
        ">= 2; the retrieval part's: --set retrieval.seeds=N)",
    )
    jobs: int | None = setting(
        None,
        help="runs trained side by side (default: one per CPU core, one thread each; on CUDA one "
        "per visible device, each worker on its own device, at most devices × --jobs-per-device)",
    )
    jobs_per_device: int = setting(
        1,
        metavar="K",
        help="CUDA only: let K runs share each device (default {default}), so --jobs may reach "
        "devices × K",
    )
    evaluate: bool = setting(
        True,
        flag="--no-eval",
        help="train and report losses only: no measurements, no claims table",
    )
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
    device: str | None = setting(None, help="auto, cpu or cuda (both parts)")
    attention: tuple[str, ...] = setting(
        ATTENTIONS, choices=ATTENTIONS, help="attention types to compare (default: all three)"
    )
    overrides: Sequence[str] = recipe_overrides(
        "override a recipe value, e.g. --set optim.lr=1e-3 (repeatable)"
    )
    overwrite: bool = setting(False, help="replace an OUT holding a different comparison")
    quiet: bool = setting(False, help="no progress output")

    def eval_settings(self) -> EvalSettings:
        """What is measured: :class:`EvalSettings` with ``--needle-samples`` and
        ``--eval-tokens``."""
        return EvalSettings(needle_samples=self.needle_samples, max_tokens=self.eval_tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``compare`` verb's arguments to ``parser`` (:class:`CompareSettings`)."""
    CompareSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the comparison; invalid settings raise ValueError (exit code 2) before any work."""
    from diffattn.compare import CompareOptions, run_compare

    settings = CompareSettings.from_args(args)
    options = CompareOptions(
        out=settings.out,
        config=settings.config,
        overrides=list(settings.overrides),
        attentions=tuple(settings.attention),
        seeds=settings.seeds,
        steps=settings.steps,
        preset=settings.preset,
        device=settings.device,
        overwrite=settings.overwrite,
        progress=not settings.quiet,
        jobs=settings.jobs,
        jobs_per_device=settings.jobs_per_device,
        evaluate=settings.evaluate,
        eval_settings=settings.eval_settings(),
        part=settings.part,
    )
    run_compare(options)
    return 0
