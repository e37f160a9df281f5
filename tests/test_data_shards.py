"""Token shards: EOS boundaries, memmap round trip, dtypes, corruption errors, streaming, split."""

from __future__ import annotations

import json
import random

from extras import require_extra

pytestmark = require_extra("train")

import numpy as np
import pytest

from diffattn.data import (
    ShardSet,
    ShardWriter,
    Tokenizer,
    is_validation_document,
    token_dtype,
    write_token_shards,
)


class CharTokenizer:
    """One id per character (offset past EOS = 0); vocabulary size chosen by the test."""

    def __init__(self, vocab_size: int = 1000) -> None:
        self.name = f"chars:{vocab_size}"
        self.vocab_size = vocab_size
        self.eos_id = 0

    def encode(self, text: str) -> list[int]:
        return [1 + (ord(c) % (self.vocab_size - 1)) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i - 1) for i in ids)

    def save(self, directory):
        raise NotImplementedError


def _docs(n: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def test_dtype_choice():
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    with pytest.raises(ValueError):
        token_dtype(0)


def test_documents_end_with_eos_and_round_trip(tmp_path):
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    docs = _docs()
    result = write_token_shards(docs, tok, tmp_path)
    data = result.train
    assert result.valid.num_tokens == 0 and result.documents == len(docs)
    assert data.num_documents == len(docs)
    assert data.num_tokens == sum(len(d) + 1 for d in docs)
    stream = data.read(0, data.num_tokens)
    assert stream.dtype == np.int64
    assert stream.tolist() == [i for d in docs for i in [*tok.encode(d), tok.eos_id]]
    assert [tok.decode(ids) for ids in data.documents()] == docs
    assert isinstance(data.shards[0].tokens, np.memmap)
    assert data.dtype == np.uint16
    # Reopening from disk gives the same set; no temporary files are left behind.
    reopened = ShardSet.open(tmp_path / "train", verify="sha256")
    assert reopened.fingerprint == data.fingerprint
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]
    manifest = json.loads((tmp_path / "train" / "manifest.json").read_text())
    assert manifest["tokens"] == data.num_tokens and manifest["tokenizer"] == tok.name


def test_uint32_for_large_vocabularies(tmp_path):
    tok = CharTokenizer(vocab_size=100_000)
    docs = ["\U00011170 big ids", "more"]  # chr(70000)
    data = write_token_shards(docs, tok, tmp_path).train
    assert data.dtype == np.uint32
    assert max(data.read(0, data.num_tokens)) > 65535
    assert [tok.decode(ids) for ids in data.documents()] == docs


def test_out_of_vocabulary_id_is_refused(tmp_path):
    writer = ShardWriter(tmp_path, vocab_size=10, eos_id=0, tokenizer_name="t")
    with pytest.raises(ValueError, match="token id 10 is outside the vocabulary"):
        writer.add([1, 10])


def test_streaming_with_tiny_buffer_matches_and_splits_shards(tmp_path):
    tok = CharTokenizer()
    docs = _docs(200, seed=1)
    big = write_token_shards(docs, tok, tmp_path / "big").train
    small = write_token_shards(
        docs, tok, tmp_path / "small", buffer_tokens=7, shard_tokens=500, batch_bytes=64
    ).train
    assert len(big.shards) == 1 and len(small.shards) > 5
    assert small.read(0, small.num_tokens).tolist() == big.read(0, big.num_tokens).tolist()
    assert [d.tolist() for d in small.documents()] == [d.tolist() for d in big.documents()]
    # Shards start new at document boundaries, so every shard ends with EOS.
    assert all(s.tokens[-1] == tok.eos_id for s in small.shards)
    # Reads across shard boundaries.
    start = small.shards[0].num_tokens - 3
    assert small.read(start, 10).tolist() == big.read(start, 10).tolist()
    with pytest.raises(IndexError):
        small.read(small.num_tokens - 1, 2)


def _one_shard(tmp_path):
    write_token_shards(_docs(), CharTokenizer(), tmp_path)
    return tmp_path / "train" / "shard-00000.bin"


def test_truncated_shard_names_the_file(tmp_path):
    path = _one_shard(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(ValueError, match=r"shard-00000\.bin: corrupt token shard: truncated"):
        ShardSet.open(tmp_path / "train")
    path.write_bytes(data[:10])
    with pytest.raises(ValueError, match=r"shard-00000\.bin.*truncated"):
        ShardSet.open(tmp_path / "train")


def test_corrupt_header_and_flipped_bits_name_the_file(tmp_path):
    path = _one_shard(tmp_path)
    original = path.read_bytes()
    path.write_bytes(b"NOTMAGIC" + original[8:])
    with pytest.raises(ValueError, match=r"shard-00000\.bin: corrupt token shard: bad magic"):
        ShardSet.open(tmp_path / "train")
    flipped = bytearray(original)
    flipped[64] ^= 0x01  # first token
    path.write_bytes(bytes(flipped))
    ShardSet.open(tmp_path / "train")  # the size check cannot see a flipped bit ...
    with pytest.raises(ValueError, match=r"shard-00000\.bin: corrupt token shard: sha256"):
        ShardSet.open(tmp_path / "train", verify="sha256")  # ... the hash does
    path.write_bytes(original + b"\0\0")
    with pytest.raises(ValueError, match="trailing bytes"):
        ShardSet.open(tmp_path / "train")


def test_open_list_of_shard_files(tmp_path):
    tok = CharTokenizer()
    data = write_token_shards(_docs(100), tok, tmp_path, shard_tokens=300).train
    files = sorted((tmp_path / "train").glob("*.bin"))
    assert len(files) > 1
    listed = ShardSet.open(files)
    assert listed.num_tokens == data.num_tokens
    assert listed.fingerprint == data.fingerprint
    with pytest.raises(ValueError, match="not a token shard set"):
        ShardSet.open(tmp_path / "missing")


def test_validation_split_by_document_is_disjoint_and_deterministic(tmp_path):
    tok = CharTokenizer()
    docs = [f"document number {i} " * (1 + i % 5) for i in range(300)]
    a = write_token_shards(docs, tok, tmp_path / "a", valid_fraction=0.2, seed=3)
    b = write_token_shards(list(reversed(docs)), tok, tmp_path / "b", valid_fraction=0.2, seed=3)
    c = write_token_shards(docs, tok, tmp_path / "c", valid_fraction=0.2, seed=4)

    def texts(data):
        return {tok.decode(ids) for ids in data.documents()}

    train, valid = texts(a.train), texts(a.valid)
    assert not train & valid and train | valid == set(docs)
    assert 30 <= len(valid) <= 90  # ~60 expected
    assert (
        a.valid.fingerprint
        == write_token_shards(
            docs, tok, tmp_path / "again", valid_fraction=0.2, seed=3
        ).valid.fingerprint
    )
    assert texts(b.valid) == valid  # by content, not by position
    assert texts(c.valid) != valid  # the seed matters
    assert all(is_validation_document(d, seed=3, valid_fraction=0.2) for d in valid)
    assert not is_validation_document(docs[0], seed=3, valid_fraction=0.0)
