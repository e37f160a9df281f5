"""``diffattn compare``: train baseline, DIFF V1 and DIFF V2 (or other arms) the same way and
report."""

from __future__ import annotations

import argparse

from diffattn.compare import CompareOptions

DESCRIPTION = (
    "Train a Transformer baseline, DIFF V1 and DIFF V2 at matched parameter count on the same "
    "data, in the same order, with the same seeds, in two parts: language modelling (AR-Hit "
    "loss, multi-needle retrieval, attention to answer and noise, outliers, quantized logits, λ) "
    "and token-level retrieval among look-alike distractors (accuracy against the number of "
    "pairs, attention to the queried pair and to distractors, accuracy under quantized logits, "
    "λ); judge the papers' claims from the spread over seeds. --attention takes other arms: any "
    "registered attention type, or an ablation of one as TYPE:option=value,... (e.g. "
    "diff_v1:lambda_init=0.8), each matched to the baseline's parameters and reported as its "
    "difference to the baseline. Writes OUT/report.md, results.json and PNGs. With no "
    "arguments: the embedded recipe (docs/compare.md), both parts, within 10 minutes on 2 CPU "
    "cores."
)


add_arguments = CompareOptions.add_arguments
"""Add the ``compare`` verb's arguments to a parser (:class:`~diffattn.compare.CompareOptions`,
where each option is declared)."""


def run(args: argparse.Namespace) -> int:
    """Run the comparison; invalid settings raise ValueError (exit code 2) before any work."""
    from diffattn.compare import run_compare
    from diffattn.compare.allocator import keep_freed_memory

    keep_freed_memory()  # this process is the command's own (runs train here with --jobs 1)
    run_compare(CompareOptions.from_args(args))
    return 0
