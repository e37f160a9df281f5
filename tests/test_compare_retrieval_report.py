"""``retrieval_section`` of the comparison report, pinned line for line on made-up runs.

The claims (``diffattn.compare.claims``), the device line and the plots are stubbed, so that
what is pinned here is the section's own text and JSON: the task paragraph, the measurements
table, the λ summary, where the claims table, device line and plots go, and the data.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import diffattn.compare.claims as claims
import diffattn.compare.retrieval_report as rr
from diffattn.compare.retrieval import RetrievalSettings

MODELS = ("baseline", "diff_v1", "diff_v2")


def run_entry(attention: str, seed: int) -> dict:
    """One made-up run of the retrieval experiment, distinct per model and seed."""
    base = 0.1 * (1 + MODELS.index(attention)) + 0.013 * seed
    r = {f"acc_{p}": base + 0.01 * p for p in (2, 5, 8)}
    r["acc_mean"] = sum(r.values()) / 3
    shares = ("answer_share", "lookalike_share", "noise_share", "answer_mass", "noise_mass")
    for i, key in enumerate(shares):
        r[key] = base / (i + 2)
    for bits in (8, 6, 4):
        r[f"qacc_{bits}"] = r["acc_mean"] - 0.001 * (16 - bits) * (1 + seed)
        r[f"qdrop_{bits}"] = r["acc_mean"] - r[f"qacc_{bits}"]
    r["params"] = 10_000 + 17 * seed + len(attention)
    r["device"] = "cuda:1" if seed else "cpu"
    if attention == "diff_v1":
        r["lambda"] = {"lambda": [0.2 + 0.05 * seed, 0.35 - 0.01 * seed]}
    elif attention == "diff_v2":
        r["lambda"] = {"lambda_mean": [0.5 + 0.02 * seed, 0.6]}
    else:
        r["lambda"] = {}
    if attention == "diff_v2" and seed == 2:
        r["answer_mass"] = math.nan  # a missing measurement is left out of the mean
    return r


@pytest.fixture
def section(monkeypatch):
    """Calls retrieval_section with the stubs; returns (lines, data, plots, device calls)."""
    verdict = SimpleNamespace(
        claim=SimpleNamespace(key="acc_mean", statement="higher accuracy", source="Tab 2"),
        model="diff_v1",
        differences=(0.1, 0.2),
        mean=0.15,
        stderr=0.05,
        verdict="supported",
        claimed=True,
    )
    seen = {}

    def evaluate(found_claims, per_type, z, claimed):
        seen["evaluate"] = (found_claims is claims.RETRIEVAL_CLAIMS, sorted(per_type), z)
        seen["claimed"] = claimed
        return [verdict]

    def devices(runs):
        seen["devices"] = list(runs)
        return ["DEVICES", ""]

    monkeypatch.setattr(claims, "evaluate_claims", evaluate)
    monkeypatch.setattr(claims, "claims_table", lambda v, z: f"CLAIMS({len(v)}, z={z})")
    monkeypatch.setattr(rr, "device_lines", devices)
    monkeypatch.setattr(rr, "plot_accuracy", lambda out, s, p: out / "retrieval_accuracy.png")
    monkeypatch.setattr(rr, "plot_attention", lambda out, p: None)
    settings = RetrievalSettings(
        context=24, queries=2, grid=(2, 5, 8), d_model=16, n_heads=2, steps=3, seeds=3,
        filler=4, values=8, test_episodes=3,
    )  # fmt: skip
    per_type = {a: [run_entry(a, s) for s in range(3)] for a in MODELS}
    lines, data, plots = rr.retrieval_section(Path("out"), settings, per_type, z=2.5)
    return lines, data, plots, seen, per_type


EXPECTED_LINES = [
    "## Retrieval among distractors (token-level)",
    "",
    (
        "Token-level multi-query associative recall (`diffattn.data.synthetic.RetrievalTask`): "
        "two-token keys (prefix, suffix) and one-token values from disjoint ranges, 2 queries per "
        "episode, each queried key with up to 1 look-alike key(s) sharing its prefix, the pairs "
        "among filler in a context of 24 tokens (sequence 32); chance 0.125. Difficulty: pairs in "
        "the context, grid [2, 5, 8], training on every count from 2 to 8, loss on the answers "
        "only. Models: 2 layers, d_model 16, 2 baseline heads; parameters Transformer 10,008, DIFF "
        "V1 10,007, DIFF V2 10,007. 3 steps of 32 fresh episodes, lr 0.003; 3 seeds; 3 fixed test "
        "episodes per pair count, the same for every model."
    ),
    "",
    "CLAIMS(1, z=2.5)",
    "",
    "### Retrieval measurements (mean ± sd over seeds)",
    "",
    "| measurement | Transformer | DIFF V1 | DIFF V2 |",
    "|---|---|---|---|",
    "| accuracy, 2 pairs | 0.133 ± 0.013 | 0.233 ± 0.013 | 0.333 ± 0.013 |",
    "| accuracy, 5 pairs | 0.163 ± 0.013 | 0.263 ± 0.013 | 0.363 ± 0.013 |",
    "| accuracy, 8 pairs | 0.193 ± 0.013 | 0.293 ± 0.013 | 0.393 ± 0.013 |",
    "| accuracy, mean over pair counts | 0.163 ± 0.013 | 0.263 ± 0.013 | 0.363 ± 0.013 |",
    "| share on the queried pair (last layer) | 0.057 ± 0.006 | 0.106 ± 0.006 | 0.157 ± 0.007 |",
    "| share on look-alike pairs (last layer) | 0.038 ± 0.004 | 0.071 ± 0.004 | 0.104 ± 0.004 |",
    (
        "| share outside the queried pair (last layer) | 0.028 ± 0.003 | 0.053 ± 0.003 | 0.078 ± "
        "0.003 |"
    ),
    (
        "| signed mass on the queried pair (last layer) | 0.023 ± 0.003 | 0.043 ± 0.003 | 0.061 ± "
        "0.002 |"
    ),
    (
        "| signed mass outside the queried pair (last layer) | 0.019 ± 0.002 | 0.036 ± 0.002 | "
        "0.052 ± 0.002 |"
    ),
    "| accuracy, 8-bit attention logits | 0.147 ± 0.005 | 0.247 ± 0.005 | 0.347 ± 0.005 |",
    "| accuracy, 6-bit attention logits | 0.143 ± 0.003 | 0.243 ± 0.003 | 0.343 ± 0.003 |",
    "| accuracy, 4-bit attention logits | 0.139 ± 0.001 | 0.239 ± 0.001 | 0.339 ± 0.001 |",
    "| accuracy lost at 8 bits | +0.016 ± +0.008 | +0.016 ± +0.008 | +0.016 ± +0.008 |",
    "| accuracy lost at 6 bits | +0.020 ± +0.010 | +0.020 ± +0.010 | +0.020 ± +0.010 |",
    "| accuracy lost at 4 bits | +0.024 ± +0.012 | +0.024 ± +0.012 | +0.024 ± +0.012 |",
    "",
    (
        "Attention is the applied map (A, or DIFF's signed A1 − λA2) at the position that predicts "
        "each answer, last layer, mean over heads, queries and pair counts; *shares* divide each "
        "mass by the row's total (a differential row sums to 1 − λ), *signed mass* does not. Per "
        "layer and head figures are in results.json. Accuracy lost at b bits is the mean accuracy "
        "minus the accuracy with every attention logit quantized to b bits (dynamic absmax per "
        "head and row)."
    ),
    "",
    "- DIFF V1 λ (Eq.2): layer 1: 0.250 ± 0.050, layer 2: 0.340 ± 0.010",
    "- DIFF V2 mean sigmoid(x·W_λ): layer 1: 0.520 ± 0.020, layer 2: 0.600 ± 0.000",
    "",
    "DEVICES",
    "",
    "![retrieval_accuracy](retrieval_accuracy.png)",
    "",
]


def test_retrieval_section_lines_are_pinned(section):
    lines = section[0]
    assert lines == EXPECTED_LINES


def test_retrieval_section_data_plots_and_calls(section):
    _, data, plots, seen, per_type = section
    assert plots == [Path("out") / "retrieval_accuracy.png"]
    assert seen["evaluate"] == (True, list(MODELS), 2.5)
    assert seen["claimed"] == {"diff_v1", "diff_v2"}  # the papers' claims are about these
    assert seen["devices"] == [(a, s, "cuda:1" if s else "cpu") for a in MODELS for s in range(3)]
    assert list(data) == ["settings", "claims", "runs", "plots"]
    assert data["settings"]["grid"] == (2, 5, 8) and data["settings"]["context"] == 24
    assert data["runs"] is per_type
    assert data["plots"] == ["retrieval_accuracy.png"]
    assert data["claims"] == [
        {
            "key": "acc_mean",
            "claim": "higher accuracy",
            "source": "Tab 2",
            "model": "diff_v1",
            "differences": [0.1, 0.2],
            "mean": 0.15,
            "stderr": 0.05,
            "verdict": "supported",
            "paper_claim": True,
        }
    ]


def test_retrieval_section_without_the_baseline_has_no_claims(monkeypatch):
    monkeypatch.setattr(rr, "plot_accuracy", lambda out, s, p: None)
    monkeypatch.setattr(rr, "plot_attention", lambda out, p: None)
    monkeypatch.setattr(
        claims, "evaluate_claims", lambda *a, **k: pytest.fail("no claims without a baseline")
    )
    settings = RetrievalSettings(context=24, queries=2, grid=(2, 5, 8), filler=4, values=8)
    per_type = {"diff_v1": [run_entry("diff_v1", 0)]}
    lines, data, plots = rr.retrieval_section(Path("out"), settings, per_type)
    assert plots == [] and data["claims"] == [] and data["plots"] == []
    assert "CLAIMS" not in "\n".join(lines) and lines[3] == ""
    assert lines[4] == "### Retrieval measurements (mean ± sd over seeds)"
    assert "| accuracy, 2 pairs | 0.220 |" in lines
    assert lines[-3:] == ["- DIFF V1 λ (Eq.2): layer 1: 0.200, layer 2: 0.350", "", ""]
