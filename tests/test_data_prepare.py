"""DataConfig validation and prepare_data: end to end on fixtures and on the embedded corpus."""

from __future__ import annotations

import json

import pytest

from diffattn.data import BatchLoader, DataConfig, load_prepared_tokenizer, prepare_data


def _corpus(tmp_path, n=60):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(n):
        body = f"Document {i}: " + " ".join(f"word{(i * j) % 17}" for j in range(40)) + "\n"
        (root / f"doc{i:03d}.txt").write_text(body)
    (root / "odd.txt").write_bytes(b"latin-1 caf\xe9\n")
    return root


def test_config_defaults_and_validation(tmp_path, monkeypatch):
    config = DataConfig()
    assert config.sources == ("stdlib",) and config.tokenizer == "bpe:8192"
    assert config.text_field == "text" and config.max_bytes is None
    monkeypatch.setenv("DIFFATTN_CACHE", str(tmp_path / "c"))
    assert config.cache_path == tmp_path / "c" / "data"
    monkeypatch.delenv("DIFFATTN_CACHE")
    assert config.cache_path.parts[-3:] == (".cache", "diffattn", "data")
    assert DataConfig.from_dict(config.to_dict()) == config
    assert DataConfig(sources="a.txt").sources == ("a.txt",)
    with pytest.raises(ValueError, match="unknown key\\(s\\) 'srcs'"):
        DataConfig.from_dict({"srcs": ["x"]})
    bad = {
        "sources": [],
        "tokenizer": "wordpiece",
        "valid_fraction": 1.0,
        "seed": -1,
        "max_bytes": 0,
        "document_split": "sentence",
        "text_field": "",
        "shard_tokens": 0,
    }
    for key, value in bad.items():
        with pytest.raises(ValueError, match=rf"DataConfig\.{key}"):
            DataConfig(**{key: value})
    with pytest.raises(ValueError, match=r"DataConfig\.sources: bad dataset source"):
        DataConfig(sources=["hf:"])


def test_prepare_end_to_end_and_cache_hit(tmp_path):
    corpus = _corpus(tmp_path)
    config = DataConfig(
        sources=[str(corpus)],
        tokenizer="bpe:300",
        valid_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    data = prepare_data(config, progress=False)
    stats = data.stats
    assert not data.cached
    assert stats.documents == 61 == stats.train_documents + stats.valid_documents
    assert stats.valid_documents > 0
    assert stats.tokens == data.train.num_tokens + data.valid.num_tokens
    assert (stats.files, stats.replaced_files, stats.replaced_bytes) == (61, 1, 1)
    assert stats.vocab_size == data.tokenizer.vocab_size == data.train.vocab_size
    assert data.train.tokenizer == "bpe:300"
    batch = next(BatchLoader(data.train, batch_size=2, seq_len=16))
    assert int(batch.max()) < data.tokenizer.vocab_size

    again = prepare_data(config.to_dict(), progress=False)
    assert again.cached and again.directory == data.directory
    assert again.stats == stats
    assert again.train.fingerprint == data.train.fingerprint
    saved = load_prepared_tokenizer(data.directory)
    assert saved.encode("Document 7: word3") == data.tokenizer.encode("Document 7: word3")
    record = json.loads((data.directory / "prepared.json").read_text())
    assert record["config"]["tokenizer"] == "bpe:300"

    # Another split seed is another preparation; editing a file is too.
    other = prepare_data(config.replace(seed=1), progress=False)
    assert other.directory != data.directory
    (corpus / "doc000.txt").write_text("changed text\n")
    changed = prepare_data(config, progress=False)
    assert not changed.cached and changed.directory != data.directory


def test_corrupt_cache_entry_names_the_file(tmp_path):
    config = DataConfig(
        sources=[str(_corpus(tmp_path, 10))],
        tokenizer="bpe:300",
        valid_fraction=0.0,
        cache_dir=str(tmp_path / "c"),
    )
    data = prepare_data(config, progress=False)
    shard = data.train.shards[0].path
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"shard-00000\.bin.*truncated.*delete it to rebuild"):
        prepare_data(config, progress=False)


def test_empty_corpus_names_the_sources(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("\n")
    config = DataConfig(
        sources=[str(tmp_path / "empty.txt"), str(tmp_path / "empty.jsonl")],
        tokenizer="bpe:300",
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match=r"empty corpus: no documents in sources \[.*empty\.txt"):
        prepare_data(config, progress=False)
    with pytest.raises(ValueError, match="no such file or directory"):
        prepare_data(config.replace(sources=[str(tmp_path / "missing")]), progress=False)
    assert not (tmp_path / "cache" / "shards").exists() or not any(
        (tmp_path / "cache" / "shards").iterdir()
    )


def test_all_documents_in_validation_is_an_error(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    config = DataConfig(
        sources=[str(tmp_path / "one.txt")],
        tokenizer="bpe:300",
        valid_fraction=0.999,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match="empty corpus"):
        prepare_data(config, progress=False)


def test_no_validation_document_warns(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    config = DataConfig(
        sources=[str(tmp_path / "one.txt")],
        tokenizer="bpe:300",
        valid_fraction=0.001,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.warns(UserWarning, match="valid shard set is empty"):
        data = prepare_data(config, progress=False)
    assert data.valid.num_tokens == 0 and data.train.num_documents == 1


def test_default_corpus_prepares(tmp_path):
    config = DataConfig(tokenizer="bpe:512", max_bytes=400_000, cache_dir=str(tmp_path))
    data = prepare_data(config)  # progress on: a no-op without a terminal
    assert data.stats.text_bytes == 400_000 and data.stats.truncated
    assert data.train.num_tokens > 50_000 and data.valid.num_tokens > 0
    assert prepare_data(config, progress=False).stats.fingerprint == data.stats.fingerprint
