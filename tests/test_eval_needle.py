"""``diffattn eval needle``: samples, prompts, scoring, greedy decoding, attention masses, the
experiment on diffattn and Hugging Face models, and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from diffattn.cli import main
from diffattn.data import synthetic
from diffattn.eval import needle
from diffattn.eval.common import TextTokenizer, load_models
from extras import require_extra
from helpers import tiny_diffattn, tiny_hf

pytestmark = require_extra("hf")

LENGTH = 160  # tokens: room for 2 needles, the question and some haystack
TINY = dict(needles=2, queries=1, lengths=[LENGTH], depths=[0, 100], samples=1, batch_size=2)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny baseline, DIFF V1 and HF Llama directories sharing one trained BPE tokenizer."""
    from diffattn.checkpoint import save_model
    from diffattn.data import train_bpe

    tmp = tmp_path_factory.mktemp("needle")
    needles = [needle.NEEDLE_TEMPLATE.format(city=c, number=1234567) for c in needle.CITIES]
    questions = [needle.QUESTION_ONE, needle.QUESTION_MANY, "0123456789"]
    docs = [*needle.SYNTHETIC_SENTENCES, *needles, *questions] * 3
    tok = train_bpe(docs, 300, cache_dir=tmp / "cache")
    dirs = {}
    for attention in ("baseline", "diff_v1"):
        model = tiny_diffattn(attention, vocab_size=tok.vocab_size, max_seq_len=256)
        dirs[attention] = save_model(model, tmp / attention, tokenizer=tok)
    llama = tiny_hf("llama", vocab_size=tok.vocab_size, max_position_embeddings=256)
    llama.save_pretrained(tmp / "llama")
    tok.save(tmp / "llama")
    dirs["llama"] = tmp / "llama"
    return dirs


@pytest.fixture(scope="module")
def models(model_dirs):
    return load_models([str(model_dirs[k]) for k in ("baseline", "diff_v1", "llama")])


def test_scorer_needs_every_number():
    assert needle.score(" 1234567 and 7654321.", ["1234567", "7654321"]) == 1
    assert needle.score("7654321", ["7654321"]) == 1
    assert needle.score(" 1234567 and 765432", ["1234567", "7654321"]) == 0
    assert needle.score("", ["1234567"]) == 0


def test_samples_have_unique_cities_and_numbers():
    assert len(set(needle.CITIES)) == len(needle.CITIES) >= 60
    cells = needle.make_samples(20, 3, [100], [0, 50], 5, seed=1)
    for cell in cells.values():
        for s in cell:
            assert len(set(s.cities)) == 20 and len(set(s.numbers)) == 20
            assert all(len(n) == synthetic.DIGITS for n in s.numbers)
            assert s.answers == s.numbers[:3]
            assert "Question: What are the magic numbers of" in s.question()
    again = needle.make_samples(20, 3, [100], [0, 50], 5, seed=1)
    assert [s.cities for s in again[(0, 100)]] == [s.cities for s in cells[(0, 100)]]
    with pytest.raises(ValueError, match="built-in cities"):
        needle.make_samples(len(needle.CITIES) + 1, 1, [100], [0], 1, seed=0)


@pytest.mark.parametrize("queries", [1, 2])
def test_prompt_length_depth_and_needle_spans(models, queries):
    tokenizer = models[2].tokenizer  # the HF tokenizer of the Llama directory
    hay = needle.haystack_ids(tokenizer, "synthetic", 400)
    cells = needle.make_samples(4, queries, [200], [0, 25, 50, 75, 100], 3, seed=0)
    for (depth, _), cell in cells.items():
        for s in cell:
            p = needle.build_prompt(s, tokenizer, hay)
            assert len(p.ids) == 200  # tolerance 0: pieces are joined as token ids
            for i, (a, b) in enumerate(p.needle_spans):
                assert tokenizer.decode(p.ids[a:b]) == s.needle(i)
            start, end = p.answer_span
            assert (start, end) == (p.needle_spans[0][0], p.needle_spans[queries - 1][1])
            c0, c1 = p.context_span
            one_needle = max(b - a for a, b in p.needle_spans)
            target = c0 + depth / 100 * (c1 - c0 - (end - start))
            assert abs(start - target) <= one_needle
            assert tokenizer.decode(p.ids[c1:]) == s.question()


def test_answer_at_the_ends_of_the_context():
    tokenizer = TextTokenizer(_char_tokenizer())
    hay = list(range(100))
    s = needle.NeedleSample(0, 120, ["Oslo"], ["1234567"], 1)
    p = needle.build_prompt(s, tokenizer, hay)
    assert p.answer_span[0] == 0 and len(p.ids) == 120
    s = needle.NeedleSample(100, 120, ["Oslo"], ["1234567"], 1)
    p = needle.build_prompt(s, tokenizer, hay)
    assert p.answer_span[1] == p.context_span[1]


def _char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({chr(i): i for i in range(32, 127)}, unk_token=" "))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return tokenizer


def test_attention_masses_by_hand():
    # spans: answer, context, whole prompt, needle 1 (= answer), needle 2; 2 layers, 2 heads.
    layer0 = torch.tensor([[0.5, 0.9, 1.0, 0.5, 0.1], [0.3, 0.8, 1.0, 0.3, 0.2]])
    layer1 = torch.tensor([[0.1, 0.6, 1.0, 0.1, 0.3], [0.1, 0.7, 0.9, 0.1, 0.0]])
    result = {layer: [{"applied": m[None, :, None, :]}] for layer, m in enumerate((layer0, layer1))}
    masses = needle.attention_masses(result)
    assert masses["answer_mass"] == pytest.approx((0.5 + 0.3 + 0.1 + 0.1) / 4)
    noise = [0.9 - 0.6, 0.8 - 0.5, 0.6 - 0.4, 0.7 - 0.1]
    assert masses["noise_mass"] == pytest.approx(sum(noise) / 4)
    assert masses["total_mass"] == pytest.approx(3.9 / 4)


def test_attention_of_a_softmax_model_sums_to_one(models):
    tokenizer = models[0].tokenizer
    s = needle.make_samples(2, 1, [LENGTH], [50], 1, seed=0)[(50, LENGTH)][0]
    p = needle.build_prompt(s, tokenizer, needle.haystack_ids(tokenizer, "synthetic", LENGTH))
    masses = needle.measure_attention(models[0], p)
    assert masses["total_mass"] == pytest.approx(1.0, abs=1e-5)
    assert masses["answer_mass"] > 0 and masses["noise_mass"] > 0
    assert masses["answer_mass"] + masses["noise_mass"] < 1


def test_batched_greedy_equals_one_at_a_time_and_no_cache(models):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    for model in models:
        batched = needle.greedy(model, prompts, 4)
        assert batched == [needle.greedy(model, [p], 4)[0] for p in prompts]
        ids = torch.tensor([prompts[0]])
        with torch.no_grad():  # no cache: the argmax of a full forward per step
            for _ in range(4):
                ids = torch.cat([ids, model.model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
        eos = model.tokenizer.eos_token_id
        expected = ids[0, len(prompts[0]) :].tolist()
        assert batched[0] == (expected[: expected.index(eos)] if eos in expected else expected)


def test_run_on_diffattn_and_hf_models(models):
    results = needle.run(models, seed=3, **TINY)
    assert list(results["models"]) == ["baseline", "diff_v1", "llama"]
    for name, r in results["models"].items():
        assert len(r["cells"]) == 2
        for cell in r["cells"]:
            assert cell["n"] == 1 and cell["outcomes"][0] in (0, 1)
            assert cell["accuracy"] == cell["outcomes"][0]
            assert cell["prompt_tokens"] == [LENGTH] and cell["seconds"] > 0
            assert len(cell["per_sample_attention"]) == 1
            if name != "diff_v1":  # softmax maps sum to 1; DIFF V1's to 1 − λ
                assert cell["total_mass"] == pytest.approx(1.0, abs=1e-5)
        assert set(r["attention_by_depth"]) == {"0%", "100%"}
        assert r["accuracy_by_length"] == {str(LENGTH): r["accuracy"]}
    text = needle.report(results)
    assert "| baseline |" in text and "Table 3" in text


def test_bad_arguments_raise_one_clear_error(models):
    with pytest.raises(ValueError, match="--queries 3 exceeds --needles 2"):
        needle.run(models[:1], **{**TINY, "queries": 3})
    with pytest.raises(ValueError, match="too short"):
        needle.run(models[:1], **{**TINY, "lengths": [20]})
    with pytest.raises(ValueError, match="context of 256 tokens"):
        needle.run(models[:1], **{**TINY, "lengths": [250]})
    with pytest.raises(ValueError, match="built-in cities"):
        needle.run(models[:1], **{**TINY, "needles": 100})
    with pytest.raises(ValueError, match="--depths"):
        needle.run(models[:1], **{**TINY, "depths": [120]})
    with pytest.raises(ValueError, match="--haystack"):
        needle.run(models[:1], **{**TINY, "haystack": "/no/such/haystack"})


def test_file_directory_and_stdlib_haystacks(models, tmp_path):
    (tmp_path / "a.txt").write_text("alpha beta gamma. " * 5)
    (tmp_path / "b.txt").write_text("delta epsilon. " * 5)
    tokenizer = models[0].tokenizer
    from_dir = needle.haystack_ids(tokenizer, str(tmp_path), 300)
    from_file = needle.haystack_ids(tokenizer, str(tmp_path / "a.txt"), 300)
    assert len(from_dir) >= 300 and len(from_file) >= 300
    assert "delta" in tokenizer.decode(from_dir) and "delta" not in tokenizer.decode(from_file)
    assert len(needle.haystack_ids(tokenizer, "stdlib", 300)) >= 300


def test_command_line(model_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["eval", "needle", str(model_dirs["diff_v1"]), "--out", str(out), "--quiet"]
    tiny = ["--needles", "2", "--lengths", str(LENGTH), "--depths", "0", "50", "--samples", "1"]
    assert main([*args, *tiny]) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["experiment"] == "needle"
    cells = record["results"]["models"]["diff_v1"]["cells"]
    assert [c["depth"] for c in cells] == [0, 50]
    assert (out / "needle_diff_v1.png").is_file()
    assert "Table 2" in (out / "report.md").read_text()
    capsys.readouterr()
    bad = main([*args, "--overwrite", *tiny, "--queries", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert bad == 2 and len(err) == 1 and "--queries 3 exceeds --needles 2" in err[0]
