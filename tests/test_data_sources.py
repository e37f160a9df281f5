"""Document sources: every source type on small fixtures, bad UTF-8 counting, caps, errors."""

from __future__ import annotations

import gzip
import json

import pytest

from diffattn.data import SourceStats, decode_utf8, iter_documents, parse_hf_spec
from diffattn.data.corpus import default_corpus, stdlib_files
from diffattn.data.sources import check_source_spec, fingerprint_sources, read_text_file


def _write(path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)


def test_text_file_is_one_document(tmp_path):
    _write(tmp_path / "a.txt", "first line\n\nsecond paragraph\n")
    stats = SourceStats()
    docs = list(iter_documents(str(tmp_path / "a.txt"), stats=stats))
    assert docs == ["first line\n\nsecond paragraph\n"]
    assert (stats.files, stats.documents, stats.bytes) == (1, 1, len(docs[0].encode()))


def test_paragraph_and_line_splits(tmp_path):
    _write(tmp_path / "a.txt", "one\ntwo\n\n\nthree\n   \nfour")
    assert list(read_text_file(tmp_path / "a.txt", split="paragraph")) == [
        "one\ntwo",
        "three",
        "four",
    ]
    assert list(read_text_file(tmp_path / "a.txt", split="line")) == [
        "one",
        "two",
        "three",
        "   ",
        "four",
    ]


def test_directory_and_glob_are_sorted_and_recursive(tmp_path):
    _write(tmp_path / "d" / "b.txt", "B")
    _write(tmp_path / "d" / "a.txt", "A")
    _write(tmp_path / "d" / "sub" / "c.txt", "C")
    _write(tmp_path / "d" / ".hidden", "H")
    assert list(iter_documents(str(tmp_path / "d"))) == ["A", "B", "C"]
    assert list(iter_documents(str(tmp_path / "d" / "*.txt"))) == ["A", "B"]
    assert list(iter_documents(str(tmp_path / "d" / "**" / "*.txt"))) == ["A", "B", "C"]
    # Several sources keep their given order.
    assert list(iter_documents([str(tmp_path / "d" / "b.txt"), str(tmp_path / "d" / "a.txt")])) == [
        "B",
        "A",
    ]


def test_jsonl_text_field_and_gzip(tmp_path):
    rows = [{"text": "alpha", "id": 1}, {"text": "beta"}, {"text": None}, {"body": "x", "text": ""}]
    lines = "\n".join(json.dumps(r) for r in rows) + "\n\n"
    _write(tmp_path / "a.jsonl", lines)
    assert list(iter_documents(str(tmp_path / "a.jsonl"))) == ["alpha", "beta"]
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    assert list(iter_documents(str(tmp_path / "b.jsonl.gz"))) == ["alpha", "beta"]
    _write(tmp_path / "c.jsonl", json.dumps({"body": "gamma"}) + "\n")
    assert list(iter_documents(str(tmp_path / "c.jsonl"), text_field="body")) == ["gamma"]


def test_jsonl_errors_name_file_and_line(tmp_path):
    _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        list(iter_documents(str(tmp_path / "bad.jsonl")))
    _write(tmp_path / "field.jsonl", '{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"field\.jsonl:1: no text field 'text'"):
        list(iter_documents(str(tmp_path / "field.jsonl")))
    _write(tmp_path / "type.jsonl", '{"text": 3}\n')
    with pytest.raises(ValueError, match="holds int"):
        list(iter_documents(str(tmp_path / "type.jsonl")))


@pytest.mark.extra("parquet")
def test_parquet_streams_batches(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}" for i in range(2500)] + [None, "last"]
    table = pa.table({"text": texts, "n": list(range(len(texts)))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=700)
    docs = list(iter_documents(str(tmp_path / "a.parquet")))
    assert docs == [t for t in texts if t]
    with pytest.raises(ValueError, match=r"a\.parquet: no column 'body'"):
        list(iter_documents(str(tmp_path / "a.parquet"), text_field="body"))
    binary = pa.table({"text": pa.array([b"ok", b"bad \xff\xfe"], type=pa.binary())})
    pq.write_table(binary, tmp_path / "b.parquet")
    stats = SourceStats()
    assert list(iter_documents(str(tmp_path / "b.parquet"), stats=stats)) == [
        "ok",
        "bad \ufffd\ufffd",
    ]
    assert stats.replaced_bytes == 2


def test_bad_utf8_is_replaced_and_counted(tmp_path):
    _write(tmp_path / "d" / "good.txt", "fine")
    _write(tmp_path / "d" / "latin1.txt", "caf\xe9 na\xefve".encode("latin-1"))
    _write(tmp_path / "d" / "cut.txt", "end \xe2\x82".encode("latin-1"))  # truncated euro sign
    _write(
        tmp_path / "d" / "rows.jsonl", b'{"text": "a\xff"}\n{"text": "b"}\n{"text": "c\xfe\xfe"}\n'
    )
    stats = SourceStats()
    docs = list(iter_documents(str(tmp_path / "d"), stats=stats))
    assert docs == ["end \ufffd", "fine", "caf\ufffd na\ufffdve", "a\ufffd", "b", "c\ufffd\ufffd"]
    assert stats.replaced_files == 3
    assert stats.replaced_documents == 4
    assert stats.replaced_bytes == 2 + 2 + 1 + 2
    # The same counts in line-streaming mode: '\n' never splits a UTF-8 sequence.
    stats_lines = SourceStats()
    list(iter_documents(str(tmp_path / "d" / "latin1.txt"), split="line", stats=stats_lines))
    assert stats_lines.replaced_bytes == 2


def test_decode_utf8_counts_exactly():
    assert decode_utf8("plain ü".encode()) == ("plain ü", 0)
    text, replaced = decode_utf8(b"a\xffb\xc3")
    assert (text, replaced) == ("a\ufffdb\ufffd", 2)
    # A genuine U+FFFD in valid input is not counted.
    assert decode_utf8("\ufffd".encode()) == ("\ufffd", 0)


def test_max_bytes_cuts_at_a_character_boundary(tmp_path):
    _write(tmp_path / "a.txt", "ab")
    _write(tmp_path / "b.txt", "cé€d")
    stats = SourceStats()
    docs = list(iter_documents(str(tmp_path / "*.txt"), max_bytes=5, stats=stats))
    assert docs == ["ab", "cé"]
    assert stats.truncated and stats.bytes == 5
    assert list(iter_documents(str(tmp_path / "*.txt"), max_bytes=6)) == ["ab", "cé"]


def test_missing_and_malformed_sources(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        list(iter_documents(str(tmp_path / "missing.txt")))
    with pytest.raises(ValueError, match="matches no files"):
        list(iter_documents(str(tmp_path / "*.none")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no files"):
        list(iter_documents(str(tmp_path / "empty")))
    for bad in ("", 3, "hf:", "hf:name@", "hf:a:@b", "hf:x?token=1", "stdlib:", "stdlib:-5"):
        with pytest.raises(ValueError, match="bad"):
            check_source_spec(bad)
    with pytest.raises(ValueError, match="max_bytes"):
        list(iter_documents("stdlib", max_bytes=0))


def test_hf_spec_parsing():
    spec = parse_hf_spec("hf:user/data:wiki@validation?data_files=/x/*.jsonl")
    assert (spec.name, spec.config, spec.split) == ("user/data", "wiki", "validation")
    assert spec.options == (("data_files", "/x/*.jsonl"),)
    assert parse_hf_spec("hf:text").split == "train"


@pytest.mark.extra("datasets")
def test_hf_datasets_local_builder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    rows = [{"text": "one"}, {"text": "two"}, {"text": "three"}]
    _write(tmp_path / "rows.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    spec = f"hf:json@train?data_files={tmp_path / 'rows.jsonl'}"
    stats = SourceStats()
    assert list(iter_documents(spec, stats=stats)) == ["one", "two", "three"]
    assert stats.documents == 3
    with pytest.raises(ValueError, match="no column 'body'"):
        list(iter_documents(spec, text_field="body"))


def test_fingerprint_changes_with_content(tmp_path):
    _write(tmp_path / "a.txt", "one")
    first = fingerprint_sources([str(tmp_path / "a.txt")])
    assert first == fingerprint_sources([str(tmp_path / "a.txt")])
    assert first != fingerprint_sources([str(tmp_path / "a.txt")], max_bytes=10)
    _write(tmp_path / "a.txt", "one more")
    assert first != fingerprint_sources([str(tmp_path / "a.txt")])


def test_embedded_corpus_is_stdlib_and_deterministic():
    files = stdlib_files()
    parts = {part for f in files for part in f.parts}
    assert not parts & {"site-packages", "test", "tests", "idle_test"}
    assert all(f.suffix == ".py" for f in files)
    stats = SourceStats()
    docs = list(default_corpus(max_bytes=200_000, stats=stats))
    assert docs and stats.bytes == 200_000
    assert docs == list(default_corpus(max_bytes=200_000))
    assert docs[0] == files[0].read_text(encoding="utf-8") or files[0].stat().st_size == 0
    assert any("def " in d for d in docs)
    # The source spec form: 'stdlib:N' caps, plain 'stdlib' caps at 16 MB, 'stdlib:all' not.
    assert list(iter_documents("stdlib:200000")) == docs
    assert check_source_spec("stdlib:all") == "stdlib:all"
