"""``megatron:`` and ``datatrove:`` sources read the token files those projects' own writers
write (megatron-core's ``IndexedDatasetBuilder``, datatrove's ``DocumentTokenizer``): the
documents read back equal the documents written, in every token width; every document ends in
exactly one EOS whether the files hold one or not; the validation split follows the documented
token hash; a corrupt file is one error naming it."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from extras import require_extra

pytestmark = require_extra("formats", "train", "hf")

import numpy as np
import torch
from datatrove.data import Document
from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tokenizers import Tokenizer, models, pre_tokenizers

from diffattn.data import prepare_data
from diffattn.data.external import open_token_files

EOS = 0
TOKENIZER_OPTIONS = inspect.signature(DocumentTokenizer).parameters


# ------------------------------------------------------------------------------------------
# writers: the projects' own code
def word_tokenizer(directory: Path, words: int) -> Path:
    """A tokenizer directory whose word ``wK`` is id K (K < ``words``) and EOS is id 0."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<|endoftext|>": EOS, **{f"w{k}": k for k in range(1, words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def documents(seed: int, count: int, high: int) -> list[list[int]]:
    """``count`` documents of ids in [1, high): lengths 1, 7, 129, 2, 1, then random."""
    rng = random.Random(seed)
    lengths = [1, 7, 129, 2, 1] + [rng.randint(1, 90) for _ in range(count - 5)]
    return [[rng.randrange(1, high) for _ in range(n)] for n in lengths]


def write_megatron(prefix: Path, docs, dtype, *, eos: bool = False, sentences: bool = False):
    """``docs`` through megatron-core's builder (``add_item`` + ``end_document``, or
    ``add_document`` with two sentences per document when ``sentences``)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        ids = doc + ([EOS] if eos else [])
        if sentences and len(ids) > 1:
            cut = len(ids) // 2
            builder.add_document(torch.tensor(ids), lengths=[cut, len(ids) - cut])
        else:
            builder.add_item(torch.tensor(ids))
            builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def write_datatrove(
    folder: Path, docs, tokenizer: Path, *, eos: bool = False, ranks: int = 1, shuffle: bool = False
):
    """``docs`` (as the text ``w3 w17 ...``) through datatrove's ``DocumentTokenizer``, split
    over ``ranks`` tasks (one ``.ds`` file each)."""
    per_rank = -(-len(docs) // ranks)
    # older datatrove releases call the option shuffle
    shuffling = "shuffle_documents" if "shuffle_documents" in TOKENIZER_OPTIONS else "shuffle"
    for rank in range(ranks):
        step = DocumentTokenizer(
            str(folder),
            tokenizer_name_or_path=str(tokenizer / "tokenizer.json"),
            eos_token="<|endoftext|>" if eos else None,
            seed=0,
            **{shuffling: shuffle},
        )
        part = docs[rank * per_rank : (rank + 1) * per_rank]
        texts = (Document(text=" ".join(f"w{k}" for k in d), id=str(i)) for i, d in enumerate(part))
        step.run(texts, rank=rank)
    return folder


def prepare(spec: str, tokenizer_dir: Path, cache: Path, **changes):
    config = {
        "sources": [spec],
        "tokenizer": f"hf:{tokenizer_dir}",
        "max_bytes": None,
        "valid_fraction": 0.0,
        "cache_dir": str(cache),
        **changes,
    }
    return prepare_data(config, progress=False)


def stream_of(docs) -> list[int]:
    """What a diffattn shard set of ``docs`` holds: each document, then EOS."""
    return [t for d in docs for t in [*d, EOS]]


def held_out(doc: list[int], seed: int, fraction: float) -> bool:
    """The documented rule: keyed BLAKE2b of the ids (no final EOS) as little-endian uint32."""
    key = seed.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(np.asarray(doc, "<u4").tobytes(), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return word_tokenizer(tmp_path_factory.mktemp("small-tokenizer"), 1000)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """More than 65,536 ids: datatrove writes uint32 tokens."""
    return word_tokenizer(tmp_path_factory.mktemp("big-tokenizer"), 70_000)


# ------------------------------------------------------------------------------------------
# read back what was written
@pytest.mark.parametrize(
    ("dtype", "high"), [(np.uint16, 1000), (np.int32, 70_000), (np.int64, 70_000)]
)
@pytest.mark.parametrize("eos", [False, True])
def test_megatron_documents_read_back_as_written(tmp_path, small, big, dtype, high, eos):
    docs = documents(1, 60, high)
    prefix = write_megatron(tmp_path / "corpus", docs, dtype, eos=eos, sentences=True)
    (file,) = open_token_files(f"megatron:{prefix}")
    assert file.dtype == np.dtype(dtype) and file.num_documents == len(docs)
    tokens = np.asarray(file.tokens())
    written = [[*d, EOS] if eos else d for d in docs]
    read = [tokens[a:b].tolist() for a, b in zip(file.bounds[:-1], file.bounds[1:], strict=True)]
    assert read == written
    data = prepare(f"megatron:{prefix}", small if high <= 1000 else big, tmp_path / "cache")
    assert [d.tolist() for d in data.train.documents()] == docs
    assert data.train.read(0, data.train.num_tokens).tolist() == stream_of(docs)
    assert data.valid.num_tokens == 0 and data.stats.train_documents == len(docs)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("eos", [False, True])
def test_datatrove_documents_read_back_as_written(tmp_path, small, big, width, eos):
    tokenizer, high = (small, 1000) if width == 2 else (big, 70_000)
    docs = documents(2, 50, high)
    folder = write_datatrove(tmp_path / "dt", docs, tokenizer, eos=eos, ranks=2)
    files = open_token_files(f"datatrove:{folder}")
    assert [f.path.name for f in files] == ["00000_unshuffled.ds", "00001_unshuffled.ds"]
    for file in files:
        assert file.path.stat().st_size == width * file.num_tokens
        assert file.dtype.itemsize == width and file.token_bytes == width
    data = prepare(f"datatrove:{folder}", tokenizer, tmp_path / "cache")
    assert [d.tolist() for d in data.train.documents()] == docs
    assert data.train.read(0, data.train.num_tokens).tolist() == stream_of(docs)
    assert data.train.dtype.itemsize == width


@pytest.mark.parametrize(
    "first_line",
    ["{name}", "Unknown Tokenizer|2|2"],
    ids=["datatrove-0.2-name-only", "datatrove-0.3-unknown-tokenizer"],
)
def test_metadata_of_older_datatrove_releases(tmp_path, small, first_line):
    """Before 0.3 the first line is the tokenizer name alone (2-byte tokens); 0.3 to 0.5 write
    ``Unknown Tokenizer|2|2`` when no tokenizer is named."""
    docs = documents(14, 30, 1000)
    folder = write_datatrove(tmp_path / "dt", docs, small)
    meta = folder / "00000_unshuffled.ds.metadata"
    count = meta.read_text().splitlines()[1]
    line = first_line.format(name=small / "tokenizer.json")
    meta.write_text(f"{line}\n{count}\n{count} T")
    (file,) = open_token_files(f"datatrove:{folder}")
    assert file.token_bytes == (2 if "|" in line else None) and file.dtype.itemsize == 2
    assert file.tokenizer == (None if line.startswith("Unknown") else line)
    data = prepare(f"datatrove:{folder}", small, tmp_path / "cache")
    assert [d.tolist() for d in data.train.documents()] == docs


def test_datatrove_shuffled_documents_are_the_written_ones(tmp_path, small):
    docs = documents(3, 40, 1000)
    folder = write_datatrove(tmp_path / "dt", docs, small, eos=True, shuffle=True)
    data = prepare(f"datatrove:{folder}", small, tmp_path / "cache")
    read = [d.tolist() for d in data.train.documents()]
    assert read != docs and sorted(read) == sorted(docs)


def test_reads_at_every_offset_match_the_whole_stream(tmp_path, small):
    """Windows that start and end inside documents, on appended EOS and across files."""
    docs = documents(4, 30, 1000)
    write_megatron(tmp_path / "a", docs[:15], np.uint16, eos=True)
    write_megatron(tmp_path / "b", docs[15:], np.uint16)
    data = prepare(f"megatron:{tmp_path}/[ab]", small, tmp_path / "cache")
    stream = data.train
    whole = stream.read(0, stream.num_tokens)
    assert whole.tolist() == stream_of(docs)
    for start in range(0, stream.num_tokens - 1, 5):
        for length in (0, 1, 7, 64):
            length = min(length, stream.num_tokens - start)
            assert np.array_equal(stream.read(start, length), whole[start : start + length])
    with pytest.raises(IndexError):
        stream.read(stream.num_tokens - 1, 2)


def test_gathered_reads_equal_reads_segment_by_segment(tmp_path, small):
    """The index-array gather of windows over many segments against the per-segment copy,
    over two files, appended and stored EOS, documents of 1 to 9 tokens and a split that
    leaves gaps between the train documents."""
    rng = random.Random(13)
    docs = [[rng.randrange(1, 1000) for _ in range(rng.randint(1, 9))] for _ in range(400)]
    write_megatron(tmp_path / "a", docs[:150], np.int32, eos=True)
    write_megatron(tmp_path / "b", docs[150:], np.uint16)
    data = prepare(f"megatron:{tmp_path}/[ab]", small, tmp_path / "cache", valid_fraction=0.3)
    for stream in (data.train, data.valid):
        whole = np.asarray(stream_of([d.tolist() for d in stream.documents()]))
        assert stream.segments.shape[1] > 100 and whole.shape[0] == stream.num_tokens
        for start in range(0, stream.num_tokens, 7):
            for length in (1, 2, 9, 129):
                length = min(length, stream.num_tokens - start)
                starts = stream.segments[0]
                first = int(np.searchsorted(starts, start, side="right")) - 1
                last = int(np.searchsorted(starts, start + length, side="left"))
                rows = np.asarray(stream.segments[:, first:last])
                gathered, copied = np.empty(length, np.int64), np.empty(length, np.int64)
                stream._gather(gathered, start, rows)
                stream._copy_segments(copied, start, rows)
                assert np.array_equal(gathered, copied)
                assert np.array_equal(gathered, whole[start : start + length])
                assert np.array_equal(stream.read(start, length), gathered)


# ------------------------------------------------------------------------------------------
# the validation split
def test_validation_split_follows_the_token_hash_whatever_the_format(tmp_path, small):
    docs = documents(5, 200, 1000)
    seed, fraction = 7, 0.3
    valid = [d for d in docs if held_out(d, seed, fraction)]
    train = [d for d in docs if not held_out(d, seed, fraction)]
    assert 30 < len(valid) < 90
    megatron = write_megatron(tmp_path / "m", docs, np.int32, eos=True)
    datatrove = write_datatrove(tmp_path / "dt", docs, small)
    split = {"valid_fraction": fraction, "seed": seed}
    for spec in (f"megatron:{megatron}", f"datatrove:{datatrove}"):
        data = prepare(spec, small, tmp_path / "cache", **split)
        assert [d.tolist() for d in data.valid.documents()] == valid
        assert [d.tolist() for d in data.train.documents()] == train
        assert data.valid.read(0, data.valid.num_tokens).tolist() == stream_of(valid)
        assert (data.stats.train_documents, data.stats.valid_documents) == (len(train), len(valid))
    other = prepare(
        f"megatron:{megatron}", small, tmp_path / "cache", valid_fraction=fraction, seed=8
    )
    assert [d.tolist() for d in other.valid.documents()] != valid


def test_empty_documents_and_documents_of_only_eos_are_skipped(tmp_path, small):
    docs = [[5, 6], [], [7], [EOS], [8, 9, EOS]]
    prefix = write_megatron(tmp_path / "m", docs, np.uint16)
    data = prepare(f"megatron:{prefix}", small, tmp_path / "cache")
    assert data.train.read(0, data.train.num_tokens).tolist() == [5, 6, EOS, 7, EOS, 8, 9, EOS]
    record = json.loads((data.directory / "prepared.json").read_text())
    assert record["token_files"]["skipped_empty"] == 2
    assert record["token_files"]["eos_appended"] == 2


# ------------------------------------------------------------------------------------------
# the cache
def test_cache_follows_the_files(tmp_path, small):
    docs = documents(6, 40, 1000)
    prefix = write_megatron(tmp_path / "m", docs, np.uint16)
    first = prepare(f"megatron:{prefix}", small, tmp_path / "cache", valid_fraction=0.2)
    again = prepare(f"megatron:{prefix}", small, tmp_path / "cache", valid_fraction=0.2)
    assert not first.cached and again.cached and again.directory == first.directory
    assert again.train.fingerprint == first.train.fingerprint
    bin_path = Path(f"{prefix}.bin")
    stat = bin_path.stat()
    os.utime(bin_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched = prepare(f"megatron:{prefix}", small, tmp_path / "cache", valid_fraction=0.2)
    assert not touched.cached and touched.directory != first.directory
    # the same content under a new modification time: a run resumes on it
    assert touched.train.fingerprint == first.train.fingerprint
    docs[3] = [9] * len(docs[3])
    write_megatron(prefix, docs, np.uint16)
    changed = prepare(f"megatron:{prefix}", small, tmp_path / "cache", valid_fraction=0.2)
    assert not changed.cached and changed.train.fingerprint != first.train.fingerprint


# ------------------------------------------------------------------------------------------
# bad files: one error naming the file
def _one_line_error(spec: str, tokenizer: Path, cache: Path) -> str:
    with pytest.raises(ValueError) as caught:
        prepare(spec, tokenizer, cache)
    message = str(caught.value)
    assert "\n" not in message
    return message


def _truncate(path: Path, cut: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-cut])


def _garble(path: Path, offset: int, value: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(value)] = value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "culprit", "words"),
    [
        (lambda p: _truncate(Path(f"{p}.bin"), 3), ".bin", ["truncated", "is cut at byte"]),
        (
            lambda p: Path(f"{p}.bin").write_bytes(Path(f"{p}.bin").read_bytes() + b"\0\0"),
            ".bin",
            ["trailing bytes"],
        ),
        (lambda p: _garble(Path(f"{p}.idx"), 0, b"NOTANIDX"), ".idx", ["byte 0", "magic"]),
        (lambda p: _garble(Path(f"{p}.idx"), 17, b"\x07"), ".idx", ["byte 17", "dtype code 7"]),
        (lambda p: _truncate(Path(f"{p}.idx"), 5), ".idx", ["truncated"]),
        # the first sequence pointer (right after the 40 lengths) made 2 bytes too large
        (
            lambda p: _garble(Path(f"{p}.idx"), 34 + 4 * 40 + 8, b"\xff\xff"),
            ".idx",
            ["sequence 1 starts at byte"],
        ),
        (lambda p: Path(f"{p}.bin").unlink(), ".bin", ["missing"]),
    ],
)
def test_corrupt_megatron_files_are_one_error_naming_the_file(
    tmp_path, small, damage, culprit, words
):
    prefix = write_megatron(tmp_path / "m", documents(7, 40, 1000), np.uint16)
    damage(prefix)
    message = _one_line_error(f"megatron:{prefix}", small, tmp_path / "cache")
    assert f"{prefix}{culprit}" in message and all(w in message for w in words), message
    assert not (tmp_path / "cache" / "shards").exists() or not any(
        (tmp_path / "cache" / "shards").iterdir()
    )


@pytest.mark.parametrize(
    ("damage", "culprit", "words"),
    [
        (lambda ds: Path(f"{ds}.index").unlink(), ".ds.index", ["missing"]),
        (lambda ds: _truncate(ds, 3), ".ds", ["truncated", "is cut at byte"]),
        (lambda ds: _truncate(Path(f"{ds}.index"), 1), ".ds.index", ["not a whole number"]),
        (
            lambda ds: _garble(Path(f"{ds}.index"), 8, bytes(8)),
            ".ds.index",
            ["document end 1 (byte 8)"],
        ),
        (
            lambda ds: Path(f"{ds}.metadata").write_text("nonsense"),
            ".ds.metadata",
            ["not a datatrove metadata"],
        ),
    ],
)
def test_corrupt_datatrove_files_are_one_error_naming_the_file(
    tmp_path, small, damage, culprit, words
):
    folder = write_datatrove(tmp_path / "dt", documents(8, 30, 1000), small)
    ds = folder / "00000_unshuffled.ds"
    damage(ds)
    message = _one_line_error(f"datatrove:{folder}", small, tmp_path / "cache")
    assert f"{ds}{culprit.removeprefix('.ds')}" in message, message
    assert all(w in message for w in words), message


# ------------------------------------------------------------------------------------------
# the tokenizer and the configuration
def test_ids_outside_the_named_tokenizer_are_refused(tmp_path, small):
    docs = documents(9, 20, 1000)
    docs[4][0] = 5000
    prefix = write_megatron(tmp_path / "m", docs, np.int32)
    message = _one_line_error(f"megatron:{prefix}", small, tmp_path / "cache")
    assert f"{prefix}.bin" in message and "id 5000" in message and f"hf:{small}" in message


def test_datatrove_metadata_must_name_the_same_tokenizer(tmp_path, small, big):
    folder = write_datatrove(tmp_path / "dt", documents(10, 20, 1000), small)
    copy = shutil.copytree(small, tmp_path / "renamed-copy")
    assert prepare(f"datatrove:{folder}", copy, tmp_path / "cache").stats.documents == 20
    other = word_tokenizer(tmp_path / "other", 1000)
    (other / "tokenizer.json").write_text(
        (other / "tokenizer.json").read_text().replace('"w999"', '"x999"')
    )
    message = _one_line_error(f"datatrove:{folder}", other, tmp_path / "cache")
    assert str(small / "tokenizer.json") in message and f"hf:{other}" in message
    wide = write_datatrove(tmp_path / "wide", documents(11, 20, 1000), big)
    message = _one_line_error(f"datatrove:{wide}", small, tmp_path / "cache")
    assert "4-byte tokens" in message and "00000_unshuffled.ds" in message


def test_settings_that_do_not_apply_to_token_files_are_refused(tmp_path, small):
    prefix = write_megatron(tmp_path / "m", documents(12, 20, 1000), np.uint16)
    spec = f"megatron:{prefix}"
    with pytest.raises(ValueError, match="token files hold ids only"):
        prepare(spec, small, tmp_path / "cache", tokenizer="bpe:512")
    with pytest.raises(ValueError, match=r"DataConfig\.max_bytes: 1000 applies to text sources"):
        prepare(spec, small, tmp_path / "cache", max_bytes=1000)
    with pytest.raises(ValueError, match=r"DataConfig\.document_split: 'line' applies to text"):
        prepare(spec, small, tmp_path / "cache", document_split="line")
    with pytest.raises(ValueError, match="weights"):
        prepare(spec, small, tmp_path / "cache", weights=[2.0])
    with pytest.raises(ValueError, match="cannot be mixed with text"):
        prepare(spec, small, tmp_path / "cache", sources=[spec, "stdlib"])
    with pytest.raises(ValueError, match=r"no .*m2\.idx"):
        prepare(f"megatron:{tmp_path}/m2", small, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"no \*\.ds file"):
        prepare(f"datatrove:{tmp_path}", small, tmp_path / "cache")
