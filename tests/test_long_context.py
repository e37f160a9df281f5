"""Context extension (DIFF V1 §3.3): length upsampling, the recipe, ``init_from``, ``widen``."""

from __future__ import annotations

import json
from collections import Counter

from extras import require_extra

pytestmark = require_extra("train")

import numpy as np
import pytest
import torch

from diffattn.cli import main
from diffattn.data.upsample import corpus_shape, plan_upsampling, upsample_corpus
from train_helpers import tiny_recipe, write_recipe

RECIPE = "src/diffattn/recipes/long_context.yaml"


def share_of_long(lengths, plan, source, threshold):
    picked = [lengths[s][i] + 1 for s, i in plan if s == source]
    long = [lengths[s][i] + 1 for s, i in plan if s == source and lengths[s][i] >= threshold]
    return sum(long) / sum(picked), sum(picked)


@pytest.fixture
def fixture_lengths():
    rng = np.random.default_rng(1)
    code = [int(x) for x in rng.integers(5, 90, 300)] + [400, 700, 1200, 2500]
    books = [int(x) for x in rng.integers(50, 200, 200)] + [
        int(x) for x in rng.integers(600, 3000, 8)
    ]
    return [code, books]


def test_upsampling_keeps_the_mixture_and_raises_the_long_share(fixture_lengths):
    threshold = 300
    plan = plan_upsampling(fixture_lengths, threshold, long_share=0.6, seed=0)
    totals = [sum(n + 1 for n in lengths) for lengths in fixture_lengths]
    corpus = sum(totals)
    longest = max(max(x) for x in fixture_lengths) + 1
    for source, lengths in enumerate(fixture_lengths):
        before = sum(n + 1 for n in lengths if n >= threshold) / totals[source]
        after, picked = share_of_long(fixture_lengths, plan, source, threshold)
        assert before < 0.6
        # each part overshoots its budget by less than one document
        assert abs(after - 0.6) < 2 * longest / picked
        assert abs(picked - totals[source]) <= 2 * longest  # the domain mixture is kept
    assert abs(sum(fixture_lengths[s][i] + 1 for s, i in plan) - corpus) <= 4 * longest


def test_each_document_appears_floor_or_ceil_of_its_repetition_factor(fixture_lengths):
    plan = plan_upsampling(fixture_lengths, 300, long_share=0.6, seed=3)
    copies = Counter(plan)
    long_code = [i for i, n in enumerate(fixture_lengths[0]) if n >= 300]
    counts = [copies[(0, i)] for i in long_code]
    assert max(counts) - min(counts) <= 1 and min(counts) >= 1
    short_code = [i for i, n in enumerate(fixture_lengths[0]) if n < 300]
    assert {copies[(0, i)] for i in short_code} <= {0, 1}  # short documents are thinned


def test_plan_is_seeded_and_a_source_already_long_enough_keeps_its_share(fixture_lengths):
    assert plan_upsampling(fixture_lengths, 300, 0.6, seed=5) == plan_upsampling(
        fixture_lengths, 300, 0.6, seed=5
    )
    assert plan_upsampling(fixture_lengths, 300, 0.6, seed=5) != plan_upsampling(
        fixture_lengths, 300, 0.6, seed=6
    )
    plan = plan_upsampling(fixture_lengths, 300, long_share=0.0, seed=0)
    own = sum(n + 1 for n in fixture_lengths[1] if n >= 300) / sum(
        n + 1 for n in fixture_lengths[1]
    )
    after, _ = share_of_long(fixture_lengths, plan, 1, 300)
    assert after == pytest.approx(own, abs=0.1)


def test_budget_scales_the_output():
    lengths = [[10] * 50 + [100] * 5]
    plan = plan_upsampling(lengths, 50, 0.5, budget=3000, seed=0)
    total = sum(lengths[0][i] + 1 for _, i in plan)
    assert 3000 <= total < 3000 + 2 * 101


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"long_share": 1.5}, "long_share"),
        ({"threshold": 0}, "threshold"),
        ({"budget": 0}, "budget"),
    ],
)
def test_bad_plans(kwargs, message):
    args = {"threshold": 10, "long_share": 0.5, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan_upsampling([[5, 20]], **args)
    with pytest.raises(ValueError, match="no documents"):
        plan_upsampling([[]], 10, 0.5)


def test_corpus_shape_counts_windows_as_the_loader_cuts_the_stream():
    # documents of 7, 2 and 11 tokens (+1 EOS each): stream 8 | 3 | 12 = 23 tokens,
    # windows of 8: [0,8) inside doc 0; [8,16) docs 1 and 2; 23 // 8 = 2 windows
    shape = corpus_shape([7, 2, 11], threshold=10, target_len=8)
    assert shape.tokens == 23 and shape.documents == 3
    assert shape.window_single_document == pytest.approx(0.5)
    assert shape.documents_per_window == pytest.approx(1.5)
    assert shape.long_share == pytest.approx(12 / 23)
    assert sum(shape.histogram.values()) == pytest.approx(1.0)


class WordTokenizer:
    name = "words"

    def encode(self, text):
        return text.split()


def test_upsample_corpus_writes_jsonl_and_statistics(tmp_path):
    short = [{"text": f"short {i} " + "w " * (i % 7)} for i in range(60)]
    long = [{"text": f"long {i} " + "w " * 200} for i in range(3)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in short + long))
    result = upsample_corpus(
        [str(source)],
        WordTokenizer(),
        tmp_path / "out",
        target_len=64,
        threshold=100,
        long_share=0.8,
    )
    lines = [json.loads(x)["text"] for x in result.path.read_text().splitlines()]
    assert set(lines) <= {d["text"] for d in short + long}
    assert sum(t.startswith("long") for t in lines) > 3  # long documents repeated
    assert result.before.long_share < 0.8 <= result.after.long_share + 0.1
    assert result.after.window_single_document > result.before.window_single_document
    assert result.after.documents_per_window < result.before.documents_per_window
    stats = json.loads(result.stats_path.read_text())
    assert stats["settings"]["threshold"] == 100 and stats["repeats"]["long_mean"] > 1


def test_recipe_loads_with_the_papers_settings():
    from diffattn.train import load_config

    config = load_config(RECIPE)
    assert config.model_config().rope_theta == 640_000
    assert config.optim.lr == pytest.approx(8e-5)
    assert config.seq_len > 128 and config.init_from is None


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """A tiny DIFF V1 model trained for 2 steps (the checkpoint to continue)."""
    root = tmp_path_factory.mktemp("long-context")
    recipe = write_recipe(root / "r.yaml", tiny_recipe(data_cache))
    argv = ["train", str(recipe), "--out", str(root / "a"), "--quiet", "--steps", "2"]
    assert main(argv) == 0
    return recipe, sorted((root / "a" / "checkpoints").iterdir())[-1]


def test_init_from_continues_with_rope_theta_raised_and_saves_the_change(
    tmp_path, trained, one_thread
):
    from diffattn.checkpoint import load_model, read_config
    from diffattn.train import Trainer, load_config

    recipe, checkpoint = trained
    overrides = [
        f"init_from={checkpoint}",
        "model.rope_theta=640000.0",
        "model.max_seq_len=128",
        "seq_len=64",
        "optim.lr=8e-5",
        "steps=3",
    ]
    config = load_config(recipe, overrides)
    trainer = Trainer(config, tmp_path / "b", progress=False).build()
    start = load_model(checkpoint).state_dict()
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, start[name], rtol=0, atol=0)
    assert trainer.model.config.rope_theta == 640_000
    expected = 1.0 / 640_000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    rotary = [m for m in trainer.model.modules() if hasattr(m, "inv_freq")]
    torch.testing.assert_close(rotary[0].inv_freq.float(), expected)
    trainer.close()
    result = Trainer(config, tmp_path / "c", progress=False).run()
    assert result.step == 3 and result.losses
    saved = read_config(result.checkpoint)
    assert saved.rope_theta == 640_000 and saved.max_seq_len == 128
    moved = load_model(result.checkpoint).state_dict()
    assert any(not torch.equal(moved[k], start[k]) for k in start)


def test_init_from_refuses_another_architecture_and_a_missing_directory(tmp_path, trained, capsys):
    recipe, checkpoint = trained
    out = tmp_path / "x"
    argv = ["train", str(recipe), "--out", str(out), "--quiet"]
    assert main([*argv, "--set", f"init_from={checkpoint}", "--set", "model.n_layers=3"]) == 2
    assert "n_layers" in capsys.readouterr().err
    assert main([*argv, "--set", f"init_from={tmp_path / 'nothing'}"]) == 2
    assert "not a diffattn model directory" in capsys.readouterr().err
    assert not out.exists()


def test_widen_copies_weights_with_a_longer_context(tmp_path, trained, capsys):
    from diffattn.checkpoint import load_model

    _, checkpoint = trained
    out = tmp_path / "wide"
    argv = ["long-context", "widen", str(checkpoint), "--max-seq-len", "256", "--out", str(out)]
    assert main([*argv, "--rope-theta", "640000"]) == 0
    wide, base = load_model(out), load_model(checkpoint)
    assert wide.config.max_seq_len == 256 and wide.config.rope_theta == 640_000
    for name, tensor in base.state_dict().items():
        assert torch.equal(wide.state_dict()[name], tensor)
    assert (out / "tokenizer.json").is_file()
    assert main(argv) == 2  # OUT exists
    assert (
        main(
            [
                "long-context",
                "widen",
                str(checkpoint),
                "--max-seq-len",
                "8",
                "--out",
                str(tmp_path / "w2"),
            ]
        )
        == 2
    )
    assert "below" in capsys.readouterr().err


def test_upsample_command(tmp_path, trained, capsys):
    _, checkpoint = trained
    words = [
        "the",
        "model",
        "reads",
        "a",
        "long",
        "document",
        "and",
        "predicts",
        "the",
        "next",
        "token",
    ]
    rows = [" ".join(words[: 3 + i % 8]) for i in range(80)]
    rows += [" ".join(words * (30 + i)) for i in range(4)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    out = tmp_path / "data"
    argv = [
        "long-context",
        "upsample",
        "--data",
        str(corpus),
        "--tokenizer",
        str(checkpoint),
        "--target-len",
        "256",
        "--long-share",
        "0.9",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "long share (>= 64)" in printed and "windows in one document" in printed
    stats = json.loads((out / "upsample.json").read_text())
    assert stats["before"]["long_share"] < 0.9 <= stats["after"]["long_share"] + 0.05
    assert len((out / "train.jsonl").read_text().splitlines()) == stats["after"]["documents"]
    bad = [*(value if value != "0.9" else "2" for value in argv[:-1]), str(tmp_path / "bad")]
    assert main(bad) == 2
    assert "long_share" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
