"""The claims verdict rule on synthetic numbers."""

from __future__ import annotations

import math

import pytest

from diffattn.compare.claims import Claim, claims_table, evaluate_claims, judge

LOSS = Claim("loss", "lower validation loss", "DIFF V1 Fig 3", "lower")
NEEDLE = Claim("needle", "better multi-needle retrieval", "DIFF V1 Tab 2", "higher")


def test_clear_effects_in_either_direction_and_noise():
    assert judge([-0.10, -0.12, -0.11], "lower")[2] == "supported"
    assert judge([0.10, 0.12, 0.11], "lower")[2] == "not supported"
    assert judge([0.2, 0.25, 0.22], "higher")[2] == "supported"
    assert judge([-0.3, 0.2, 0.05], "lower")[2] == "inconclusive"  # spread swamps the mean
    mean, stderr, verdict = judge([-0.5], "lower")
    assert verdict == "inconclusive" and mean == -0.5 and math.isnan(stderr)
    assert judge([], "lower")[2] == "inconclusive"
    assert judge([0.0, 0.0, 0.0], "lower")[2] == "inconclusive"


def test_the_threshold_is_z_standard_errors():
    diffs = [-1.0, -3.0]  # mean -2, sd √2, se 1
    assert judge(diffs, "lower", z=1.9)[2] == "supported"
    assert judge(diffs, "lower", z=2.1)[2] == "inconclusive"


def test_paired_by_seed_for_each_model_and_rendered_with_the_rule():
    per_seed = {
        "baseline": [
            {"loss": 5.0, "needle": 0.1},
            {"loss": 5.2, "needle": 0.2},
            {"loss": 4.9, "needle": 0.1},
        ],
        "diff_v1": [
            {"loss": 5.3, "needle": 0.1},
            {"loss": 5.5, "needle": 0.3},
            {"loss": 5.2, "needle": 0.1},
        ],
        "diff_v2": [
            {"loss": 4.9, "needle": 0.1},
            {"loss": 5.1, "needle": 0.2},
            {"loss": 4.8, "needle": 0.1},
        ],
    }
    verdicts = {(v.model, v.claim.key): v for v in evaluate_claims([LOSS, NEEDLE], per_seed)}
    assert verdicts["diff_v1", "loss"].verdict == "not supported"  # +0.3 on every seed
    assert verdicts["diff_v2", "loss"].verdict == "supported"  # −0.1 on every seed
    assert verdicts["diff_v1", "needle"].verdict == "inconclusive"
    assert verdicts["diff_v2", "loss"].mean == pytest.approx(-0.1)
    table = claims_table(list(verdicts.values()))
    assert "| lower validation loss | DIFF V1 Fig 3 | — | diff_v1 | DIFF < Transformer" in table
    assert "Verdict rule" in table and "2 standard errors" in table


def test_unpaired_runs_and_bad_claims_are_errors():
    with pytest.raises(ValueError, match="paired by seed"):
        evaluate_claims([LOSS], {"baseline": [{"loss": 1.0}], "diff_v1": []})
    with pytest.raises(ValueError, match="baseline"):
        evaluate_claims([LOSS], {"diff_v1": [{"loss": 1.0}]})
    with pytest.raises(ValueError, match="better"):
        Claim("loss", "x", "y", "smaller")


GATED = Claim("acc", "higher accuracy", "DIFF V1 Tab 2", "higher", gate="acc", chance=0.1)


def test_uninformative_when_the_baseline_is_at_the_floor_or_the_ceiling():
    def verdict(base, diff, claim=GATED):
        per_seed = {
            "baseline": [{"acc": a, "chance": 0.1} for a in base],
            "diff_v1": [{"acc": a, "chance": 0.1} for a in diff],
        }
        return evaluate_claims([claim], per_seed)[0].verdict

    # a clear, consistent gain, but the baseline is at chance + < 5 points: uninformative
    assert verdict([0.12, 0.13, 0.14], [0.50, 0.52, 0.51]) == "uninformative"
    # the same gain from a baseline off the floor is judged by the usual rule
    assert verdict([0.30, 0.31, 0.32], [0.50, 0.52, 0.51]) == "supported"
    assert verdict([0.50, 0.52, 0.51], [0.30, 0.31, 0.32]) == "not supported"
    # at the ceiling (> 95%)
    assert verdict([0.96, 0.97, 0.98], [0.99, 0.99, 1.0]) == "uninformative"
    assert verdict([0.94, 0.95, 0.95], [0.99, 0.99, 1.0]) == "supported"
    # chance read from the results when the claim names a key
    by_key = Claim("acc", "higher accuracy", "Tab 2", "higher", gate="acc", chance="chance")
    assert verdict([0.12, 0.13, 0.14], [0.50, 0.52, 0.51], by_key) == "uninformative"
    assert verdict([0.16, 0.16, 0.16], [0.50, 0.52, 0.51], by_key) == "supported"
    # an ungated claim never is
    plain = Claim("acc", "higher accuracy", "Tab 2", "higher")
    assert verdict([0.12, 0.13, 0.14], [0.50, 0.52, 0.51], plain) == "supported"


def test_the_uninformative_rule_is_stated_with_gated_claims():
    per_seed = {"baseline": [{"acc": 0.5}, {"acc": 0.6}], "diff_v1": [{"acc": 0.6}, {"acc": 0.7}]}
    table = claims_table(evaluate_claims([GATED], per_seed))
    assert "*Uninformative*" in table and "chance + 5 points" in table and "95%" in table
    assert "Uninformative" not in claims_table(evaluate_claims([NEEDLE], {
        "baseline": [{"needle": 0.1}, {"needle": 0.2}],
        "diff_v1": [{"needle": 0.1}, {"needle": 0.2}],
    }))  # fmt: skip


def test_language_modelling_retrieval_rows_are_uninformative_at_the_floor():
    """The language-modelling part's recall, needle and attention rows are gated on the
    baseline's accuracy: at the floor they are not judged, off it they are."""
    from diffattn.compare.claims import PAPER_CLAIMS

    gated = {c.key: c.gate for c in PAPER_CLAIMS if c.gate}
    assert gated == {
        "recall_acc": "recall_acc",
        "needle_acc": "needle_acc",
        "needle_6_2": "needle_6_2",
        "answer_share": "needle_acc",
        "noise_share": "needle_acc",
    }

    def results(accuracy, share):
        keys = ("recall_acc", "needle_acc", "needle_6_2")
        return [{**dict.fromkeys(keys, accuracy + i / 100), "answer_share": share + i / 100,
                 "noise_share": 0.5 - share - i / 100, "val_loss": 2.0 + i / 10}
                for i in range(3)]  # fmt: skip

    floor = evaluate_claims(
        PAPER_CLAIMS, {"baseline": results(0.01, 0.1), "diff_v1": results(0.3, 0.4)}
    )
    verdicts = {v.claim.key: v.verdict for v in floor}
    assert {verdicts[k] for k in gated} == {"uninformative"}
    off_floor = evaluate_claims(
        PAPER_CLAIMS, {"baseline": results(0.2, 0.1), "diff_v1": results(0.5, 0.4)}
    )
    assert {v.verdict for v in off_floor if v.claim.key in gated} == {"supported"}
