"""``diffattn scaling`` with arms (:mod:`diffattn.compare.arms`): an ablation planned beside the
baseline at matched parameters, its points named by its spelling and its title in the report."""

from __future__ import annotations

import json

from extras import require_extra

pytestmark = require_extra("train", "eval")

import numpy as np
import pytest

from diffattn.scaling import ScalingOptions, fit_results, plan_runs
from train_helpers import tiny_recipe, write_recipe

ABLATION = "diff_v1:lambda_init=0.8"


@pytest.fixture
def recipe(tmp_path, data_cache):
    changes = {"schedule": {"warmup_steps": 1, "total_steps": None}, "eval_every": 2}
    return write_recipe(tmp_path / "recipe.yaml", tiny_recipe(data_cache, **changes))


def test_a_plan_with_an_ablation_arm(tmp_path, recipe):
    from diffattn import count_parameters

    options = ScalingOptions(
        out=tmp_path / "out",
        sizes=("d_model=16,n_heads=2", "d_model=32,n_heads=4", "d_model=48,n_heads=6"),
        attentions=("baseline", "diff_v1:lambda_init=.8", "diff_v2:v2_use_lambda=false"),
        config=recipe,
        steps=3,
        progress=False,
    )
    _, runs = plan_runs(options)
    arms = ["baseline", ABLATION, "diff_v2:v2_use_lambda=false"]
    assert [r.attention for r in runs] == arms * 3
    assert [r.name for r in runs[:3]] == [
        "baseline-d_model16-n_heads2",
        "diff_v1-lambda_init=0.8-d_model16-n_heads2",
        "diff_v2-v2_use_lambda=false-d_model16-n_heads2",
    ]
    base, ablation, v2 = (run.config.model_config() for run in runs[3:6])
    assert ablation.attention == "diff_v1" and ablation.lambda_init == 0.8
    assert v2.v2_use_lambda is False and runs[5].config.model.match_params  # matches_by_ffn
    assert base.lambda_init == "exp"
    counts = [count_parameters(m) for m in (base, ablation, v2)]
    assert max(counts) / min(counts) - 1 < 0.05
    assert not (tmp_path / "out").exists()


def test_the_sweep_needs_the_baseline_and_valid_arms(tmp_path):
    def options(*arms):
        return ScalingOptions(out=tmp_path / "o", sizes=("a=1", "b=2", "c=3"), attentions=arms)

    with pytest.raises(ValueError, match="needs baseline and at least one other arm"):
        plan_runs(options(ABLATION, "diff_v1"))
    with pytest.raises(ValueError, match=r"--attention: arm 'diff_v1:lambda_init=2'"):
        plan_runs(options("baseline", "diff_v1:lambda_init=2"))
    with pytest.raises(ValueError, match="appears twice"):
        plan_runs(options("baseline", ABLATION, "diff_v1:lambda_init=0.80"))


def test_points_of_an_ablation_are_fitted_and_named_by_their_arm(tmp_path):
    sizes = np.geomspace(1e6, 1e10, 5)
    rows = [
        {"attention": spelled, "x": float(n), "loss": float(a * n**-0.3 + 1.7)}
        for spelled, a in (("baseline", 400.0), ("diff_v1:lambda_init=.8", 300.0))
        for n in sizes
    ]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(rows))
    fitted = fit_results(
        [path], tmp_path / "out", attentions=("baseline", ABLATION), progress=False
    )
    assert set(fitted["fits"]) == {"baseline", ABLATION}
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| DIFF V1 (lambda_init=0.8) | 5 |" in report
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {p["attention"] for p in results["points"]} == {"baseline", ABLATION}
    # an arm not asked for is left out of the fit
    with pytest.raises(ValueError, match="another arm"):
        fit_results([path], tmp_path / "o2", attentions=("baseline", "diff_v1"), progress=False)
