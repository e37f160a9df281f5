"""The papers' claims as testable predictions, and the rule that turns measurements over seeds
into a verdict: supported, not supported, or inconclusive at this scale.

A claim compares a DIFF model with the Transformer baseline trained on the same tokens, in the
same order, with the same seed. For each seed s the paired difference is
``d_s = metric(DIFF, s) − metric(baseline, s)`` (pairing removes what the seed does to both).
With n seeds, mean d̄ and standard error se = sd(d) / √n:

* **supported**: d̄ lies on the side the paper predicts and |d̄| > ``z`` · se;
* **not supported**: d̄ lies on the other side and |d̄| > ``z`` · se;
* **inconclusive**: otherwise, or with fewer than two seeds (no spread to judge noise by);
* **uninformative**: for a claim tied to an accuracy (``Claim.gate``), the baseline's mean
  accuracy is at the floor (less than 5 points above chance) or at the ceiling (above 95%), so
  the task cannot separate the models, whatever the differences say.

``z`` defaults to 2 (roughly a two-sided 95% interval for moderate n; with 3 seeds it is a
lenient bar, which the report states next to the table). The rule is computed, never written by
hand, and stated in every report.

The claims are the papers' about DIFF V1 and V2: they are judged for the arms whose type
declares them (``AttentionType.paper_claims``), unchanged. Any other arm (another type, or an
ablation) gets the same rows as measured differences against the baseline, with their spread and
no prediction: *lower* or *higher* when the mean lies more than ``z`` standard errors from 0,
else *inconclusive* (or *uninformative* under the same gate).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from diffattn.compare.arms import REFERENCE, arm_of

VERDICTS = ("supported", "not supported", "inconclusive", "uninformative")
LOWER, HIGHER = "lower", "higher"
"""What an arm without a paper claim shows in place of *supported* / *not supported*: on which
side of the baseline its mean lies, beyond the noise."""
FLOOR_MARGIN = 0.05
"""Points above chance the baseline's accuracy must exceed for a gated claim to count."""
CEILING = 0.95
"""Accuracy above which the baseline is at the ceiling."""


@dataclass(frozen=True)
class Claim:
    """One of the papers' claims.

    Attributes:
        key: the measurement it reads (a key of the per-model results).
        statement: the claim in a sentence.
        source: table or figure of the paper.
        better: ``"lower"`` or ``"higher"``: which direction of the metric the claim predicts
            for DIFF against the baseline.
    """

    key: str
    statement: str
    source: str
    better: str
    paper: str = ""
    """The paper's own figures, DIFF against the Transformer, for the report."""
    gate: str | None = None
    """An accuracy key: the claim is *uninformative* when the baseline's mean of it is at the
    floor or the ceiling (:func:`at_floor_or_ceiling`). ``None``: never."""
    chance: float | str | None = None
    """Chance accuracy of ``gate``: a number, or a key of the per-seed results holding it."""

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher"):
            raise ValueError(f"Claim.better must be 'lower' or 'higher', got {self.better!r}")

    @property
    def prediction(self) -> str:
        return f"DIFF {'<' if self.better == 'lower' else '>'} Transformer"


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    model: str
    differences: tuple[float, ...]
    mean: float
    stderr: float
    verdict: str
    claimed: bool = True
    """Whether the claim is the papers' for this model; ``False``: a measured difference only
    (``verdict`` is then *lower*, *higher*, *inconclusive* or *uninformative*)."""

    def measured(self) -> str:
        if math.isnan(self.stderr):
            return f"{self.mean:+.4g} (n={len(self.differences)})"
        return f"{self.mean:+.4g} ± {self.stderr:.2g} (n={len(self.differences)})"


def judge(differences: Sequence[float], better: str, z: float = 2.0) -> tuple[float, float, str]:
    """``(mean, standard error, verdict)`` of paired differences DIFF − baseline."""
    values = [float(d) for d in differences if not math.isnan(float(d))]
    if not values:
        return math.nan, math.nan, "inconclusive"
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, "inconclusive"
    stderr = statistics.stdev(values) / math.sqrt(len(values))
    if abs(mean) <= z * stderr or mean == 0.0:
        return mean, stderr, "inconclusive"
    predicted = mean < 0 if better == "lower" else mean > 0
    return mean, stderr, "supported" if predicted else "not supported"


def at_floor_or_ceiling(
    accuracies: Sequence[float],
    chance: float,
    margin: float = FLOOR_MARGIN,
    ceiling: float = CEILING,
) -> bool:
    """Whether the mean of ``accuracies`` is below ``chance + margin`` or above ``ceiling``:
    a task the baseline cannot do at all, or does perfectly, separates no models."""
    values = [float(a) for a in accuracies if not math.isnan(float(a))]
    if not values:
        return True
    mean = statistics.fmean(values)
    return mean < chance + margin or mean > ceiling


def _gated(claim: Claim, reference: Sequence[Mapping[str, float]]) -> bool:
    if claim.gate is None:
        return False
    chance = claim.chance
    if isinstance(chance, str) or chance is None:
        chance = float(reference[0].get(chance or "chance", 0.0)) if reference else 0.0
    return at_floor_or_ceiling([float(r.get(claim.gate, math.nan)) for r in reference], chance)


def claimed_arms(models: Collection[str]) -> set[str]:
    """The arms of ``models`` the papers' claims are about (:attr:`Arm.paper_claims
    <diffattn.compare.arms.Arm.paper_claims>`)."""
    return {name for name in models if (arm := arm_of(name)) is not None and arm.paper_claims}


def evaluate_claims(
    claims: Sequence[Claim],
    per_seed: Mapping[str, Sequence[Mapping[str, float]]],
    baseline: str = REFERENCE,
    z: float = 2.0,
    claimed: Collection[str] | None = None,
) -> list[Verdict]:
    """Verdicts of every claim for every non-baseline model.

    ``per_seed[model][i]`` holds the measurements of ``model`` trained with the i-th seed; the
    baseline's list is paired with each model's by index. ``claimed``: the models the claims
    are about (``None``: every one); the others get measured differences (:data:`LOWER`,
    :data:`HIGHER`), no verdict on a claim.
    """
    if baseline not in per_seed:
        raise ValueError(f"no measurements of the baseline {baseline!r}")
    reference = per_seed[baseline]
    out = []
    for model, runs in per_seed.items():
        if model == baseline:
            continue
        if len(runs) != len(reference):
            raise ValueError(
                f"{model} has {len(runs)} seeds and {baseline} {len(reference)}; claims compare "
                "runs paired by seed"
            )
        for claim in claims:
            diffs = tuple(
                float(run.get(claim.key, math.nan)) - float(ref.get(claim.key, math.nan))
                for run, ref in zip(runs, reference, strict=True)
            )
            mean, stderr, verdict = judge(diffs, claim.better, z)
            is_claimed = claimed is None or model in claimed
            if not is_claimed and verdict in ("supported", "not supported"):
                verdict = LOWER if mean < 0 else HIGHER
            if _gated(claim, reference):
                verdict = "uninformative"
            out.append(Verdict(claim, model, diffs, mean, stderr, verdict, is_claimed))
    return out


def claims_table(verdicts: Sequence[Verdict], z: float = 2.0) -> str:
    """The report's claims table (markdown) with the rule stated below it."""
    lines = [
        "| claim | source | paper (DIFF vs Transformer) | model | prediction here "
        "| measured: DIFF − Transformer | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        if v.claimed:
            lines.append(
                f"| {v.claim.statement} | {v.claim.source} | {v.claim.paper or '—'} | {v.model} "
                f"| {v.claim.prediction} ({v.claim.key}) | {v.measured()} | {v.verdict} |"
            )
        else:
            lines.append(
                f"| {v.claim.statement} | — | no paper claim | {v.model} | — ({v.claim.key}) | "
                f"{v.measured()} | {v.verdict} |"
            )
    rule = (
        f"\nVerdict rule: paired differences over seeds, mean ± standard error; *supported* when "
        f"the mean lies on the predicted side by more than {z:g} standard errors, *not "
        f"supported* when on the other side by more than {z:g}, else *inconclusive* (always "
        "with fewer than two seeds)."
    )
    if not all(v.claimed for v in verdicts):
        rule += (
            " Rows with *no paper claim* (another type, or an ablation) give the measured "
            f"difference only: *lower* or *higher* when the mean lies more than {z:g} standard "
            "errors from 0, else *inconclusive*."
        )
    if any(v.claim.gate for v in verdicts):
        rule += (
            f" *Uninformative*: the Transformer's mean accuracy on the task behind the claim is "
            f"below chance + {FLOOR_MARGIN * 100:g} points or above {CEILING * 100:g}%, so the "
            "task cannot separate the models, whatever the difference."
        )
    rule += "\n"
    return "\n".join(lines) + "\n" + rule


PAPER_CLAIMS: tuple[Claim, ...] = (
    Claim(
        "val_loss",
        "lower language-modeling loss",
        "DIFF V1 Fig 3, Tab 6; V2 blog",
        "lower",
        "3.062 vs 3.087 (1.4B, Tab 6); V2: 0.02–0.03 lower",
    ),
    Claim(
        "ar_hit",
        "lower loss on AR-Hit tokens (associative recall)",
        "DIFF V1 Tab 6",
        "lower",
        "0.880 vs 0.898",
    ),
    Claim(
        "recall_acc",
        "higher multi-query associative recall accuracy",
        "DIFF V1 Tab 6 (AR-Hit), as MQAR accuracy",
        "higher",
        "AR-Hit loss 0.880 vs 0.898",
        gate="recall_acc",
        chance=0.0,
    ),
    Claim("others", "lower loss on the other tokens", "DIFF V1 Tab 6", "lower", "3.247 vs 3.272"),
    Claim(
        "needle_acc",
        "higher multi-needle accuracy, mean over (N, R)",
        "DIFF V1 Tab 2",
        "higher",
        "0.90 vs 0.76 (4K, 3B)",
        gate="needle_acc",
        chance=0.0,
    ),
    Claim(
        "needle_6_2",
        "higher needle accuracy with 6 needles, 2 asked",
        "DIFF V1 Tab 2",
        "higher",
        "0.85 vs 0.55",
        gate="needle_6_2",
        chance=0.0,
    ),
    Claim(
        "answer_share",
        "more attention on the answer span",
        "DIFF V1 Tab 3",
        "higher",
        "0.27–0.40 vs 0.03–0.09",
        gate="needle_acc",
        chance=0.0,
    ),
    Claim(
        "noise_share",
        "less attention on irrelevant context",
        "DIFF V1 Tab 3",
        "lower",
        "0.01–0.02 vs 0.49–0.54",
        gate="needle_acc",
        chance=0.0,
    ),
    Claim(
        "logit_top1", "smaller top-1 |attention logit|", "DIFF V1 Tab 5", "lower", "38.8 vs 318.0"
    ),
    Claim(
        "hidden_top1",
        "smaller top-1 |hidden state|",
        "DIFF V1 Tab 5; V2 blog",
        "lower",
        "1688 vs 3609",
    ),
    Claim(
        "quant_gap_6",
        "less loss added by 6-bit attention logits",
        "DIFF V1 Fig 8",
        "lower",
        "HellaSwag acc. kept at 6 bits; Transformer drops",
    ),
    Claim(
        "quant_gap_4",
        "less loss added by 4-bit attention logits",
        "DIFF V1 Fig 8",
        "lower",
        "4-bit DIFF ≈ 6-bit Transformer, ~25 points above 4-bit Transformer",
    ),
)
"""The claims ``diffattn compare`` judges, each read off the measurements of
:mod:`diffattn.compare.evaluate`. The retrieval rows of the language-modelling part are gated on
the baseline's recall and needle accuracy with chance taken as 0 (the answers are generated
numbers, so chance is at most 1/100, and 0 gives the lowest floor, 5%): attention shares
measured on needle prompts that no model answers say nothing about retrieval. Fig 8 scores
HellaSwag accuracy under quantization; at this scale the loss added on held-out text stands in
for it."""

RETRIEVAL_CLAIMS: tuple[Claim, ...] = (
    Claim(
        "acc_mean",
        "higher retrieval accuracy among distractors, mean over pair counts",
        "DIFF V1 Tab 2",
        "higher",
        "0.90 vs 0.76 (mean over N, R; 4K, 3B)",
        gate="acc_mean",
    ),
    Claim(
        "acc_hard",
        "higher retrieval accuracy with the most pairs (hardest point)",
        "DIFF V1 Tab 2",
        "higher",
        "0.85 vs 0.55 (N=6, R=2)",
        gate="acc_hard",
    ),
    Claim(
        "answer_share",
        "more attention on the queried pair",
        "DIFF V1 Tab 3, Fig 1",
        "higher",
        "0.27–0.40 vs 0.03–0.09",
        gate="acc_mean",
    ),
    Claim(
        "noise_share",
        "less attention outside the queried pair (attention noise)",
        "DIFF V1 Tab 3, Fig 1",
        "lower",
        "0.01–0.02 vs 0.49–0.54",
        gate="acc_mean",
    ),
    Claim(
        "lookalike_share",
        "less attention on look-alike distractor pairs",
        "DIFF V1 Fig 1 (noise cancellation)",
        "lower",
        "Fig 1: Transformer's attention spread over distractors, DIFF's on the answer",
        gate="acc_mean",
    ),
    Claim(
        "qdrop_6",
        "less accuracy lost with 6-bit attention logits",
        "DIFF V1 Fig 8",
        "lower",
        "HellaSwag acc. kept at 6 bits; Transformer drops",
        gate="acc_mean",
    ),
    Claim(
        "qdrop_4",
        "less accuracy lost with 4-bit attention logits",
        "DIFF V1 Fig 8",
        "lower",
        "4-bit DIFF ≈ 6-bit Transformer, ~25 points above 4-bit Transformer",
        gate="acc_mean",
    ),
)
"""The claims the retrieval experiment (:mod:`diffattn.compare.retrieval`) judges; each is
gated on the baseline's accuracy: *uninformative* when the baseline is at the floor or the
ceiling of the task (chance is the results' ``chance``: one over the number of values)."""
