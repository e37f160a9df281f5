"""Arms of ``diffattn compare``: ``TYPE[:option=value,...]``, any registered type or an
ablation of one, parsed once (:mod:`diffattn.compare.arms`), trained at matched parameters on
the same data, named and coloured by the type's declaration, and reported against the baseline
(the papers' claims for DIFF V1/V2, measured differences for the other arms)."""

from __future__ import annotations

import json

from extras import require_extra

pytestmark = require_extra("train", "hf")

import pytest

from compare_helpers import tiny_overrides, write_corpus
from diffattn.attention.baseline import Baseline
from diffattn.attention.types import (
    TypeOption,
    attention_type_names,
    positive_int,
    register_attention_type,
    unregister_attention_type,
)
from diffattn.compare.arms import (
    REFERENCE,
    arm_of_model,
    colours,
    parse_arm,
    parse_arms,
    split_arms,
    title_of,
)
from diffattn.compare.claims import (
    HIGHER,
    LOWER,
    PAPER_CLAIMS,
    Claim,
    claimed_arms,
    claims_table,
    evaluate_claims,
)

TOY = "toy_arm"


class ToyArm(Baseline):
    """The baseline's attention under another name, with one declared option (read by
    nothing): a type the papers make no claim about."""

    name = TOY
    title = "Toy"
    colour = None
    options = (TypeOption("width", 2, "a toy option", kind=int, check=positive_int),)


@pytest.fixture
def toy():
    register_attention_type(ToyArm(), replace=True)
    yield TOY
    unregister_attention_type(TOY)


# ------------------------------------------------------------------------------- parsing
def test_an_arm_is_a_type_with_its_options_and_fields_in_one_spelling():
    plain = parse_arm(" diff_v1 ")
    assert (plain.name, plain.type, plain.changes) == ("diff_v1", "diff_v1", ())
    assert plain.title == "DIFF V1"
    assert plain.paper_claims and plain.lambda_key == "lambda"
    assert parse_arm(REFERENCE).lambda_key is None and not parse_arm(REFERENCE).paper_claims

    ablation = parse_arm("diff_v1:lambda_init=.8")
    assert ablation.name == "diff_v1:lambda_init=0.8" and ablation.fields == (("lambda_init", 0.8),)
    assert ablation.title == "DIFF V1 (lambda_init=0.8)" and not ablation.paper_claims
    assert ablation.directory == "diff_v1-lambda_init=0.8"
    assert ablation.recipe_overrides() == ["model.attention=diff_v1", "model.lambda_init=0.8"]
    assert parse_arm("diff_v1:lambda_init=exp").fields == (("lambda_init", "exp"),)

    # one arm, one name, in the order the declaration lists its fields; bools as words
    v2 = parse_arm("diff_v2: v2_use_lambda = no , v2_paired_heads=False")
    assert v2.name == "diff_v2:v2_paired_heads=false,v2_use_lambda=false"
    assert v2.fields == (("v2_paired_heads", False), ("v2_use_lambda", False))
    assert v2.model_fields() == {
        "attention": "diff_v2",
        "v2_paired_heads": False,
        "v2_use_lambda": False,
    }


def test_a_declared_option_goes_to_attention_options(toy):
    arm = parse_arm(f"{toy}:width=3")
    assert arm.options == (("width", 3),) and arm.fields == ()
    assert arm.attention_options() == {toy: {"width": 3}}
    assert arm.recipe_overrides() == [
        f"model.attention={toy}",
        f"model.attention_options.{toy}.width=3",
    ]
    assert arm.title == "Toy (width=3)" and not arm.paper_claims


@pytest.mark.parametrize(
    ("spelling", "message"),
    [
        ("gpt", "arm 'gpt': unknown attention type 'gpt'; choose one of baseline, diff_v1"),
        (
            "diff_v1:colour=red",
            "arm 'diff_v1:colour=red': 'colour' is no option of diff_v1; its options are "
            "lambda_init, lambda_std, head_norm, head_norm_learnable, head_norm_eps",
        ),
        ("baseline:lambda_init=0.5", "'lambda_init' is no option of baseline; it takes no options"),
        ("diff_v1:head_norm=maybe", "option 'head_norm': expected true or false, got 'maybe'"),
        ("diff_v1:lambda_init=1.5", "option 'lambda_init': must lie in (0, 1), got 1.5"),
        ("diff_v1:lambda_init=abc", "option 'lambda_init': must be 'exp' or a float in (0, 1)"),
        ("diff_v1:lambda_std=x", "option 'lambda_std': expected a number, got 'x'"),
        ("diff_v1:lambda_init=0.5,lambda_init=0.6", "option 'lambda_init' is given twice"),
        ("diff_v1:lambda_init", "expected option=value, got 'lambda_init'"),
        ("diff_v1:", "give option=value after ':'"),
        (":lambda_init=0.5", "name an attention type before ':'"),
    ],
)
def test_a_bad_arm_is_one_error_naming_it(spelling, message):
    with pytest.raises(ValueError) as error:
        parse_arm(spelling)
    assert message in str(error.value)


def test_a_declared_options_value_is_parsed_and_checked_by_its_declaration(toy):
    with pytest.raises(ValueError, match=r"arm 'toy_arm:width=0': option 'width': must be a pos"):
        parse_arm(f"{toy}:width=0")
    with pytest.raises(ValueError, match=r"option 'width': expected a int, got 'wide'"):
        parse_arm(f"{toy}:width=wide")
    with pytest.raises(ValueError, match=r"its options are width$"):
        parse_arm(f"{toy}:lambda_init=0.5")


def test_arms_are_listed_by_spaces_or_commas_and_each_once():
    spelled = ["baseline,diff_v1:lambda_init=0.8,head_norm=false", "diff_v2"]
    assert split_arms(spelled) == ["baseline", "diff_v1:lambda_init=0.8,head_norm=false", "diff_v2"]
    names = [arm.name for arm in parse_arms(spelled)]
    assert names == ["baseline", "diff_v1:lambda_init=0.8,head_norm=false", "diff_v2"]
    with pytest.raises(
        ValueError, match=r"--attention: arm 'diff_v1:lambda_init=0.8' appears twice"
    ):
        parse_arms(["diff_v1:lambda_init=0.8", "diff_v1:lambda_init=.8"])
    with pytest.raises(ValueError, match="appears twice"):
        parse_arms(["diff_v1", "diff_v1"])
    with pytest.raises(ValueError, match="--attention: name at least one"):
        parse_arms([" , "])
    with pytest.raises(ValueError, match=r"^--models: arm 'gpt'"):
        parse_arms(["gpt"], "--models")


def test_reports_name_and_colour_each_arm_from_its_declaration(toy):
    assert title_of("baseline") == "Transformer" and title_of(toy) == "Toy"
    assert title_of("diff_v2:v2_use_lambda=false") == "DIFF V2 (v2_use_lambda=false)"
    assert title_of("lora") == "lora"  # no arm (another experiment's names): as it is
    found = colours(["diff_v1:lambda_init=0.8", "baseline", "diff_v1", toy, "lora"])
    assert found["baseline"] == "tab:gray" and found["diff_v1"] == "tab:blue"
    others = [found[n] for n in ("diff_v1:lambda_init=0.8", toy, "lora")]
    assert None not in others and len(set(found.values())) == len(found)  # one colour each
    assert colours(["diff_v1:lambda_init=0.8"]) == {"diff_v1:lambda_init=0.8": "tab:blue"}


def test_a_finished_runs_model_gives_its_arm_back(toy):
    from diffattn import presets

    for spelling in ("diff_v1:lambda_init=0.8,head_norm=false", "diff_v2", f"{toy}:width=3"):
        arm = parse_arm(spelling)
        model = presets.get("tiny", **arm.model_fields())
        assert arm_of_model(model) == arm


# ------------------------------------------------------------------------------- claims
def test_the_papers_claims_are_judged_for_their_types_and_other_arms_are_measured(toy):
    per_seed = {
        "baseline": [{"val_loss": 3.0}, {"val_loss": 3.1}, {"val_loss": 3.2}],
        "diff_v1": [{"val_loss": 2.9}, {"val_loss": 3.0}, {"val_loss": 3.1}],
        "diff_v1:lambda_init=0.8": [{"val_loss": 3.2}, {"val_loss": 3.3}, {"val_loss": 3.4}],
        toy: [{"val_loss": 2.8}, {"val_loss": 2.9}, {"val_loss": 3.0}],
    }
    assert claimed_arms(per_seed) == {"diff_v1"}
    loss = [c for c in PAPER_CLAIMS if c.key == "val_loss"]
    verdicts = {v.model: v for v in evaluate_claims(loss, per_seed, claimed={"diff_v1"})}
    assert verdicts["diff_v1"].claimed and verdicts["diff_v1"].verdict == "supported"
    assert not verdicts["diff_v1:lambda_init=0.8"].claimed
    assert verdicts["diff_v1:lambda_init=0.8"].verdict == HIGHER
    assert verdicts[toy].verdict == LOWER and verdicts[toy].mean == pytest.approx(-0.2)
    table = claims_table(list(verdicts.values()))
    assert (
        "| lower language-modeling loss | — | no paper claim | toy_arm | — (val_loss) | " in table
    )
    assert "-0.2 ± 0 (n=3) | lower |" in table
    assert "*no paper claim*" in table
    # noise either way is inconclusive for an arm without a claim too
    noisy = {"baseline": [{"x": 1.0}, {"x": 2.0}], toy: [{"x": 2.0}, {"x": 1.0}]}
    claim = Claim("x", "lower x", "nowhere", "lower")
    assert evaluate_claims([claim], noisy, claimed=set())[0].verdict == "inconclusive"
    # without ``claimed`` every model is judged on the claims, as before
    assert all(v.claimed for v in evaluate_claims(loss, per_seed))


def test_the_loss_sentence_of_an_arm_without_a_claim(toy):
    from diffattn.compare.report import outcome_sentences

    per_seed = {
        "baseline": [{"val_loss": 3.0}, {"val_loss": 3.1}],
        toy: [{"val_loss": 2.8}, {"val_loss": 2.9}],
    }
    verdicts = evaluate_claims(
        [c for c in PAPER_CLAIMS if c.key == "val_loss"], per_seed, claimed=set()
    )
    (line,) = outcome_sentences(verdicts)
    assert line.startswith("- Toy reaches a lower validation loss than the Transformer, by 0.2000")


# ------------------------------------------------------------------------------- plans
def test_each_arm_is_planned_at_the_baselines_parameters(toy):
    from diffattn import count_parameters
    from diffattn.compare import CompareOptions, plan_configs

    arms = ("baseline", "diff_v1:lambda_init=0.8", "diff_v2:v2_use_lambda=false", f"{toy}:width=3")
    _, configs = plan_configs(CompareOptions(attentions=arms, seeds=1))
    names = [parse_arm(a).name for a in arms]
    assert list(configs) == [(name, 0) for name in names]
    models = {name: configs[(name, 0)].model_config() for name in names}
    assert models["diff_v1:lambda_init=0.8"].lambda_init == 0.8
    assert models["diff_v2:v2_use_lambda=false"].v2_use_lambda is False
    assert models[f"{toy}:width=3"].options_of(toy) == {"width": 3}
    # the V2 ablation adds W_Q's second half: its SwiGLU is narrowed (matches_by_ffn)
    assert configs[("diff_v2:v2_use_lambda=false", 0)].model.match_params
    assert not configs[("diff_v1:lambda_init=0.8", 0)].model.match_params
    counts = [count_parameters(m) for m in models.values()]
    assert max(counts) / min(counts) - 1 < 1e-2


def test_a_bad_arm_fails_the_command_before_any_file(tmp_path, capsys):
    from diffattn.cli import main

    out = tmp_path / "out"
    assert main(["compare", "--out", str(out), "--attention", "baseline", "diff_v1:colour=1"]) == 2
    err = capsys.readouterr().err
    assert "--attention: arm 'diff_v1:colour=1': 'colour' is no option of diff_v1" in err
    assert main(["compare", "--out", str(out), "--attention", "diff_v1", "diff_v1"]) == 2
    assert "appears twice" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif("gda" not in attention_type_names(), reason="the gda type is not registered")
def test_a_gda_arm_is_planned_and_matched():
    from diffattn import count_parameters
    from diffattn.compare import CompareOptions, plan_configs

    # 8 query heads: 6 signal heads and 2 noise heads, one per KV group of the 4 key heads
    options = CompareOptions(
        attentions=("baseline", "gda:ratio=3"),
        seeds=1,
        overrides=["model.n_heads=8", "model.n_kv_heads=4"],
    )
    _, configs = plan_configs(options)
    gda = configs[("gda:ratio=3", 0)].model_config()
    assert gda.attention == "gda" and gda.options_of("gda")["ratio"] == 3
    base = count_parameters(configs[("baseline", 0)].model_config())
    assert abs(count_parameters(gda) / base - 1) < 2e-2
    assert title_of("gda:ratio=3") == "GDA (ratio=3)"


# ------------------------------------------------------------------------------- a run
def _options(tmp_path, corpus, arms, **changes):
    from diffattn.compare import CompareOptions

    overrides = [
        *tiny_overrides(corpus, tmp_path / "cache"),
        "retrieval.steps=2", "retrieval.seeds=1", "retrieval.test_episodes=2",
        "retrieval.d_model=16", "retrieval.grid=[4]", "retrieval.bits=[8]",
    ]  # fmt: skip
    options = CompareOptions(
        out=tmp_path / "out", overrides=overrides, steps=2, seeds=1, jobs=1, progress=False,
        evaluate=False, part="all", attentions=arms,
    )  # fmt: skip
    for key, value in changes.items():
        setattr(options, key, value)
    return options


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus", 16)


def test_a_compare_run_with_an_ablation_and_another_type(tmp_path, corpus, toy, one_thread):
    """Both parts, three arms (the baseline, a DIFF V1 ablation, a type the papers do not
    describe): the same tokens for each, each run in its own directory, the report naming each
    arm from its declaration and spelling."""
    from diffattn.compare import run_compare

    arms = ("baseline", "diff_v1:lambda_init=0.8", f"{toy}:width=3")
    result = run_compare(_options(tmp_path, corpus, arms))
    out = tmp_path / "out"
    assert [r.attention for r in result.runs] == list(arms)
    for name in ("baseline", "diff_v1-lambda_init=0.8", "toy_arm-width=3"):
        assert (out / "runs" / f"{name}-seed0" / "metrics.jsonl").is_file()
        assert (out / "retrieval" / f"{name}-seed0" / "retrieval.json").is_file()
    data = json.loads((out / "results.json").read_text())
    rows = {row["attention"]: row for row in data["rows"]}
    assert [rows[a]["model"] for a in arms] == [
        "Transformer",
        "DIFF V1 (lambda_init=0.8)",
        "Toy (width=3)",
    ]
    assert len({row["tokens"] for row in rows.values()}) == 1  # the same tokens for each arm
    assert rows["diff_v1:lambda_init=0.8"]["final_lambda"] is not None  # DIFF V1's λ recorded
    assert rows[f"{toy}:width=3"]["final_lambda"] is None  # a type without λ
    assert set(data["retrieval"]["runs"]) == set(arms)
    report = (out / "report.md").read_text()
    assert "| measurement | Transformer | DIFF V1 (lambda_init=0.8) | Toy (width=3) |" in report
    assert "| DIFF V1 (lambda_init=0.8) |" in report and "| Toy (width=3) |" in report
    assert "- DIFF V1 (lambda_init=0.8) λ (Eq.2): layer 1:" in report  # the retrieval λ
    plan = (out / "compare.yaml").read_text()
    assert "- diff_v1:lambda_init=0.8" in plan and f"- {toy}:width=3" in plan
    # the ablation trained with its λ_init; the other type with its option
    from diffattn.train import load_config

    config = load_config(out / "runs" / "diff_v1-lambda_init=0.8-seed0" / "config.yaml")
    assert config.model_config().lambda_init == 0.8
    config = load_config(out / "runs" / "toy_arm-width=3-seed0" / "config.yaml")
    assert config.model_config().options_of(toy) == {"width": 3}


@pytest.mark.slow
def test_measured_arms_get_differences_and_the_papers_types_get_claims(tmp_path, toy, one_thread):
    """Measured over two seeds: DIFF V1 is judged on the papers' claims; its ablation and the
    other type are reported as differences against the baseline, with no paper claim."""
    from diffattn.compare import run_compare
    from diffattn.compare.evaluate import EvalSettings

    settings = EvalSettings(
        needle_cells=((1, 1),), needle_depths=(0.0,), needle_samples=1, max_tokens=200,
        batch_size=8,
    )  # fmt: skip
    arms = ("baseline", "diff_v1", "diff_v1:lambda_init=0.8", toy)
    options = _options(
        tmp_path, None, arms, seeds=2, evaluate=True, eval_settings=settings, part="lm"
    )
    options.overrides = [
        *options.overrides,
        'data.sources=["synthetic:recall?docs=200&pairs=4&queries=3",'
        '"synthetic:needle?docs=100&needles=2&words=20"]',
        "data.tokenizer=bpe:400", "model.vocab_size=400", "seq_len=96",
    ]  # fmt: skip
    run_compare(options)
    out = tmp_path / "out"
    claims = json.loads((out / "results.json").read_text())["claims"]
    by_model: dict[str, set] = {}
    for claim in claims:
        by_model.setdefault(claim["model"], set()).add((claim["paper_claim"], claim["verdict"]))
    assert {c for c, _ in by_model["diff_v1"]} == {True}
    for name in ("diff_v1:lambda_init=0.8", toy):
        assert {c for c, _ in by_model[name]} == {False}
        assert {v for _, v in by_model[name]} <= {LOWER, HIGHER, "inconclusive", "uninformative"}
    report = (out / "report.md").read_text()
    assert "| diff_v1:lambda_init=0.8 | — (val_loss) |" in report
    assert "| toy_arm | — (val_loss) |" in report
    assert "Rows with *no paper claim*" in report
