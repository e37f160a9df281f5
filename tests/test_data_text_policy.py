"""Bad text in sources: binary documents skipped, invalid UTF-8 replaced, both counted and
reported once; ``strict`` refuses either with one error naming the file and the offset."""

from __future__ import annotations

import json

import pytest

from diffattn.data import DataConfig, SourceStats, iter_documents, prepare_data
from diffattn.data.sources import BINARY_SNIFF_BYTES, TextError, read_text_file
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import tiny_recipe, train_cli, write_recipe


def _write(path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _dirty_corpus(tmp_path, n=30):
    root = tmp_path / "corpus"
    for i in range(n):
        body = f"Document {i}: " + " ".join(f"word{(i * j) % 13}" for j in range(30)) + "\n"
        _write(root / f"doc{i:03d}.txt", body)
    _write(root / "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    _write(root / "latin1.txt", "caf\xe9 na\xefve\n".encode("latin-1"))
    return root


def test_binary_documents_are_skipped_and_counted(tmp_path):
    _write(tmp_path / "d" / "a.txt", "plain text")
    _write(tmp_path / "d" / "b.bin", b"head\x00tail")
    _write(tmp_path / "d" / "c.txt", "more text")
    stats = SourceStats()
    assert list(iter_documents(str(tmp_path / "d"), stats=stats)) == ["plain text", "more text"]
    assert (stats.binary_files, stats.binary_documents, stats.binary_bytes) == (1, 1, 9)
    assert stats.files == 3 and stats.documents == 2

    # Line and paragraph mode: a NUL in the first 8 KiB makes the whole file binary ...
    _write(tmp_path / "lines.bin", b"readable line\n\x00\x01\x02\nanother readable line\n")
    stats = SourceStats()
    assert list(read_text_file(tmp_path / "lines.bin", split="line", stats=stats)) == []
    assert (stats.binary_documents, stats.binary_bytes) == (1, 40)
    # ... and a NUL further on skips only the line that holds it.
    late = b"x" * BINARY_SNIFF_BYTES + b"\nfine\nbad \x00 line\nlast\n"
    _write(tmp_path / "late.txt", late)
    stats = SourceStats()
    docs = list(read_text_file(tmp_path / "late.txt", split="line", stats=stats))
    assert docs == ["x" * BINARY_SNIFF_BYTES, "fine", "last"]
    assert (stats.binary_files, stats.binary_documents) == (1, 1)

    # JSON lines: a text holding U+0000 is binary too.
    rows = [{"text": "ok"}, {"text": "nul \u0000 inside"}, {"text": "fine"}]
    _write(tmp_path / "rows.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    stats = SourceStats()
    assert list(iter_documents(str(tmp_path / "rows.jsonl"), stats=stats)) == ["ok", "fine"]
    assert stats.binary_documents == 1


def test_strict_refuses_invalid_utf8_naming_file_and_offset(tmp_path):
    _write(tmp_path / "d" / "a.txt", "fine")
    _write(tmp_path / "d" / "b.txt", b"caf\xc3\xa9 ok, then \xff here")
    with pytest.raises(TextError, match=r"b\.txt: byte 15: not valid UTF-8 \(byte 0xff\)"):
        list(iter_documents(str(tmp_path / "d"), strict=True))
    # The offset is the file's, also when it is streamed line by line.
    _write(tmp_path / "lines.txt", b"first\nsecond \xfe\n")
    with pytest.raises(TextError, match=r"lines\.txt: byte 13: not valid UTF-8"):
        list(iter_documents(str(tmp_path / "lines.txt"), split="line", strict=True))
    _write(tmp_path / "rows.jsonl", b'{"text": "a"}\n{"text": "b\xff"}\n')
    with pytest.raises(TextError, match=r"rows\.jsonl:2: byte 25: not valid UTF-8"):
        list(iter_documents(str(tmp_path / "rows.jsonl"), strict=True))
    # TextError is a ValueError: every caller that reports ValueError reports it.
    assert issubclass(TextError, ValueError)


def test_strict_refuses_binary_and_accepts_clean_text(tmp_path):
    _write(tmp_path / "d" / "a.txt", "fine")
    _write(tmp_path / "d" / "b.bin", b"head\x00tail")
    with pytest.raises(TextError, match=r"b\.bin: byte 4: binary data \(NUL byte\)"):
        list(iter_documents(str(tmp_path / "d"), strict=True))
    _write(tmp_path / "e" / "a.txt", "caf\u00e9\n\nsecond")
    for split in ("file", "paragraph", "line"):
        strict = list(iter_documents(str(tmp_path / "e"), split=split, strict=True))
        assert strict == list(iter_documents(str(tmp_path / "e"), split=split))


def test_prepare_reports_and_records_bad_text_once(tmp_path, capsys):
    config = DataConfig(
        sources=[str(_dirty_corpus(tmp_path))],
        tokenizer="bpe:300",
        valid_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    data = prepare_data(config, progress=False)
    stats = data.stats
    assert (stats.binary_files, stats.binary_documents) == (1, 1)
    assert stats.binary_bytes == (tmp_path / "corpus" / "image.png").stat().st_size
    assert (stats.replaced_files, stats.replaced_documents, stats.replaced_bytes) == (1, 1, 2)
    assert stats.documents == 31 and not stats.clean
    record = json.loads((data.directory / "prepared.json").read_text())
    assert record["stats"]["binary_documents"] == 1 and record["stats"]["replaced_bytes"] == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "diffattn data:" in line]
    assert lines == [
        "diffattn data: skipped 1 binary document(s) (NUL bytes; 272 bytes) in 1 file(s); "
        "replaced 2 invalid UTF-8 byte(s) with U+FFFD in 1 document(s) of 1 file(s); "
        "data.strict=true refuses them"
    ]
    # A quiet cache hit says nothing more; the stats come back from the record.
    again = prepare_data(config, progress=False)
    assert again.cached and again.stats == stats
    assert "diffattn data:" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "tokenizer",
    ["bpe:300", pytest.param("tiktoken:cl100k_base", marks=pytest.mark.extra("tiktoken"))],
)
def test_strict_prepare_fails_naming_the_first_file_and_writes_nothing(tmp_path, tokenizer):
    corpus = _dirty_corpus(tmp_path)
    cache = tmp_path / "cache"
    config = DataConfig(
        sources=[str(corpus)], tokenizer=tokenizer, strict=True, cache_dir=str(cache)
    )
    with pytest.raises(ValueError, match=r"image\.png: byte 8: binary data") as error:
        prepare_data(config, progress=False)
    assert "\n" not in str(error.value)
    assert not (cache / "shards").exists() or not any((cache / "shards").iterdir())
    (corpus / "image.png").unlink()
    with pytest.raises(ValueError, match=r"latin1\.txt: byte 3: not valid UTF-8"):
        prepare_data(config, progress=False)


def test_strict_and_lenient_share_a_cache_only_when_clean(tmp_path):
    corpus = _dirty_corpus(tmp_path)
    lenient = DataConfig(sources=[str(corpus)], tokenizer="bpe:300", cache_dir=str(tmp_path / "c"))
    dirty = prepare_data(lenient, progress=False)
    assert not dirty.cached
    # The lenient entry holds replaced and skipped text: a strict run must not reuse it.
    with pytest.raises(ValueError, match=r"image\.png: byte 8: binary data"):
        prepare_data(lenient.replace(strict=True), progress=False)
    # A clean corpus gives the same data either way, so the entry is shared.
    (corpus / "image.png").unlink()
    (corpus / "latin1.txt").unlink()
    clean = prepare_data(lenient, progress=False)
    assert clean.stats.clean
    strict = prepare_data(lenient.replace(strict=True), progress=False)
    assert strict.cached and strict.directory == clean.directory


def test_strict_config_field(tmp_path):
    assert DataConfig().strict is False
    assert DataConfig.from_dict({"strict": True}).strict is True
    with pytest.raises(ValueError, match=r"DataConfig\.strict: must be true or false"):
        DataConfig(strict="yes")


def test_train_with_strict_data_exits_2_with_one_line(tmp_path, capsys):
    corpus = _dirty_corpus(tmp_path, n=5)
    recipe = tiny_recipe(tmp_path / "cache", data={"sources": [str(corpus)], "max_bytes": None})
    path = write_recipe(tmp_path / "recipe.yaml", recipe)
    out = tmp_path / "run"
    code = train_cli(str(path), "--out", str(out), "--set", "data.strict=true")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "image.png: byte 8: binary data" in err[0], err
    assert err[0].startswith("diffattn train: error: data")
    assert not (out / "checkpoints").exists()
