"""``diffattn eval icl``: the label trie, cached against uncached decoding, prompts, shot
budgets, orders, data loaders, the synthetic task, the experiment and the command line."""

from __future__ import annotations

import json
import random

import pytest
import torch

from diffattn.cli import main
from diffattn.eval import icl, icl_data
from diffattn.eval.common import load_models
from diffattn.eval.label_trie import LabelTrie, SharedPrefix, greedy_labels, label_logprobs
from extras import require_extra
from helpers import tiny_diffattn, tiny_hf

pytestmark = require_extra("parquet")

TRIE = {"a": [5, 6, 9], "b": [5, 7, 9], "c": [8, 9], "d": [10, 11, 12, 9]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny DIFF V1 and HF Llama directories with a BPE trained on synthetic-task prompts."""
    from diffattn.checkpoint import save_model
    from diffattn.data import train_bpe

    tmp = tmp_path_factory.mktemp("icl")
    task = icl_data.synthetic_task(classes=6, train=300, seed=0)
    docs = [f"text: {e.text}\nlabel: {e.label}\n\n" for e in task.train]
    docs += ["Question: what is it?\nType: human location number\n\n"]
    tok = train_bpe(docs, 300, cache_dir=tmp / "cache")
    dirs = {}
    model = tiny_diffattn("diff_v1", vocab_size=tok.vocab_size, max_seq_len=512)
    dirs["diff_v1"] = save_model(model, tmp / "diff_v1", tokenizer=tok)
    llama = tiny_hf("llama", vocab_size=tok.vocab_size, max_position_embeddings=512)
    llama.save_pretrained(tmp / "llama")
    tok.save(tmp / "llama")
    dirs["llama"] = tmp / "llama"
    return dirs


@pytest.fixture(scope="module")
def models(model_dirs):
    return load_models([str(model_dirs["diff_v1"]), str(model_dirs["llama"])])


# --- label trie -------------------------------------------------------------------------------


def test_trie_paths_are_labels():
    trie = LabelTrie(TRIE)
    assert sorted(trie.allowed(0)) == [5, 8, 10] and trie.depth == 4
    for label, seq in TRIE.items():
        node = 0
        for token in seq:
            assert trie.label(node) is None and token in trie.allowed(node)
            node = trie.step(node, token)
        assert trie.label(node) == label and trie.allowed(node) == []


@pytest.mark.parametrize(
    "labels, match",
    [
        ({"a": [1, 2], "b": [1, 2, 3]}, "prefix"),
        ({"a": [1, 2, 3], "b": [1, 2]}, "prefix"),
        ({"a": [1, 2], "b": [1, 2]}, "equal"),
        ({"a": []}, "no tokens"),
        ({}, "empty"),
    ],
)
def test_trie_rejects_ambiguous_labels(labels, match):
    with pytest.raises(ValueError, match=match):
        LabelTrie(labels)


# --- cached prefix against the uncached reference ---------------------------------------------


def _models():
    return [
        tiny_diffattn("baseline"),
        tiny_diffattn("diff_v1"),
        tiny_diffattn("diff_v2"),
        tiny_hf("llama"),
        tiny_hf("llama", num_key_value_heads=1),  # GQA 4:1
    ]


@pytest.mark.parametrize("prefix_len", [1, 7, 129])
def test_cached_prefix_equals_uncached_reference(prefix_len, one_thread):
    rng = random.Random(prefix_len)
    trie = LabelTrie(TRIE)
    prefix_ids = [rng.randrange(128) for _ in range(prefix_len)]
    items = [[rng.randrange(128) for _ in range(n)] for n in (1, 7, 3)]  # padded to 7
    for model in _models():
        cached, reference = SharedPrefix(model, prefix_ids), SharedPrefix(model, prefix_ids, False)
        assert cached.cached and not reference.cached
        fast, fast_ext = cached.logits(items)
        slow, slow_ext = reference.logits(items)
        for row, item in enumerate(items):
            torch.testing.assert_close(
                fast[row, : len(item)], slow[row, : len(item)], atol=2e-5, rtol=1e-5
            )
        # Decode steps after padded rows: appended tokens see the same context.
        tokens = [3, 4, 5]
        for _ in range(2):
            fast_ext, slow_ext = cached.step(fast_ext, tokens), reference.step(slow_ext, tokens)
            torch.testing.assert_close(
                fast_ext.last_logits, slow_ext.last_logits, atol=2e-5, rtol=1e-5
            )
        assert greedy_labels(cached, items, trie) == greedy_labels(reference, items, trie)
        fast_scores = label_logprobs(cached, items[1], trie, batch_size=3)
        slow_scores = label_logprobs(reference, items[1], trie, batch_size=3)
        for label in TRIE:
            assert fast_scores[label] == pytest.approx(slow_scores[label], abs=1e-4)
        # The shared cache is left as it was: a second use gives the same logits.
        again, _ = cached.logits(items)
        torch.testing.assert_close(again, fast)


def test_label_logprobs_by_hand(one_thread):
    model = tiny_diffattn("baseline")
    prefix_ids, item = [1, 2, 3], [4, 5]
    scores = label_logprobs(SharedPrefix(model, prefix_ids), item, LabelTrie(TRIE))
    for label, seq in TRIE.items():
        ids = torch.tensor([prefix_ids + item + seq])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        start = len(prefix_ids) + len(item) - 1
        expected = sum(float(logprobs[start + j, t]) for j, t in enumerate(seq))
        assert scores[label] == pytest.approx(expected, abs=1e-4)


def test_greedy_follows_the_constrained_argmax(one_thread):
    model = tiny_diffattn("diff_v1")
    prefix, item, trie = SharedPrefix(model, [7, 8]), [9], LabelTrie(TRIE)
    ids = [7, 8, 9]
    node = 0
    while trie.label(node) is None:  # brute force: full forward, argmax over the allowed
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        allowed = trie.allowed(node)
        token = allowed[int(logits[allowed].argmax())]
        ids.append(token)
        node = trie.step(node, token)
    assert greedy_labels(prefix, [item], trie) == [trie.label(node)]


# --- prompts, shots and orders ----------------------------------------------------------------


def test_prompt_text_and_label_trie(models, one_thread):
    data = icl_data.synthetic_task(classes=6, train=20, seed=0)
    builder = icl.PromptBuilder(models[1].tokenizer, data.format, data.labels)
    demos = data.train[:3]
    text = models[1].tokenizer.decode(builder.prefix(demos))
    assert text == "".join(f"text: {d.text}\nlabel: {d.label}\n\n" for d in demos)
    assert builder.tokenizer.decode(builder.item("x y")) == "text: x y\nlabel:"
    assert set(builder.trie.sequences) == set(data.labels)
    for label, seq in builder.trie.sequences.items():
        terminator = builder.tokenizer.decode(builder.separator[:1])
        assert terminator.startswith("\n")
        assert builder.tokenizer.decode(seq) == f" {label}{terminator}"


def test_shot_budget(models, one_thread):
    data = icl_data.synthetic_task(classes=6, train=200, seed=0)
    builder = icl.PromptBuilder(models[0].tokenizer, data.format, data.labels)
    tests = data.test[:10]
    counts = icl.shot_counts(builder, data.train, tests, [0, 3, "max"], 300, "m")
    fits = counts["max"]
    room = max(len(builder.item(t.text)) for t in tests) + builder.trie.depth
    assert len(builder.prefix(data.train[:fits])) + room <= 300
    assert len(builder.prefix(data.train[: fits + 1])) + room > 300
    assert counts["0"] == 0 and counts["3"] == 3
    with pytest.raises(ValueError, match=f"at most {fits} demonstrations fit"):
        icl.shot_counts(builder, data.train, tests, [fits + 1], 300, "m")
    with pytest.raises(ValueError, match="exceeds the 200 training examples"):
        icl.shot_counts(builder, data.train, tests, [201], 10**6, "m")


def test_orders():
    demos = [icl_data.Example(str(i), "abc"[i % 3]) for i in range(9)]
    demos += [icl_data.Example("x", "a")]
    for seed in range(3):
        order = icl.arrange(demos, "alternating", random.Random(seed))
        assert sorted(order, key=id) == sorted(demos, key=id)
        labels = [d.label for d in order]
        assert len(set(labels[:3])) == 3 and len(set(labels[3:6])) == 3
        assert labels[-1] == "a"  # the class with one more example ends the cycle
        shuffled = icl.arrange(demos, "random", random.Random(seed))
        assert sorted(shuffled, key=id) == sorted(demos, key=id)
    assert icl.arrange(demos, "random", random.Random(1)) == icl.arrange(
        demos, "random", random.Random(1)
    )
    assert icl.parse_shots(["1", "max", 1, "4"]) == [1, "max", 4]
    with pytest.raises(ValueError, match="--shots"):
        icl.parse_shots(["-1"])


# --- data -------------------------------------------------------------------------------------


def test_synthetic_task_is_seeded_and_needs_the_context():
    a, b = icl_data.synthetic_task(seed=3), icl_data.synthetic_task(seed=3)
    assert a.train == b.train and a.test == b.test and len(a.labels) == 20
    c = icl_data.synthetic_task(seed=4)
    assert set(c.labels).isdisjoint(a.labels) or c.train != a.train
    for example in a.train[:50]:
        words = example.text.split()
        cues = [w for w in words if w not in icl_data.FILLER]
        assert len(cues) == 1 and 5 <= len(words) <= 9
    cue_label = {}
    for example in a.train:
        cue = next(w for w in example.text.split() if w not in icl_data.FILLER)
        assert cue_label.setdefault(cue, example.label) == example.label
    assert len(cue_label) == 60  # 20 classes × 3 cues


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_jsonl_loader(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", [{"text": "who?", "coarse_label": "HUM"}] * 3)
    _write_jsonl(tmp_path / "test.jsonl", [{"question": "where?", "label": "LOC"}])
    data = icl_data.load_dataset("trec", str(tmp_path))
    assert data.train[0] == icl_data.Example("who?", "human")
    assert data.test == [icl_data.Example("where?", "location")]
    assert data.format.input_prefix == "Question: " and data.labels == ["human", "location"]
    numbered = tmp_path / "numbered"
    numbered.mkdir()
    _write_jsonl(numbered / "train.jsonl", [{"text": "t", "label": 1}])
    _write_jsonl(numbered / "validation.jsonl", [{"text": "u", "label": 0}])
    (numbered / "labels.json").write_text('["card_arrival", "top-up"]')
    data = icl_data.load_dataset("banking77", str(numbered))
    assert [e.label for e in data.train + data.test] == ["top up", "card arrival"]


def test_jsonl_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="needs --data"):
        icl_data.load_dataset("trec")
    with pytest.raises(ValueError, match=r"no train\.jsonl"):
        icl_data.load_dataset("trec", str(tmp_path))
    _write_jsonl(tmp_path / "train.jsonl", [{"body": "x", "label": "a"}])
    _write_jsonl(tmp_path / "test.jsonl", [{"text": "x", "label": "a"}])
    with pytest.raises(ValueError, match="no text field"):
        icl_data.load_dataset("trec", str(tmp_path))
    _write_jsonl(tmp_path / "train.jsonl", [{"text": "x", "label": 3}])
    with pytest.raises(ValueError, match="integer label 3"):
        icl_data.load_dataset("trec", str(tmp_path))
    with pytest.raises(ValueError, match="--dataset"):
        icl_data.load_dataset("sst2", str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        icl_data.load_dataset("trec", str(tmp_path / "nothing"))


def _save_to_disk(root, splits, names):
    """A DatasetDict directory as ``datasets.save_to_disk`` lays it out (arrow streams)."""
    import pyarrow as pa

    root.mkdir()
    (root / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    features = {
        "text": {"dtype": "string", "_type": "Value"},
        "label": {"names": names, "_type": "ClassLabel"},
    }
    for split, rows in splits.items():
        (root / split).mkdir()
        table = pa.table({"text": [r[0] for r in rows], "label": [r[1] for r in rows]})
        path = str(root / split / "data-00000-of-00001.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        (root / split / "dataset_info.json").write_text(json.dumps({"features": features}))


def test_save_to_disk_loader(tmp_path):
    names = ["greeting", "oos", "change_pin"]
    _save_to_disk(
        tmp_path / "clinic", {"train": [("hi", 0), ("new pin", 2)], "test": [("x", 1)]}, names
    )
    data = icl_data.load_dataset("clinic150", str(tmp_path / "clinic"))
    assert data.train == [
        icl_data.Example("hi", "greeting"),
        icl_data.Example("new pin", "change pin"),
    ]
    assert data.test == [icl_data.Example("x", "oos")]
    assert data.format.input_prefix == "utterance: "
    _save_to_disk(tmp_path / "broken", {"train": [("hi", 0)]}, names)
    with pytest.raises(ValueError, match="no test split"):
        icl_data.load_dataset("clinic150", str(tmp_path / "broken"))


# --- the experiment ---------------------------------------------------------------------------

TINY = dict(classes=6, shots=[0, 2, "max"], budget=200, test_items=6, batch_size=4)


def test_run_on_diffattn_and_hf_models(models, one_thread):
    results = icl.run(models, arrangements=["random", "alternating"], permutations=2, **TINY)
    assert results["classes"] == 6 and results["chance"] == pytest.approx(1 / 6)
    assert len(results["gold"]) == 6
    for r in results["models"].values():
        assert r["kv_cache"] and r["budget"] == 200
        assert len(r["runs"]) == 2 * 3 * 2
        for run in r["runs"]:
            correct = [
                int(p == g) for p, g in zip(run["predictions"], results["gold"], strict=True)
            ]
            assert run["correct"] == correct
            assert run["accuracy"] == pytest.approx(sum(correct) / 6)
            assert run["prefix_tokens"] <= 200 and set(run["predictions"]) <= set(results["labels"])
        for by_shot in r["summary"].values():
            assert by_shot["0"]["demonstrations"] == 0 and by_shot["2"]["demonstrations"] == 2
            assert by_shot["max"]["demonstrations"] > 2
            for s in by_shot.values():
                assert s["worst"] <= s["mean"] <= s["best"]
                assert s["margin"] == pytest.approx(s["best"] - s["worst"])
    again = icl.run(models[:1], use_cache=False, **TINY)["models"]["diff_v1"]
    first = icl.run(models[:1], **TINY)["models"]["diff_v1"]
    assert [r["predictions"] for r in again["runs"]] == [r["predictions"] for r in first["runs"]]
    text = icl.report(results)
    assert "alternating order" in text and "Fig 6" in text


def test_scored_decoding(models, one_thread):
    results = icl.run(models[:1], decoding="scored", **TINY)
    runs = results["models"]["diff_v1"]["runs"]
    assert all(set(r["predictions"]) <= set(results["labels"]) for r in runs)


def test_bad_settings(models, one_thread):
    with pytest.raises(ValueError, match="--budget 1000 exceeds"):
        icl.run(models[:1], **{**TINY, "budget": 1000})
    with pytest.raises(ValueError, match="does not fit"):
        icl.run(models[:1], **{**TINY, "shots": [100]})
    with pytest.raises(ValueError, match="--decoding"):
        icl.run(models[:1], **{**TINY, "decoding": "beam"})
    with pytest.raises(ValueError, match="takes no --data"):
        icl.run(models[:1], data="x", **TINY)


def test_command_line(model_dirs, tmp_path, capsys, one_thread):
    out = tmp_path / "out"
    args = ["eval", "icl", str(model_dirs["diff_v1"]), "--out", str(out), "--quiet"]
    tiny = ["--classes", "6", "--shots", "1", "max", "--budget", "150", "--test-items", "4"]
    assert main([*args, *tiny, "--permutations", "2", "--arrangements", "alternating"]) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["experiment"] == "icl" and record["settings"]["permutations"] == 2
    assert set(record["results"]["models"]["diff_v1"]["summary"]) == {"alternating"}
    assert (out / "icl_accuracy.png").is_file() and (out / "icl_robustness.png").is_file()
    assert "Fig 6" in (out / "report.md").read_text()
    capsys.readouterr()
    bad = main([*args, "--overwrite", *tiny, "--shots", "three"])
    err = capsys.readouterr().err.strip().splitlines()
    assert bad == 2 and len(err) == 1 and "--shots" in err[0]


def test_cached_prefix_of_a_dex_model(one_thread):
    from diffattn import dex

    model = tiny_hf("llama")
    dex.apply(model, heads={0: [1], 1: [0, 3]}, anneal_steps=0, lambda_learn_init=0.5)
    model.eval()
    rng = random.Random(0)
    prefix_ids = [rng.randrange(128) for _ in range(40)]
    items = [[rng.randrange(128) for _ in range(n)] for n in (1, 7, 3)]
    cached, reference = SharedPrefix(model, prefix_ids), SharedPrefix(model, prefix_ids, False)
    fast, fast_ext = cached.logits(items)
    slow, slow_ext = reference.logits(items)
    assert cached.cached
    for row, item in enumerate(items):
        torch.testing.assert_close(
            fast[row, : len(item)], slow[row, : len(item)], atol=2e-5, rtol=1e-5
        )
    fast_ext, slow_ext = cached.step(fast_ext, [1, 2, 3]), reference.step(slow_ext, [1, 2, 3])
    torch.testing.assert_close(fast_ext.last_logits, slow_ext.last_logits, atol=2e-5, rtol=1e-5)
