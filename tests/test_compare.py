"""``diffattn compare``: three matched runs on the same tokens, report, plots, re-runs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("yaml")
pytest.importorskip("tokenizers")

from diffattn.cli import main
from diffattn.compare import CompareOptions, default_recipe, plan_configs, run_compare

TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "class Stack:\n    def push(self, item):\n        self.items.append(item)\n"
)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(24):
        (root / f"doc{i:02d}.py").write_text(f"# document {i}\n" + TEXT * (3 + i % 4))
    return root


def small_options(tmp_path, corpus, **changes) -> CompareOptions:
    overrides = [
        f"data.sources=[{corpus}]",
        "data.tokenizer=bpe:300",
        "data.valid_fraction=0.2",
        "data.max_bytes=null",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.vocab_size=300",
        "model.d_model=32",
        "model.n_heads=4",
        "model.n_layers=2",
        "global_batch_size=4",
        "micro_batch_size=4",
        "seq_len=32",
        "schedule.warmup_steps=2",
        "log_every=1",
        "eval_every=3",
        "eval_batches=2",
        "checkpoint_every=6",
        "device=cpu",
    ]
    options = CompareOptions(out=tmp_path / "out", overrides=overrides, steps=6, progress=False)
    for key, value in changes.items():
        setattr(options, key, value)
    return options


def test_embedded_recipe_plans_three_matched_models():
    assert default_recipe().is_file()
    _, configs = plan_configs(CompareOptions())
    assert [a for a, _ in configs] == ["baseline", "diff_v1", "diff_v2"]
    from diffattn import count_parameters

    counts = [count_parameters(c.model_config()) for c in configs.values()]
    assert max(counts) / min(counts) - 1 < 1e-3
    assert (
        configs[("diff_v2", 0)].model_config().ffn_dim
        < configs[("baseline", 0)].model_config().ffn_dim
    )


def test_compare_writes_report_plots_and_reuses_finished_runs(tmp_path, corpus):
    result = run_compare(small_options(tmp_path, corpus))
    out = tmp_path / "out"
    report = (out / "report.md").read_text()
    for name in ("Transformer", "DIFF V1", "DIFF V2", "loss_curves.png", "lambda.png"):
        assert name in report
    for png in ("loss_curves.png", "lambda.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "report.json").read_text())
    rows = {row["attention"]: row for row in data["rows"]}
    assert set(rows) == {"baseline", "diff_v1", "diff_v2"}
    assert len({row["tokens"] for row in rows.values()}) == 1  # same tokens for every model
    params = [row["parameters"] for row in rows.values()]
    assert max(params) / min(params) - 1 < 0.01
    assert rows["baseline"]["final_lambda"] is None
    assert len(rows["diff_v1"]["final_lambda"]) == 2  # one λ per layer
    assert all(0 < v < 1 for v in rows["diff_v2"]["final_lambda"])  # mean sigmoid
    for run in result.runs:
        assert run.steps == 6 and [s for s, _ in run.val_curve] == [3, 6]
        assert run.final_val_loss == pytest.approx(run.val_curve[-1][1])

    # Same command again: finished runs are reused, nothing retrained.
    metrics = out / "runs" / "diff_v1-seed0" / "metrics.jsonl"
    before = metrics.read_text()
    again = run_compare(small_options(tmp_path, corpus))
    assert metrics.read_text() == before
    assert [r.final_val_loss for r in again.runs] == [r.final_val_loss for r in result.runs]

    # A different plan in the same OUT is refused; --overwrite replaces it.
    with pytest.raises(ValueError, match="different settings"):
        run_compare(small_options(tmp_path, corpus, steps=4))
    run_compare(small_options(tmp_path, corpus, steps=4, attentions=("baseline",), overwrite=True))
    assert not (out / "runs" / "diff_v1-seed0").exists()


def test_seeds_report_spread(tmp_path, corpus):
    options = small_options(tmp_path, corpus, seeds=2, attentions=("baseline", "diff_v1"))
    options.steps = 3
    options.overrides = [*options.overrides, "checkpoint_every=3"]
    result = run_compare(options)
    assert [(r.attention, r.seed) for r in result.runs] == [
        ("baseline", 0),
        ("diff_v1", 0),
        ("baseline", 1),
        ("diff_v1", 1),
    ]
    assert "±" in (tmp_path / "out" / "report.md").read_text()


def test_bad_settings_fail_before_any_file_is_written(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    code = main(["compare", "--out", str(out), "--set", "optim.colour=red"])
    assert code == 2
    assert "optim.colour" in capsys.readouterr().err
    assert not out.exists()
    assert main(["compare", "--out", str(out), "--seeds", "0"]) == 2
    assert main(["compare", "--out", str(out), "--preset", "huge"]) == 2
    assert "huge" in capsys.readouterr().err
    assert not out.exists()
