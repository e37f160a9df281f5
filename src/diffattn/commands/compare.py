"""``diffattn compare``: train baseline, DIFF V1 and DIFF V2 the same way and report."""

from __future__ import annotations

import argparse

from diffattn.train.cli import add_set_option

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``compare`` verb's arguments to ``parser``."""
    from diffattn.compare import ATTENTIONS, PARTS

    parser.add_argument("--out", default="runs/compare", help="output directory")
    parser.add_argument(
        "--part",
        default="all",
        choices=PARTS,
        help="lm: language modelling; retrieval: the token-level retrieval experiment "
        "(scale it with --set retrieval.steps=..., retrieval.seeds=..., retrieval.grid=[...]); "
        "all: both (default)",
    )
    parser.add_argument(
        "--config", default=None, help="a YAML recipe (default: the embedded compare recipe)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per language-modelling run (retrieval: --set retrieval.steps=N)",
    )
    parser.add_argument("--preset", default=None, help="model preset (see `diffattn presets`)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="seeds per model in the language-modelling part (default 3; verdicts need >= 2; "
        "the retrieval part's: --set retrieval.seeds=N)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs trained side by side (default: one per CPU core, one thread each; on CUDA one "
        "per visible device, each worker on its own device, at most devices × --jobs-per-device)",
    )
    parser.add_argument(
        "--jobs-per-device",
        type=int,
        default=1,
        metavar="K",
        help="CUDA only: let K runs share each device (default 1), so --jobs may reach devices × K",
    )
    parser.add_argument(
        "--no-eval",
        dest="evaluate",
        action="store_false",
        help="train and report losses only: no measurements, no claims table",
    )
    parser.add_argument(
        "--needle-samples",
        type=int,
        default=None,
        help="needle prompts per (depth, N, R) cell (default 8)",
    )
    parser.add_argument(
        "--eval-tokens",
        type=int,
        default=None,
        help="held-out tokens for loss, outliers and quantization (default: the trainer's "
        "validation windows, eval_batches × eval_batch_size × seq_len)",
    )
    parser.add_argument("--device", default=None, help="auto, cpu or cuda (both parts)")
    parser.add_argument(
        "--attention",
        nargs="+",
        default=list(ATTENTIONS),
        choices=ATTENTIONS,
        help="attention types to compare (default: all three)",
    )
    add_set_option(parser, "override a recipe value, e.g. --set optim.lr=1e-3 (repeatable)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an OUT holding a different comparison"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    """Run the comparison; invalid settings raise ValueError (exit code 2) before any work."""
    from dataclasses import replace

    from diffattn.compare import CompareOptions, run_compare
    from diffattn.compare.evaluate import EvalSettings

    settings = EvalSettings()
    if args.needle_samples is not None:
        settings = replace(settings, needle_samples=args.needle_samples)
    if args.eval_tokens is not None:
        settings = replace(settings, max_tokens=args.eval_tokens)
    options = CompareOptions(
        out=args.out,
        config=args.config,
        overrides=list(args.overrides),
        attentions=tuple(args.attention),
        seeds=args.seeds,
        steps=args.steps,
        preset=args.preset,
        device=args.device,
        overwrite=args.overwrite,
        progress=not args.quiet,
        jobs=args.jobs,
        jobs_per_device=args.jobs_per_device,
        evaluate=args.evaluate,
        eval_settings=settings,
        part=args.part,
    )
    run_compare(options)
    return 0
