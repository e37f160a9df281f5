"""diffattn eval loss: AR-Hit slicing by hand, losses equal the model's, the command's outputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffattn.checkpoint import save_model
from diffattn.cli import main
from diffattn.data import train_bpe
from diffattn.eval import loss as eval_loss
from diffattn.eval.common import load_models
from helpers import tiny_diffattn

TEXTS = [
    "def add(a, b):\n    return a + b\n" * 3,
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n" * 4,
    "for i in range(10):\n    print(i * i)\n" * 5,
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_loss")
    tokenizer = train_bpe(TEXTS * 20, 300, cache_dir=root / "bpe")
    dirs = {}
    for attention in ("baseline", "diff_v1"):
        model = tiny_diffattn(attention, vocab_size=tokenizer.vocab_size, max_seq_len=256)
        dirs[attention] = save_model(model, root / attention, tokenizer=tokenizer)
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXTS):
        (corpus / f"doc{i}.txt").write_text(text)
    return dirs, corpus


def test_ar_hit_marks_repeated_bigrams():
    ids = [5, 6, 7, 5, 6, 8, 5, 6, 7]
    # targets are positions 1..8; bigram (5,6) repeats at 4 and 7, (6,7) at 8
    assert eval_loss.ar_hit_mask(ids, 2) == [False, False, False, True, False, False, True, True]
    assert eval_loss.ar_hit_mask(ids, 3) == [False] * 7 + [True]  # only (5,6,7) repeats
    assert eval_loss.ar_hit_mask(ids, 2, exclude={(5, 6)}) == [False] * 7 + [True]
    assert eval_loss.frequent_ngrams([ids], 2, 1) == {(5, 6)}


def test_windows_cut_documents_and_respect_the_budget():
    pieces, owner = eval_loss.windows([list(range(10)), list(range(3))], 4, 100)
    assert pieces == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2]]
    assert owner == [0, 0, 0, 1]
    assert len(eval_loss.windows([list(range(10))], 4, 9)[0]) == 2


def test_losses_equal_the_models_own_and_slices_partition_the_tokens(model_dirs):
    dirs, corpus = model_dirs
    models = load_models([str(dirs["baseline"]), str(dirs["diff_v1"])])
    result = eval_loss.run(
        models, data=[str(corpus)], split="all", seq_len=32, max_tokens=10_000, batch_size=3
    )
    for model in models:
        r = result["models"][model.name]
        tokenizer = model.tokenizer
        pieces, _ = eval_loss.windows([tokenizer.encode(t) for t in TEXTS], 32, 10_000)
        total, count = 0.0, 0
        for piece in pieces:
            ids = torch.tensor([piece])
            with torch.no_grad():
                out = model.model(ids, labels=ids)
            total += float(out.loss) * (len(piece) - 1)
            count += len(piece) - 1
        assert r["loss"] == pytest.approx(total / count, rel=1e-5)
        counts = r["counts"]
        assert counts["ar_hit"] + counts["others"] == counts["tokens"] == count
        mixed = (r["ar_hit"] * counts["ar_hit"] + r["others"] * counts["others"]) / count
        assert mixed == pytest.approx(r["loss"], rel=1e-9)
        assert counts["ar_hit"] > 0  # the texts repeat themselves
        assert len(r["cumulative_nll"]) == 31


def test_command_writes_results_report_and_plot(model_dirs, tmp_path):
    dirs, corpus = model_dirs
    out = tmp_path / "out"
    code = main(
        [
            "eval",
            "loss",
            str(dirs["baseline"]),
            "--compare",
            str(dirs["diff_v1"]),
            "--data",
            str(corpus),
            "--split",
            "all",
            "--seq-len",
            "32",
            "--max-tokens",
            "2000",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    record = json.loads((out / "results.json").read_text())
    assert record["experiment"] == "loss" and len(record["models"]) == 2
    assert set(record["results"]["models"]) == {"baseline", "diff_v1"}
    assert {"loss", "ar_hit", "others", "counts", "cumulative_nll"} <= set(
        record["results"]["models"]["baseline"]
    )
    assert record["settings"]["seed"] == 0 and record["data_fingerprint"]
    assert (out / "cumulative_nll.png").stat().st_size > 0
    assert "AR-Hit" in (out / "report.md").read_text()
    assert not math.isnan(record["results"]["models"]["diff_v1"]["loss"])


def test_bad_arguments_are_one_line(model_dirs, tmp_path, capsys):
    dirs, corpus = model_dirs
    code = main(
        [
            "eval",
            "loss",
            str(dirs["baseline"]),
            "--data",
            str(corpus),
            "--split",
            "all",
            "--seq-len",
            "9999",
            "--out",
            str(tmp_path / "x"),
            "--quiet",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "exceeds" in err[0]
    code = main(["eval", "loss", str(tmp_path / "missing"), "--out", str(tmp_path / "y")])
    assert code == 2
