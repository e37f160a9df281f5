"""``diffattn scaling``: power-law fits, their inversion, sweeps and bad input (DIFF V1 Fig 3)."""

from __future__ import annotations

import json
import math

from extras import require_extra

pytestmark = require_extra("train", "eval")

import numpy as np
import pytest

from diffattn.cli import main
from diffattn.scaling import (
    ScalingOptions,
    fit_power_law,
    fit_results,
    parse_size,
    plan_runs,
    run_scaling,
    share_needed,
)
from train_helpers import tiny_recipe, write_recipe

SIZES = np.geomspace(1e6, 1e10, 7)


def law(n, a, alpha, c):
    return a * np.asarray(n, dtype=float) ** (-alpha) + c


@pytest.mark.parametrize(
    ("a", "alpha", "c"), [(400.0, 0.3, 1.7), (12.0, 0.076, 0.5), (3e3, 0.6, 2.2)]
)
def test_fit_recovers_known_parameters_exactly_without_noise(a, alpha, c):
    fit = fit_power_law(SIZES, law(SIZES, a, alpha, c))
    assert fit.a == pytest.approx(a, rel=1e-5)
    assert fit.alpha == pytest.approx(alpha, rel=1e-5)
    assert fit.c == pytest.approx(c, rel=1e-5, abs=1e-7)
    assert fit.rmse < 1e-7 and fit.at_bound == []


def test_fit_recovers_parameters_within_their_uncertainties_under_noise():
    rng = np.random.default_rng(0)
    a, alpha, c = 400.0, 0.3, 1.7
    sizes = np.geomspace(1e6, 1e10, 12)
    fit = fit_power_law(sizes, law(sizes, a, alpha, c) + rng.normal(0, 0.003, len(sizes)))
    for value, error, truth in (
        (fit.a, fit.a_err, a),
        (fit.alpha, fit.alpha_err, alpha),
        (fit.c, fit.c_err, c),
    ):
        assert error is not None and error > 0
        assert abs(value - truth) < 4 * error
    assert fit.rmse == pytest.approx(0.003, rel=0.6)


def test_share_is_exact_for_a_known_pair_of_laws():
    # same α and c, DIFF's a is 0.75× the Transformer's: L_D(N_D) = L_T(N_T) exactly when
    # N_D = 0.75^(1/α)·N_T, whatever N_T
    transformer = fit_power_law(SIZES, law(SIZES, 400.0, 0.3, 1.7))
    diff = fit_power_law(SIZES, law(SIZES, 300.0, 0.3, 1.7))
    expected = 0.75 ** (1 / 0.3)
    for reference in (1e7, 1e9, 11e9):
        forward = share_needed(transformer, diff, reference, "transformer")
        backward = share_needed(transformer, diff, reference, "diff")
        assert forward.share == pytest.approx(expected, rel=1e-6)
        assert backward.share == pytest.approx(expected, rel=1e-6)
        assert forward.diff == pytest.approx(expected * reference, rel=1e-6)
        assert backward.transformer == pytest.approx(reference / expected, rel=1e-6)
        assert forward.low <= forward.share <= forward.high


def test_share_with_different_exponents_matches_the_closed_form():
    t = (400.0, 0.30, 1.7)
    d = (250.0, 0.28, 1.65)
    transformer = fit_power_law(SIZES, law(SIZES, *t))
    diff = fit_power_law(SIZES, law(SIZES, *d))
    n_t = 11e9
    target = law(n_t, *t)
    n_d = (d[0] / (target - d[2])) ** (1 / d[1])
    assert share_needed(transformer, diff, n_t).share == pytest.approx(n_d / n_t, rel=1e-5)


def test_share_is_infinite_when_diff_floor_lies_above_the_loss():
    transformer = fit_power_law(SIZES, law(SIZES, 400.0, 0.3, 1.0))
    diff = fit_power_law(SIZES, law(SIZES, 100.0, 0.3, 2.5))
    share = share_needed(transformer, diff, 1e10)
    assert math.isinf(share.share) and share.low is None


def test_three_points_fit_exactly_without_uncertainty():
    sizes = [1e6, 1e7, 1e8]
    fit = fit_power_law(sizes, law(sizes, 50.0, 0.25, 2.0))
    assert fit.covariance is None and fit.alpha_err is None
    assert fit.predict(1e7) == pytest.approx(law(1e7, 50.0, 0.25, 2.0), rel=1e-6)


@pytest.mark.parametrize(
    ("sizes", "losses", "message"),
    [
        ([1e6, 1e7], [3.0, 2.9], "2 point"),
        ([1e6, 1e6, 1e7], [3.0, 3.0, 2.9], "distinct"),
        ([1e6, 1e7, -1.0], [3.0, 2.9, 2.8], "positive"),
        ([1e6, 1e7, 1e8], [3.0, float("nan"), 2.8], "finite"),
        ([1e6, 1e7, 1e8], [3.0, 2.9], "same length"),
    ],
)
def test_impossible_fits_raise_one_clear_error(sizes, losses, message):
    with pytest.raises(ValueError, match=message):
        fit_power_law(sizes, losses, "DIFF V1")


def test_a_flat_or_rising_series_ends_on_a_bound_and_says_so():
    fit = fit_power_law([1e6, 1e7, 1e8, 1e9], [3.0, 3.05, 3.1, 3.2])
    assert fit.at_bound


def test_parse_size():
    assert parse_size("tiny").preset == "tiny"
    size = parse_size("tiny:d_model=64,n_heads=4")
    assert size.preset == "tiny" and size.overrides == (("d_model", 64), ("n_heads", 4))
    assert parse_size("d_model=96").as_overrides() == ["model.d_model=96"]
    with pytest.raises(ValueError, match="key=value"):
        parse_size("tiny:d_model")


def write_points(path, rows):
    path.write_text(json.dumps(rows))
    return path


def test_from_results_json_and_csv_write_report_figure_and_results(tmp_path):
    rows = [
        {"attention": attention, "parameters": n, "loss": float(law(n, a, 0.3, 1.7))}
        for attention, a in (("baseline", 400.0), ("diff_v1", 300.0))
        for n in SIZES
    ]
    fit_results([write_points(tmp_path / "p.json", rows)], tmp_path / "out", progress=False)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    share = results["shares"]["diff_v1"][0]["share"]
    assert share == pytest.approx(0.75 ** (1 / 0.3), rel=1e-5)
    assert "62.2%" in (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "scaling.png").read_bytes()[:4] == b"\x89PNG"

    csv_path = tmp_path / "p.csv"
    csv_path.write_text(
        "attention,x,loss\n"
        + "".join(f"{r['attention']},{r['parameters']},{r['loss']}\n" for r in rows)
    )
    again = fit_results([csv_path], tmp_path / "out2", progress=False)
    assert again["fits"]["diff_v1"].a == pytest.approx(300.0, rel=1e-4)
    # results.json of a run is itself an input
    third = fit_results([tmp_path / "out" / "results.json"], tmp_path / "out3", progress=False)
    assert third["fits"]["baseline"].alpha == pytest.approx(0.3, rel=1e-5)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"attention": "baseline", "x": 1e6, "loss": 3.0}], "another arm"),
        ([{"attention": "gpt", "x": 1e6, "loss": 3.0}], "unknown attention type 'gpt'"),
        ([{"attention": "diff_v1:colour=red", "x": 1e6, "loss": 3.0}], "no option of diff_v1"),
        ([{"attention": "baseline", "loss": 3.0}], "no x value"),
        ([{"attention": "baseline", "x": "big", "loss": 3.0}], "must be numbers"),
        (
            [
                {"attention": a, "x": x, "loss": 3.0 - x / 1e7}
                for a in ("baseline", "diff_v1")
                for x in (1e6, 2e6)
            ],
            "2 point",
        ),
    ],
)
def test_from_results_bad_points(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        fit_results([write_points(tmp_path / "p.json", rows)], tmp_path / "out", progress=False)


def test_cli_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert main(["scaling", "--sizes", "tiny", "small", "--out", str(tmp_path / "o")]) == 2
    assert "at least 3 sizes" in capsys.readouterr().err
    assert (
        main(["scaling", "--attention", "diff_v1", "diff_v2", "--sizes", "a=1", "b=2", "c=3"]) == 2
    )
    assert "baseline" in capsys.readouterr().err
    assert main(["scaling", "--axis", "tokens", "--tokens", "100", "200"]) == 2
    assert "3 token counts" in capsys.readouterr().err
    assert main(["scaling", "--from-results", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["scaling", "--from-results", "x.json", "--sizes", "tiny"]) == 2
    assert "trains nothing" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture
def recipe(tmp_path, data_cache):
    """The trainer tests' tiny recipe (shared data cache), validated every 2 steps."""
    changes = {"schedule": {"warmup_steps": 1, "total_steps": None}, "eval_every": 2}
    return write_recipe(tmp_path / "recipe.yaml", tiny_recipe(data_cache, **changes))


def test_invalid_recipe_values_fail_before_any_file(tmp_path, recipe):
    options = ScalingOptions(
        out=tmp_path / "out",
        sizes=("d_model=16,n_heads=2", "d_model=32,n_heads=4", "d_modle=48"),
        config=recipe,
        steps=3,
        progress=False,
    )
    with pytest.raises(ValueError, match="model"):
        plan_runs(options)
    assert not (tmp_path / "out").exists()


def test_tokens_axis_plans_one_run_per_type_evaluated_at_each_count(tmp_path, recipe):
    options = ScalingOptions(
        out=tmp_path / "out",
        axis="tokens",
        tokens=(512, 1024, 2048),
        attentions=("baseline", "diff_v1"),
        config=recipe,
        progress=False,
    )
    _, runs = plan_runs(options)
    assert [r.attention for r in runs] == ["baseline", "diff_v1"]
    assert runs[0].config.steps == 8 and runs[0].config.eval_every == 2
    assert runs[0].points == [(2, 512), (4, 1024), (8, 2048)]


@pytest.mark.slow
def test_tiny_sweep_end_to_end_and_rerun_reuses_finished_runs(tmp_path, recipe, one_thread):
    options = ScalingOptions(
        out=tmp_path / "out",
        sizes=("d_model=16,n_heads=2", "d_model=32,n_heads=4", "d_model=48,n_heads=6"),
        attentions=("baseline", "diff_v1"),
        config=recipe,
        steps=3,
        progress=False,
    )
    fitted = run_scaling(options)
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    assert {p["attention"] for p in results["points"]} == {"baseline", "diff_v1"}
    assert len(results["points"]) == 6
    xs = sorted(p["x"] for p in results["points"] if p["attention"] == "baseline")
    assert xs == sorted(set(xs)) and len(xs) == 3
    assert set(results["fits"]) == {"baseline", "diff_v1"}
    assert len(results["shares"]["diff_v1"]) == 6
    assert (out / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert "Share of N" in (out / "report.md").read_text()
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/metrics.jsonl")}
    again = run_scaling(options)
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert again["fits"]["baseline"].a == pytest.approx(fitted["fits"]["baseline"].a)
    # the same directory with another plan is refused
    options.steps = 4
    with pytest.raises(ValueError, match="--overwrite"):
        run_scaling(options)
    # and the finished runs can be fitted from their directories
    refit = fit_results(sorted((out / "runs").iterdir()), tmp_path / "refit", progress=False)
    assert refit["fits"]["diff_v1"].c == pytest.approx(fitted["fits"]["diff_v1"].c, rel=1e-6)


def test_tokens_sweep_end_to_end(tmp_path, recipe, one_thread, capsys):
    out = tmp_path / "out"
    argv = [
        "scaling",
        "--axis",
        "tokens",
        "--tokens",
        "512",
        "1024",
        "2048",
        "--config",
        str(recipe),
        "--attention",
        "baseline",
        "diff_v1",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    points = [(p["attention"], p["x"]) for p in results["points"]]
    assert points == [(a, x) for a in ("baseline", "diff_v1") for x in (512.0, 1024.0, 2048.0)]
    assert all(math.isfinite(p["loss"]) for p in results["points"])
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["baseline-tiny", "diff_v1-tiny"]
    assert "Share of D" in (out / "report.md").read_text()
    assert main(argv) == 0  # reuses both runs
    assert json.loads((out / "results.json").read_text())["points"] == results["points"]
