"""The retrieval experiment of ``diffattn compare``, scaled down, end to end."""

from __future__ import annotations

import json
import math

import pytest

from extras import require_extra

pytestmark = require_extra("train")


from diffattn.cli import main
from diffattn.compare import CompareOptions, run_compare
from diffattn.compare.retrieval import RetrievalSettings, measure

TINY = [
    "retrieval.context=24",
    "retrieval.queries=2",
    "retrieval.grid=[2,5,8]",
    "retrieval.d_model=16",
    "retrieval.n_heads=2",
    "retrieval.steps=3",
    "retrieval.warmup=1",
    "retrieval.batch_size=4",
    "retrieval.test_episodes=3",
    "retrieval.seeds=2",
    "retrieval.filler=4",
    "retrieval.values=8",
]


def test_scaled_down_retrieval_part_end_to_end(tmp_path, one_thread):
    out = tmp_path / "out"
    options = CompareOptions(
        out=out, overrides=TINY, part="retrieval", jobs=1, progress=False, device="cpu"
    )
    result = run_compare(options)
    assert result.runs == []  # the language-modelling part did not run
    report = (out / "report.md").read_text()
    assert "## Retrieval among distractors" in report and "Language modelling" not in report
    assert "*Uninformative*" in report  # the rule is stated
    for png in ("retrieval_accuracy.png", "retrieval_attention.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png in report
    data = json.loads((out / "results.json").read_text())["retrieval"]
    runs = data["runs"]
    assert set(runs) == {"baseline", "diff_v1", "diff_v2"} and all(
        len(r) == 2 for r in runs.values()
    )
    params = {r[0]["params"] for r in runs.values()}
    assert max(params) / min(params) - 1 < 0.02  # matched parameter counts
    claims = data["claims"]
    assert {c["key"] for c in claims} >= {"acc_mean", "answer_share", "noise_share", "qdrop_4"}
    for c in claims:
        assert c["verdict"] in ("supported", "not supported", "inconclusive", "uninformative")
    for attention, seeds in runs.items():
        for r in seeds:
            assert r["acc_mean"] == pytest.approx(sum(r[f"acc_{p}"] for p in (2, 5, 8)) / 3)
            assert r["acc_mid"] == r["acc_5"] and r["acc_hard"] == r["acc_8"]
            for bits in (8, 6, 4):
                assert r[f"qdrop_{bits}"] == pytest.approx(r["acc_mean"] - r[f"qacc_{bits}"])
            assert r["chance"] == 1 / 8
            for per_layer in r["attention"].values():  # per pair count, per layer, per head
                for entry in per_layer.values():
                    for h in range(len(entry["total"])):
                        parts = sum(entry[f"{k}_share"][h] for k in
                                    ("answer", "lookalike", "other", "rest"))  # fmt: skip
                        assert parts == pytest.approx(1.0, abs=1e-5)
            if attention == "baseline":
                assert r["lambda"] == {} and r["answer_mass"] == pytest.approx(r["answer_share"])
            elif attention == "diff_v1":
                assert len(r["lambda"]["lambda"]) == 2
            else:
                assert all(0 < v < 1 for v in r["lambda"]["lambda_mean"])
    # every model saw the same test episode in the attention picture
    tokens = {json.dumps(seeds[0]["example"]["tokens"]) for seeds in runs.values()}
    assert len(tokens) == 1
    # a re-run reuses every finished run
    cached = (out / "retrieval" / "diff_v2-seed1" / "retrieval.json").read_text()
    run_compare(options)
    assert (out / "retrieval" / "diff_v2-seed1" / "retrieval.json").read_text() == cached


def test_measure_takes_any_model_the_probe_observes(one_thread):
    """The researcher's entry point: an untrained model of the library measured directly."""
    import torch

    from diffattn import DiffTransformerLM

    settings = RetrievalSettings.from_dict(
        {k.split(".")[1].split("=")[0]: json.loads(k.split("=")[1]) for k in TINY}
    )
    torch.manual_seed(0)
    model = DiffTransformerLM(settings.model_config("diff_v1")).eval()
    results = measure(model, settings)
    assert 0 <= results["acc_mean"] <= 1 and not math.isnan(results["answer_share"])
    assert results == measure(model, settings)  # fixed test episodes


def test_bad_retrieval_settings_are_one_clear_error(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compare", "--out", str(out), "--set", "retrieval.colour=red"]) == 2
    assert "retrieval" in capsys.readouterr().err
    assert main(["compare", "--out", str(out), "--set", "retrieval.grid=[2,99]"]) == 2
    assert "pairs must be in" in capsys.readouterr().err
    assert not out.exists()


def test_the_recipe_and_the_python_defaults_agree():
    """``RetrievalSettings()`` in Python is what ``diffattn compare`` runs by default."""
    import yaml

    from diffattn.compare import default_recipe

    section = yaml.safe_load(default_recipe().read_text())["retrieval"]
    assert RetrievalSettings.from_dict(section) == RetrievalSettings()
