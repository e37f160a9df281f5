"""Agreement with lm-evaluation-harness and ``diffattn lm-eval``: on the same tiny models and
items (local task YAMLs over local jsonl files), ``eval mc``'s per-choice log-likelihoods and
acc / acc_norm / acc_bytes per item equal the harness's; the entry point runs the harness on
diffattn, Hugging Face and Dex-wrapped models."""

from __future__ import annotations

import json

import pytest

from diffattn.commands.lm_eval import harness_argv
from mc_fixtures import ARC_ROWS, BOOLQ_ROWS, WINOGRANDE_ROWS, build_models, write_jsonl

ARC_YAML = """task: local_arc
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: acc_bytes
"""
BOOLQ_YAML = """task: local_boolq
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{passage}}}}\\nQuestion: {{{{question}}}}?\\nAnswer:"
doc_to_target: label
doc_to_choice: ["no", "yes"]
metric_list:
  - metric: acc
"""
WINOGRANDE_YAML = """task: local_winogrande
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: !function wg.right_option
doc_to_target: !function wg.after_blank
doc_to_choice: !function wg.filled_in
metric_list:
  - metric: acc
"""
WINOGRANDE_FUNCTIONS = """
def right_option(doc):
    return int(doc["answer"]) - 1


def after_blank(doc):
    return doc["sentence"].split("_", 1)[1].strip()


def filled_in(doc):
    before = doc["sentence"].split("_", 1)[0]
    return [before + doc["option1"], before + doc["option2"]]
"""
TASKS = {
    "local_arc": ("arc_easy", ARC_ROWS, ARC_YAML),
    "local_boolq": ("boolq", BOOLQ_ROWS, BOOLQ_YAML),
    "local_winogrande": ("winogrande", WINOGRANDE_ROWS, WINOGRANDE_YAML),
}


def test_harness_arguments_default_to_run_and_our_model():
    assert harness_argv(["--tasks", "x"]) == [
        *("run", "--device", "auto", "--model", "diffattn", "--tasks", "x")
    ]
    assert harness_argv(["run", "--model", "hf", "--device=cpu"]) == [
        *("run", "--model", "hf", "--device=cpu")
    ]
    assert harness_argv(["ls", "tasks"]) == ["ls", "tasks"]
    assert harness_argv(["--help"]) == ["run", "--help"]


@pytest.fixture(scope="module")
def harness_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    dirs = build_models(root)
    tasks = root / "tasks"
    tasks.mkdir()
    data = {}
    for name, (ours, rows, yaml) in TASKS.items():
        path = write_jsonl(tasks / f"{name}.jsonl", rows)
        (tasks / f"{name}.yaml").write_text(yaml.format(data=path))
        data[name] = f"{ours}={path}"
    (tasks / "wg.py").write_text(WINOGRANDE_FUNCTIONS)
    return dirs, tasks, data, root


@pytest.mark.extra("lm-eval")
@pytest.mark.parametrize("kind", ["llama", "diff_v1"])
def test_scores_equal_the_harness(harness_setup, kind, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from diffattn.eval import harness, mc
    from diffattn.eval.common import load_models

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    dirs, tasks, data, _ = harness_setup
    lm = harness.DiffattnLM(pretrained=dirs[kind], batch_size=3)
    theirs = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    models = load_models([dirs[kind]])
    ours = mc.run(models, data=list(data.values()), batch_size=2)
    for name, (task, rows, _) in TASKS.items():
        samples = sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
        mine = ours["models"][models[0].name][task]["samples"]
        assert len(samples) == len(mine) == len(rows)
        for their, my in zip(samples, mine, strict=True):
            lls = [float(r[0][0]) for r in their["resps"]]
            assert my["loglikelihoods"] == pytest.approx(lls, rel=1e-5, abs=1e-5)
            assert my["greedy"] == [bool(r[0][1]) for r in their["resps"]]
            for metric in ("acc", "acc_norm", "acc_bytes"):
                if metric in their:
                    assert float(my["pred"][metric] == my["gold"]) == their[metric], metric
        summary = theirs["results"][name]
        assert ours["models"][models[0].name][task]["acc"] == pytest.approx(summary["acc,none"])
        assert ours["models"][models[0].name][task]["acc_stderr"] == pytest.approx(
            summary["acc_stderr,none"]
        )


@pytest.mark.extra("lm-eval")
def test_shot_prompts_score_the_same_in_the_harness(harness_setup):
    from lm_eval.api.instance import Instance

    from diffattn.eval import harness, mc, mc_tasks
    from diffattn.eval.common import load_models
    from diffattn.eval.loglik import score

    dirs, *_ = harness_setup
    items = mc_tasks.to_items("winogrande", WINOGRANDE_ROWS, "rows")
    requests = [r for per_item in mc.prompts(items, None, 2, 0, "wg") for r in per_item]
    lm = harness.DiffattnLM(pretrained=dirs["llama"], batch_size=4)
    instances = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)]
    theirs = lm.loglikelihood(instances, disable_tqdm=True)
    ours = score(load_models([dirs["llama"]])[0], requests, batch_size=3)
    assert [s.loglikelihood for s in ours] == pytest.approx([t[0] for t in theirs], rel=1e-5)


@pytest.mark.extra("lm-eval")
def test_entry_point_runs_the_harness_on_our_models(harness_setup, tmp_path, monkeypatch):
    from diffattn import dex
    from diffattn.cli import main
    from diffattn.loading import load_model

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    dirs, tasks, _, root = harness_setup
    llama = load_model(dirs["llama"])
    dex.apply(llama, heads={0: [1], 1: [0, 3]}, anneal_steps=0, lambda_learn_init=0.5)
    dex.save_adapter(llama, root / "adapter")
    runs = {
        "diff_v1": f"pretrained={dirs['diff_v1']}",
        "dex": f"pretrained={dirs['llama']},dex={root / 'adapter'}",
    }
    for name, model_args in runs.items():
        out = tmp_path / name
        options = ["--include_path", str(tasks), "--output_path", str(out), "--batch_size", "4"]
        code = main(["lm-eval", "--model_args", model_args, "--tasks", "local_arc", *options])
        assert code == 0
        (written,) = list(out.rglob("results_*.json"))
        results = json.loads(written.read_text())["results"]["local_arc"]
        assert 0.0 <= results["acc,none"] <= 1.0, name


@pytest.mark.extra("lm-eval")
@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ({"batch_sise": 4}, r"unknown argument\(s\) batch_sise$"),
        ({"peft": "adapter"}, r"peft only apply when the harness loads a model by name"),
        ({"revision": "main", "gguf_file": "x.gguf"}, r"gguf_file, revision only apply"),
        ({"backend": "seq2seq"}, r"backend='seq2seq'"),
    ],
)
def test_harness_model_refuses_arguments_it_would_ignore(argument, message):
    from diffattn.eval import harness

    with pytest.raises(TypeError, match=message):
        harness.DiffattnLM(pretrained="never-loaded", **argument)
