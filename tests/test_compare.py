"""``diffattn compare``: three matched runs on the same tokens, report, plots, re-runs."""

from __future__ import annotations

import json

import pytest
import torch

from extras import require_extra

pytestmark = require_extra("train", "hf")


from diffattn.cli import main
from diffattn.compare import CompareOptions, default_recipe, plan_configs, run_compare
from diffattn.compare.evaluate import EvalSettings

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
    options = CompareOptions(
        out=tmp_path / "out",
        overrides=overrides,
        steps=6,
        seeds=1,
        jobs=1,
        progress=False,
        evaluate=False,
        part="lm",
    )
    for key, value in changes.items():
        setattr(options, key, value)
    return options


def test_embedded_recipe_plans_three_matched_models():
    assert default_recipe().is_file()
    _, configs = plan_configs(CompareOptions())
    assert list(configs) == [(a, s) for s in (0, 1, 2) for a in ("baseline", "diff_v1", "diff_v2")]
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
    data = json.loads((out / "results.json").read_text())
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


def test_scaled_down_compare_measures_and_judges_every_model(tmp_path, one_thread):
    """The whole main job end to end, scaled down: the synthetic retrieval mix, two seeds,
    every measurement on every model, the claims table, plots, results.json, and a re-run that
    reuses the finished measurements."""
    overrides = [
        'data.sources=["synthetic:recall?docs=300&pairs=4&queries=3",'
        '"synthetic:needle?docs=200&needles=2&words=20"]',
        "data.tokenizer=bpe:400",
        "data.valid_fraction=0.1",
        "data.max_bytes=null",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.vocab_size=400",
        "model.d_model=32",
        "model.n_heads=4",
        "model.n_layers=2",
        "global_batch_size=4",
        "micro_batch_size=4",
        "seq_len=96",
        "schedule.warmup_steps=1",
        "log_every=1",
        "eval_every=2",
        "eval_batches=1",
        "checkpoint_every=2",
        "device=cpu",
    ]
    settings = EvalSettings(
        needle_cells=((1, 1), (2, 2)), needle_depths=(0.0, 100.0), needle_samples=2,
        max_tokens=600, batch_size=8,
    )  # fmt: skip
    options = CompareOptions(
        out=tmp_path / "out", overrides=overrides, steps=2, seeds=2, progress=False,
        eval_settings=settings, jobs=2, part="lm",
    )  # fmt: skip
    result = run_compare(options)  # two worker processes
    out = tmp_path / "out"
    for run in result.runs:
        e = run.evals
        assert 0 <= e["needle_1_1"] <= 1 and 0 <= e["needle_2_2"] <= 1
        assert e["needle_acc"] == pytest.approx((e["needle_1_1"] + e["needle_2_2"]) / 2)
        assert 0 < e["answer_share"] < 1 and 0 < e["noise_share"] < 1
        assert 0 <= e["recall_acc"] <= 1 and e["recall_n"] == 24 * 3  # the mix's 3 queries
        assert e["logit_top1"] >= e["logit_median"] > 0
        assert e["hidden_top1"] >= e["hidden_median"] > 0
        for bits in (8, 6, 4):
            assert e[f"quant_gap_{bits}"] == pytest.approx(e[f"quant_loss_{bits}"] - e["val_loss"])
        assert e["ar_hit"] > 0 and e["others"] > 0 and e["counts"]["ar_hit"] > 0
        assert (out / "runs" / f"{run.attention}-seed{run.seed}" / "eval.json").is_file()
    # every model is measured on the same held-out windows
    windows = {len(r.evals["window_loss"]) for r in result.runs}
    assert len(windows) == 1

    data = json.loads((out / "results.json").read_text())
    claims = data["claims"]
    assert {c["model"] for c in claims} == {"diff_v1", "diff_v2"}
    assert {c["key"] for c in claims} >= {"val_loss", "ar_hit", "needle_acc", "noise_share"}
    for c in claims:
        assert len(c["differences"]) == 2
        if c["key"] in ("recall_acc", "needle_acc", "needle_6_2", "answer_share", "noise_share"):
            # gated on the baseline's accuracy, at the floor in a run this short
            assert c["verdict"] == "uninformative"
        else:
            assert c["verdict"] in ("supported", "not supported", "inconclusive")
    loss_claim = next(c for c in claims if c["key"] == "val_loss" and c["model"] == "diff_v1")
    by = {(r.attention, r.seed): r.evals["val_loss"] for r in result.runs}
    assert loss_claim["differences"] == pytest.approx(
        [by[("diff_v1", s)] - by[("baseline", s)] for s in (0, 1)]
    )
    report = (out / "report.md").read_text()
    assert "| claim | source | paper (DIFF vs Transformer) | model |" in report
    assert "Verdict rule" in report and "validation set large enough" in report
    for png in ("loss_curves.png", "lambda.png", "evals.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png in report

    # A re-run reuses the trained models and their measurements.
    cached = (out / "runs" / "diff_v2-seed1" / "eval.json").read_text()
    options.jobs = 1  # in this process this time
    again = run_compare(options)
    assert (out / "runs" / "diff_v2-seed1" / "eval.json").read_text() == cached
    assert [r.evals["val_loss"] for r in again.runs] == [r.evals["val_loss"] for r in result.runs]


def test_jobs_resolution():
    from diffattn.compare import resolve_jobs

    jobs, threads = resolve_jobs(None, 9, "cpu")
    assert 1 <= jobs <= 9 and (threads is None) == (jobs == 1)
    assert resolve_jobs(1, 9, "cpu") == (1, None)
    assert resolve_jobs(4, 2, "cpu")[0] == 2  # never more workers than runs
    assert resolve_jobs(None, 9, "cuda") == (1, None)
    with pytest.raises(ValueError, match="--jobs"):
        resolve_jobs(0, 9, "cpu")


def test_needles_are_asked_with_the_digits_the_mix_trains():
    from diffattn.compare.language_modelling import needle_settings_for

    mix = ["synthetic:recall", "synthetic:needle?docs=10&digits=3", "stdlib"]
    assert needle_settings_for(EvalSettings(), mix).needle_digits == 3
    assert needle_settings_for(EvalSettings(), ["stdlib"]).needle_digits == 7
    with pytest.raises(ValueError, match="needle cells"):
        EvalSettings(needle_cells=((2, 3),))


def test_claims_loss_windows_are_the_trainers_validation_windows(tmp_path):
    """compare's held-out windows (claims table) are exactly the rows the trainer validates on
    (training summary, loss plot): one validation loss, whatever the mix's source order."""
    import numpy as np

    from diffattn.compare.evaluate import held_out_windows
    from diffattn.data.loader import eval_batches
    from diffattn.data.shards import ShardSet, ShardWriter

    writer = ShardWriter(
        tmp_path / "valid", vocab_size=500, eos_id=0, tokenizer_name="t", shard_tokens=1000
    )
    rng = np.random.default_rng(0)
    for _ in range(40):
        writer.add(rng.integers(1, 500, size=int(rng.integers(20, 90))))
    writer.close()
    valid = ShardSet.open(tmp_path / "valid")
    seq_len, batch, batches = 16, 4, 3
    trainer_rows = torch.cat(list(eval_batches(valid, batch, seq_len, batches)))
    held_out = held_out_windows(valid, seq_len, batches * batch * seq_len)
    assert torch.equal(trainer_rows, torch.tensor(held_out.windows, dtype=trainer_rows.dtype))
    # spread over the stream, not its first windows
    assert held_out.windows[-1] != [
        int(t) for t in valid.read((batches * batch - 1) * seq_len, seq_len)
    ]


def test_parallel_runs_are_reported_as_each_one_finishes(tmp_path):
    """The language-modelling part prints a line per finished run, not one burst at the end."""
    import time

    from compare_timed_runs import sleeping_run
    from diffattn.compare import _Job, _run_parallel

    work = [
        _Job("baseline", 0, None, tmp_path / "a", False, 1, None, None),
        _Job("diff_v1", 6, None, tmp_path / "b", False, 1, None, None),
        _Job("diff_v2", 0, None, tmp_path / "c", False, 1, None, None),
    ]
    lines = []
    started = time.perf_counter()
    done = _run_parallel(
        work,
        2,
        1,
        lambda line: lines.append((time.perf_counter() - started, line)),
        run=sleeping_run,
    )
    assert sorted(done) == [0, 1, 2]
    finished = [(at, line) for at, line in lines if line.startswith("[")]
    assert [line.split("]")[0] for _, line in finished] == ["[1/3", "[2/3", "[3/3"]
    assert "diff_v1" in finished[-1][1]  # the long run finishes last ...
    assert finished[-1][0] - finished[0][0] >= 3  # ... seconds after the first was reported


def _without_timings(value):
    timing = ("seconds", "cpu_seconds", "train_seconds", "train_cpu_seconds", "device")
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in timing}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def test_both_parts_in_one_pool_give_the_results_of_each_part_alone(tmp_path, corpus, monkeypatch):
    """``--part all`` on two workers runs both parts in one pool (diffattn.compare.schedule):
    every retrieval result and every training loss equals that of the part run on its own."""
    from diffattn.compare import schedule

    used = []
    run_both = schedule.run_both
    monkeypatch.setattr(schedule, "run_both", lambda *a, **k: used.append(1) or run_both(*a, **k))
    retrieval = [
        "retrieval.steps=4", "retrieval.seeds=1", "retrieval.test_episodes=2",
        "retrieval.d_model=16", "retrieval.grid=[4, 6]", "retrieval.bits=[8]",
    ]  # fmt: skip

    def options(out, part):
        chosen = small_options(tmp_path, corpus, part=part, jobs=2, out=tmp_path / out)
        chosen.overrides = (*chosen.overrides, *retrieval)
        chosen.attentions = ("baseline", "diff_v1")
        return chosen

    together = run_compare(options("together", "all"))
    assert used == [1]
    run_compare(options("retrieval-alone", "retrieval"))
    alone = run_compare(options("lm-alone", "lm"))
    assert used == [1]  # a single part runs on its own
    for attention in ("baseline", "diff_v1"):
        name = f"{attention}-seed0"
        a = json.loads((tmp_path / "together" / "retrieval" / name / "retrieval.json").read_text())
        b = json.loads(
            (tmp_path / "retrieval-alone" / "retrieval" / name / "retrieval.json").read_text()
        )
        assert _without_timings(a) == _without_timings(b)
    assert [r.train_curve for r in together.runs] == [r.train_curve for r in alone.runs]
    assert [r.lambda_curve for r in together.runs] == [r.lambda_curve for r in alone.runs]
    assert [r.final_val_loss for r in together.runs] == [r.final_val_loss for r in alone.runs]
