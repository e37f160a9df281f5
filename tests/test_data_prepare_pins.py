"""prepare_data pinned where the end-to-end tests leave room: the cache key's formula, the
prepared.json record, the stats' fields, the exact empty-corpus messages and where the
no-validation warning points (the caller's line)."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest

from diffattn.data import DataConfig, prepare_data
from diffattn.data.prepare import PREPARED_FORMAT
from diffattn.data.shards import FORMAT_VERSION
from diffattn.data.sources import fingerprint_sources
from diffattn.data.tokenizers import tokenizer_fingerprint


def _hash(payload):
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _config(tmp_path, **changes):
    root = tmp_path / "corpus"
    root.mkdir(exist_ok=True)
    for i in range(12):
        (root / f"d{i:02d}.txt").write_text(f"doc {i} " + "alpha beta gamma " * (i + 1) + "\n")
    fields = dict(sources=[str(root)], tokenizer="bpe:300", valid_fraction=0.25)
    return DataConfig(**{**fields, "cache_dir": str(tmp_path / "cache"), **changes})


def _one_document(tmp_path, tokenizer, valid_fraction):
    """A corpus of one document, cached under ``tmp_path``."""
    (tmp_path / "one.txt").write_text("a single document")
    sources = [str(tmp_path / "one.txt")]
    return DataConfig(
        sources=sources, tokenizer=tokenizer, valid_fraction=valid_fraction,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip


def test_cache_key_record_and_stats_are_pinned(tmp_path):
    config = _config(tmp_path)
    data = prepare_data(config, progress=False)
    sources = fingerprint_sources(
        config.sources,
        text_field=config.text_field,
        document_split=config.document_split,
        max_bytes=config.max_bytes,
    )
    key = _hash(
        {
            "format": FORMAT_VERSION,
            "sources": sources,
            "tokenizer": tokenizer_fingerprint(data.tokenizer),
            "valid_fraction": config.valid_fraction,
            "seed": config.seed,
            "shard_tokens": config.shard_tokens,
        }
    )[:24]
    assert data.directory == config.cache_path / "shards" / key
    assert sorted(p.name for p in data.directory.iterdir()) == [
        "prepared.json",
        "tokenizer",
        "train",
        "valid",
    ]
    text = (data.directory / "prepared.json").read_text(encoding="utf-8")
    record = json.loads(text)
    assert text == json.dumps(record, indent=2) + "\n"
    assert list(record) == ["format", "version", "config", "stats"]
    assert record["format"] == PREPARED_FORMAT and record["version"] == FORMAT_VERSION
    assert record["config"] == config.to_dict()
    stats = data.stats
    assert record["stats"] == stats.to_dict()
    assert stats.fingerprint == _hash([data.train.fingerprint, data.valid.fingerprint])
    assert stats.source_fingerprint == sources
    assert (stats.tokenizer, stats.vocab_size) == (data.tokenizer.name, data.tokenizer.vocab_size)
    assert stats.documents == 12 == stats.files and stats.tokens == (
        stats.train_tokens + stats.valid_tokens
    )
    assert (stats.train_tokens, stats.valid_tokens) == (
        data.train.num_tokens,
        data.valid.num_tokens,
    )
    assert stats.text_bytes == sum(len(p.read_bytes()) for p in (tmp_path / "corpus").iterdir())
    assert not stats.truncated and stats.clean and stats.seconds >= 0


def test_empty_corpus_messages_are_exact(tmp_path):
    trained = prepare_data(_config(tmp_path), progress=False)
    config = _one_document(tmp_path, f"hf:{trained.directory / 'tokenizer'}", 0.999)
    with pytest.raises(ValueError) as caught:
        prepare_data(config, progress=False)
    assert str(caught.value) == (
        "empty corpus: all 1 document(s) fell into the validation split "
        f"(valid_fraction=0.999); no training tokens in sources {list(config.sources)}"
    )
    with pytest.raises(ValueError) as caught:
        prepare_data(config.replace(tokenizer="bpe:300"), progress=False)
    assert str(caught.value) == (
        f"empty corpus: no training documents to learn a BPE from in sources {list(config.sources)}"
    )
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError) as caught:
        prepare_data(config.replace(sources=[str(tmp_path / "empty.txt")]), progress=False)
    assert str(caught.value) == (
        f"empty corpus: no documents in sources {[str(tmp_path / 'empty.txt')]}"
    )


def test_no_validation_warning_points_at_the_caller(tmp_path):
    config = _one_document(tmp_path, "bpe:300", 0.001)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_data(config, progress=False)
    (warning,) = [w for w in caught if "valid shard set" in str(w.message)]
    assert warning.filename == __file__
    assert str(warning.message) == (
        f"no document of the 1 in sources {list(config.sources)} fell into the validation "
        "split (valid_fraction=0.001); the valid shard set is empty"
    )


def test_notices_go_to_stderr_on_build_and_on_a_cache_hit(tmp_path, capsys):
    config = _config(tmp_path)
    (tmp_path / "corpus" / "odd.txt").write_bytes(b"caf\xe9\n")
    first = prepare_data(config, progress=False)
    notice = first.stats.text_notice()
    assert notice is not None and capsys.readouterr().err == notice + "\n"
    assert prepare_data(config, progress=False).cached
    assert capsys.readouterr().err == ""  # a cache hit is quiet without progress
    assert prepare_data(config, progress=True).cached
    assert capsys.readouterr().err == notice + "\n"
