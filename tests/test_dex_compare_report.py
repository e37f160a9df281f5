"""``compare_methods`` without benchmarks, pinned: the order of its checks, report.json's keys
and rows, report.md line for line, what it prints, and a method that diverges."""

from __future__ import annotations

import json
import math

import pytest

from extras import require_extra

pytestmark = require_extra("train", "hf", "peft")

from dex_run_setup import tiny_llama_run
from diffattn.dex_compare import methods as dex_methods
from diffattn.dex_compare.methods import compare_methods, markdown_table

ROW_KEYS = [
    "method", "name", "lr", "trainable_parameters", "val_loss", "delta", "train_loss",
    "step_time_s", "status",
]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_llama_run(tmp_path_factory.mktemp("dex_compare_report"))


@pytest.fixture(scope="module")
def compared(setup):
    import contextlib
    import io

    out = setup["root"] / "out"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report = compare_methods(
            setup["model"], out, 2, setup["sets"], methods=["dex", "ft"], progress=False
        )
    return out, report, printed.getvalue()


def test_report_json_is_what_is_returned(compared):
    out, report, _ = compared
    assert json.loads((out / "report.json").read_text()) == report
    assert (out / "report.json").read_text() == json.dumps(report, indent=2, default=str) + "\n"
    assert list(report) == [
        "model", "steps", "tokens_per_step", "seed", "heads", "anneal_steps", "rows",
        "elapsed_s", "tokenizer", "plots",
    ]  # fmt: skip
    assert report["steps"] == 2 and report["anneal_steps"] == 1
    rows = report["rows"]
    assert [r["method"] for r in rows] == ["base", "dex", "ft"]
    assert list(rows[0]) == [
        "method", "name", "trainable_parameters", "lr", "val_loss", "delta", "train_loss",
        "step_time_s", "status",
    ]  # fmt: skip
    assert rows[0]["delta"] == 0.0 and rows[0]["lr"] is None
    for row in rows[1:]:
        assert list(row) == ROW_KEYS and row["status"] == "ok"
        assert row["delta"] == row["val_loss"] - rows[0]["val_loss"]
    assert [r["lr"] for r in rows[1:]] == [1e-4, 1e-5]
    assert report["plots"] in ([], ["loss_curves.png"])


def test_report_md_is_pinned(compared, setup):
    out, report, printed = compared
    md = (out / "report.md").read_text(encoding="utf-8")
    batch = report["tokens_per_step"] // 32
    plot = report["plots"]
    expected = [
        "# diffattn dex compare",
        "",
        f"Model `{setup['model']}`; every method trains 2 steps of {batch} × 32 tokens on the "
        f"same data in the same order (seed {report['seed']}), AdamW with a cosine schedule and "
        "3% warm-up (Dex paper App. F.1): peak learning rate 1e-4 for Dex and LoRA (q/k/v/o, "
        "α = 2r), 1e-5 for full fine-tuning. Held-out loss is the mean next-token loss on 2 "
        "held-out batches; Δ is against the pretrained model. Dex adapts the highest-entropy "
        f"half of each layer's heads (§3.2) with T = 1. Total wall time "
        f"{report['elapsed_s'] / 60:.1f} min.",
        "",
        markdown_table(report["rows"]),
        "",
        f"![loss curves]({plot[0]})" if plot else "(no plot: matplotlib)",
    ]
    assert md == "\n".join(expected) + "\n"
    assert printed == f"\n{markdown_table(report['rows'])}\n\nreport: {out / 'report.md'}\n"


def test_a_diverged_method_is_a_row_and_the_others_go_on(setup, monkeypatch, capsys):
    import diffattn.train as train_module

    real = train_module.train

    def train(config, run_dir, **kwargs):
        if run_dir.name == "dex":
            raise train_module.TrainingDiverged("loss is nan at step 1", 1, None)
        return real(config, run_dir, **kwargs)

    monkeypatch.setattr(train_module, "train", train)
    out = setup["root"] / "diverged"
    report = compare_methods(
        setup["model"], out, 2, setup["sets"], methods=["dex", "ft"], progress=False
    )
    dex, ft = report["rows"][1:]
    assert list(dex) == [
        "method", "name", "lr", "status", "val_loss", "delta", "trainable_parameters",
        "train_loss", "step_time_s",
    ]  # fmt: skip
    assert dex["status"] == "diverged: loss is nan at step 1"
    assert math.isnan(dex["val_loss"]) and math.isnan(dex["delta"])
    assert dex["trainable_parameters"] is None and ft["status"] == "ok"
    assert "| Dex | — | 0.0001 | nan | +nan | — | — |" in (out / "report.md").read_text()
    capsys.readouterr()


def test_checks_come_before_any_work(setup, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("loaded a model before refusing the input")

    monkeypatch.setattr(dex_methods, "resolve_source", fail)
    with pytest.raises(ValueError) as caught:
        compare_methods(setup["model"], setup["root"] / "x", 2, methods=["dex", "lora16"])
    assert str(caught.value) == (
        "methods must be among dex, lora8, lora32, ft, got ['dex', 'lora16']"
    )
    with pytest.raises(ValueError, match="methods must be among"):
        compare_methods(setup["model"], setup["root"] / "x", 2, methods=[])
    taken = setup["root"] / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    with pytest.raises(ValueError, match="--overwrite"):
        compare_methods(setup["model"], taken, 2, methods=["dex"])
    assert (taken / "file").read_text() == "x"
