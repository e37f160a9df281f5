"""``diffattn dex compare`` with benchmarks: the pretrained model, Dex, LoRA r=8 and full
fine-tuning of a tiny Hugging Face Llama trained on the same data, each measured on zero-shot
multiple choice, needle retrieval and the synthetic many-shot ICL task."""

from __future__ import annotations

import json

import pytest
import torch

from extras import require_extra

pytestmark = require_extra("train", "hf", "peft")

import yaml

from diffattn.cli import main
from diffattn.dex_compare.benchmarks import BenchmarkSettings, verdict
from diffattn.eval import mc
from diffattn.eval.common import load_models
from helpers import WORDS, tiny_hf, word_corpus


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dex_compare")
    corpus, tokenizer = word_corpus(root, 200)
    model_dir = root / "llama"
    tiny_hf("llama", vocab_size=tokenizer.vocab_size, max_position_embeddings=512).save_pretrained(
        model_dir
    )
    tokenizer.save(model_dir)
    items = [
        {"query": f"{a} {b} then", "choices": [f" {c}", f" {a} {b}", " omega"], "gold": i % 3}
        for i, (a, b, c) in enumerate(zip(WORDS, WORDS[1:], WORDS[2:], strict=False))
    ]
    data = root / "words.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in items[:6]))
    sets = [
        f"data.sources=[{corpus}]",
        "data.document_split=paragraph",
        "data.valid_fraction=0.2",
        f"data.cache_dir={root / 'cache'}",
        "seq_len=32",
        "eval_batches=2",
        "device=cpu",
    ]
    benchmarks = {
        "mc_tasks": ["words"],
        "mc_data": [str(data)],
        "mc_limit": 5,
        "needle_needles": 2,
        "needle_lengths": [240],
        "needle_depths": [0, 100],
        "needle_samples": 2,
        "icl_classes": 4,
        "icl_shots": [1, 3],
        "icl_test_items": 6,
        "icl_budget": 400,
        "batch_size": 4,
    }
    recipe = {"steps": 2, "methods": ["dex", "lora8", "ft"], "set": sets, "benchmarks": benchmarks}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return {"root": root, "model": model_dir, "recipe": path, "data": data, "raw": recipe}


@pytest.fixture(scope="module")
def compared(tiny):
    out = tiny["root"] / "cmp"
    argv = ["dex", "compare", str(tiny["model"]), "--recipe", str(tiny["recipe"])]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    return out


def test_four_way_comparison_writes_every_output(compared):
    results = json.loads((compared / "results.json").read_text())
    rows = results["results"]["rows"]
    assert [r["method"] for r in rows] == ["base", "dex", "lora8", "ft"]
    keys = {
        "mc/words",
        "mc/mean",
        "needle",
        "needle/answer_mass",
        "needle/noise_mass",
        "icl/1-shot",
        "icl/3-shot",
    }
    for row in rows:
        assert row["status"] == "ok" and row["val_loss"] > 0
        assert set(row["benchmarks"]) == keys
        assert all(0 <= row["benchmarks"][k]["value"] <= 1 for k in keys if "mass" not in k)
        assert set(row["eval_timings"]) == {"mc", "needle", "icl"}
        assert all(
            t["seconds"] > 0 and t["seconds_per_item"] > 0 for t in row["eval_timings"].values()
        )
    raw = results["results"]["benchmarks"]
    assert set(raw) == {"base", "dex", "lora8", "ft"}
    assert raw["dex"]["mc"]["result"]["tasks"]["words"]["items"] == 5
    assert len(raw["ft"]["needle"]["result"]["models"]["ft"]["cells"]) == 2
    assert raw["lora8"]["icl"]["result"]["test_items"] == 6
    assert results["settings"]["needle_lengths"] == [240]
    assert results["figures"] == ["loss_curves.png", "benchmarks.png"]
    assert (compared / "benchmarks.png").stat().st_size > 1000
    assert json.loads((compared / "report.json").read_text())["rows"][1]["benchmarks"]
    md = (compared / "report.md").read_text()
    assert "## Benchmarks" in md and "Dex against LoRA r=8" in md and "overall: Dex" in md
    assert md.count("| full fine-tuning |") == 2  # the training table and the benchmark table


def test_base_row_equals_eval_mc_on_the_pretrained_model(tiny, compared):
    results = json.loads((compared / "results.json").read_text())
    ours = results["results"]["benchmarks"]["base"]["mc"]["result"]["models"]["base"]["words"]
    (model,) = load_models([str(tiny["model"])])
    direct = mc.run([model], tasks=["words"], data=[str(tiny["data"])], limit=5, batch_size=4)
    theirs = direct["models"][model.name]["words"]
    for a, b in zip(ours["samples"], theirs["samples"], strict=True):
        torch.testing.assert_close(
            torch.tensor(a["loglikelihoods"]), torch.tensor(b["loglikelihoods"]), rtol=0, atol=1e-5
        )
    assert ours["acc_norm"] == theirs["acc_norm"]


def test_trained_models_differ_from_the_base_where_they_trained(compared):
    raw = json.loads((compared / "results.json").read_text())["results"]["benchmarks"]

    def lls(method):
        samples = raw[method]["mc"]["result"]["models"][method]["words"]["samples"]
        return torch.tensor([s["loglikelihoods"] for s in samples])

    base = lls("base")
    for method in ("dex", "lora8", "ft"):
        assert not torch.allclose(lls(method), base, atol=1e-7), method


@pytest.mark.parametrize(
    ("benchmarks", "message"),
    [
        ({"needle_lenghts": [64]}, "needle_lenghts"),
        ({"evals": ["mc", "squad"]}, "evals"),
        ({"mc_tasks": ["nonesuch"]}, "unknown task 'nonesuch'"),
        ({"icl_shots": ["many"]}, "--shots"),
        ({"needle_samples": 0}, "needle_samples"),
    ],
)
def test_bad_recipe_is_one_error_before_training(tiny, tmp_path, capsys, benchmarks, message):
    recipe = {**tiny["raw"], "benchmarks": {**tiny["raw"]["benchmarks"], **benchmarks}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    argv = ["dex", "compare", str(tiny["model"]), "--recipe", str(path), "--out", str(out)]
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_unknown_recipe_key_and_missing_file(tiny, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"stepz": 3}))
    argv = ["dex", "compare", str(tiny["model"]), "--out", str(tmp_path / "o"), "--quiet"]
    assert main([*argv, "--recipe", str(path)]) == 2
    assert "stepz" in capsys.readouterr().err
    assert main([*argv, "--recipe", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err


def _row(method, loss, value, stderr=0.01):
    figure = {"value": value, "stderr": stderr}
    return {
        "method": method,
        "name": method,
        "status": "ok",
        "val_loss": loss,
        "benchmarks": {"mc/mean": figure, "needle": figure},
    }


def test_verdict_counts_only_differences_beyond_two_standard_errors():
    assert "dex beats lora8" in verdict([_row("dex", 2.0, 0.6), _row("lora8", 2.1, 0.5)])
    tie = verdict([_row("dex", 2.0, 0.51), _row("lora8", 2.1, 0.5)])
    assert "does not beat" in tie and "(tie)" in tie
    assert "does not beat" in verdict([_row("dex", 2.2, 0.6), _row("lora8", 2.1, 0.5)])
    assert verdict([_row("dex", 2.0, 0.6)]) == ""


def test_settings_round_trip():
    settings = BenchmarkSettings.from_dict({"mc_limit": 7, "needle_lengths": [128, 256]})
    assert settings.needle_lengths == (128, 256)
    assert BenchmarkSettings.from_dict(settings.to_dict()) == settings


def test_shipped_dex_recipes_load():
    from pathlib import Path

    from diffattn.dex_compare import load_recipe

    recipes = sorted((Path(__file__).parent.parent / "configs" / "dex").glob("*.yaml"))
    assert [p.name for p in recipes] == ["smollm2-smoke.yaml", "smollm2.yaml"]
    for path in recipes:
        recipe = load_recipe(path)
        assert recipe["steps"] > 0 and recipe["benchmarks"] is not None
