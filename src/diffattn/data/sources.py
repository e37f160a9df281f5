"""Document sources: text files, directories, globs, JSON lines, Parquet, HF datasets, stdlib.

A *source spec* is one string:

* ``"stdlib[:MAX_BYTES|:all]"``: the embedded default corpus (:mod:`diffattn.data.corpus`),
  capped at 16 MB unless the suffix says otherwise;
* ``"synthetic:TASK[?key=value&...]"``: generated retrieval documents, associative recall or
  needles among distractors (:mod:`diffattn.data.synthetic`);
* ``"hf:NAME[:CONFIG][@SPLIT][?key=value&...]"``: a ``datasets`` dataset, streamed
  (``@SPLIT`` defaults to ``train``; the query passes ``data_files``, ``data_dir`` or
  ``revision`` to ``datasets.load_dataset``, e.g. ``hf:json?data_files=/data/*.jsonl``);
* a file: ``.jsonl`` / ``.jsonl.gz`` (one JSON object per line, text under ``text_field``),
  ``.parquet`` (column ``text_field``, streamed by record batches), anything else is text
  (``.gz`` is decompressed);
* a directory: every non-hidden file below it, recursively, in sorted order;
* a glob pattern (``*``, ``?``, ``[``; ``**`` recurses): the matching files, sorted.

Documents are ``str``. By default bad text never stops a run, and everything is counted in
:class:`SourceStats`: each byte sequence that is not valid UTF-8 becomes U+FFFD, and a document
that looks binary (it holds a NUL byte; a text file with a NUL byte in its first 8 KiB is
binary as a whole) is skipped. With ``strict=True`` either one raises :class:`TextError`
naming the file and the byte offset (the row for Parquet and ``hf:`` datasets).
A text file is one document (``split="file"``), or one per blank-line separated paragraph
(``"paragraph"``) or per line (``"line"``); the last two stream the file line by line.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, get_args
from urllib.parse import parse_qsl

from diffattn.data.external import check_token_spec, is_token_spec, token_source_files
from diffattn.data.stdlib import stdlib_files, stdlib_root
from diffattn.data.synthetic import GENERATOR_VERSION as SYNTHETIC_GENERATOR_VERSION
from diffattn.data.synthetic import is_synthetic_spec, parse_synthetic_spec, synthetic_documents
from diffattn.data.text_decoding import (
    TextError,
    binary_error,
    clean_text,
    decode,
)

DocumentSplit = Literal["file", "paragraph", "line"]
DOCUMENT_SPLITS: tuple[str, ...] = get_args(DocumentSplit)

STDLIB_SPEC = "stdlib"
STDLIB_DEFAULT_BYTES = 16_000_000
"""Cap of the ``"stdlib"`` source: all of the stdlib on current CPythons (~12 MB)."""
HF_PREFIX = "hf:"
HF_QUERY_KEYS = ("data_files", "data_dir", "revision")
_GLOB_CHARS = frozenset("*?[")
_PARQUET_BATCH_ROWS = 1024
BINARY_SNIFF_BYTES = 8192
"""A text file with a NUL byte among its first this many bytes is binary (git's rule)."""
TEXT_POLICY = "nul-skip-1"
"""Identifies how bad text is handled; part of every source fingerprint (cache key)."""

SOURCE_FORMS = (
    "'stdlib[:MAX_BYTES|:all]', 'synthetic:recall|needle[?docs=N&...]', "
    "'hf:NAME[:CONFIG][@SPLIT][?data_files=...]', 'megatron:PREFIX', 'datatrove:DIR', "
    "a file (.txt, .jsonl, .parquet, ...), a directory, or a glob pattern"
)


# --------------------------------------------------------------------------------------------
# statistics (the decoding is diffattn.data.text_decoding's)
# --------------------------------------------------------------------------------------------
@dataclass
class SourceStats:
    """Counts gathered while documents are read (updated in place by the readers)."""

    files: int = 0
    """Files opened (text, JSON lines, Parquet)."""
    documents: int = 0
    """Documents yielded (empty documents are skipped and not counted)."""
    bytes: int = 0
    """UTF-8 bytes of the yielded documents."""
    truncated: bool = False
    """True when ``max_bytes`` cut the corpus short."""
    replaced_files: int = 0
    """Files in which at least one byte sequence was not valid UTF-8."""
    replaced_documents: int = 0
    """Documents containing at least one replacement character that came from bad bytes."""
    replaced_bytes: int = 0
    """Bytes that were not valid UTF-8 and were replaced by U+FFFD."""
    binary_files: int = 0
    """Files in which at least one document was skipped as binary."""
    binary_documents: int = 0
    """Documents skipped because they hold a NUL byte (a binary text file counts as one)."""
    binary_bytes: int = 0
    """Bytes of the skipped binary documents."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# spec parsing
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFDatasetSpec:
    """A parsed ``hf:NAME[:CONFIG][@SPLIT][?key=value&...]`` source spec."""

    name: str
    config: str | None = None
    split: str = "train"
    options: tuple[tuple[str, str], ...] = ()


def parse_hf_spec(spec: str) -> HFDatasetSpec:
    """Parse an ``hf:`` source spec; a malformed one raises ``ValueError`` naming it."""
    if not spec.startswith(HF_PREFIX):
        raise ValueError(f"source {spec!r} is not an 'hf:' spec")
    body = spec[len(HF_PREFIX) :]
    query = ""
    if "?" in body:
        body, query = body.split("?", 1)
    split = "train"
    if "@" in body:
        body, split = body.rsplit("@", 1)
    name, _, config = body.partition(":")
    options = tuple(parse_qsl(query, keep_blank_values=True)) if query else ()
    bad_keys = [key for key, _ in options if key not in HF_QUERY_KEYS]
    if not name or not split or (":" in body and not config) or bad_keys:
        detail = f"unknown option(s) {bad_keys}; " if bad_keys else ""
        raise ValueError(
            f"bad dataset source {spec!r}: {detail}expected 'hf:NAME[:CONFIG][@SPLIT]' with "
            f"optional '?key=value' options among {', '.join(HF_QUERY_KEYS)}"
        )
    return HFDatasetSpec(name=name, config=config or None, split=split, options=options)


def is_stdlib_spec(spec: str) -> bool:
    """Whether ``spec`` names the embedded corpus (``stdlib``, ``stdlib:N``, ``stdlib:all``)."""
    return spec == STDLIB_SPEC or spec.startswith(STDLIB_SPEC + ":")


def stdlib_spec_cap(spec: str) -> int | None:
    """The byte cap of a ``stdlib[:MAX_BYTES|:all]`` spec (``None`` for ``all``)."""
    if spec == STDLIB_SPEC:
        return STDLIB_DEFAULT_BYTES
    suffix = spec[len(STDLIB_SPEC) + 1 :]
    if suffix == "all":
        return None
    if suffix.isdigit() and int(suffix) > 0:
        return int(suffix)
    raise ValueError(
        f"bad embedded-corpus source {spec!r}: expected 'stdlib', 'stdlib:MAX_BYTES' "
        "(a positive integer) or 'stdlib:all'"
    )


def check_source_spec(spec: object) -> str:
    """Check the syntax of one source spec (existence is checked when it is read)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"bad source {spec!r}: expected a non-empty string, one of {SOURCE_FORMS}")
    if spec.startswith(HF_PREFIX):
        parse_hf_spec(spec)
    elif is_stdlib_spec(spec):
        stdlib_spec_cap(spec)
    elif is_synthetic_spec(spec):
        parse_synthetic_spec(spec)
    elif is_token_spec(spec):  # token files: diffattn.data.external
        check_token_spec(spec)
    return spec


def _is_glob(spec: str) -> bool:
    return any(char in spec for char in _GLOB_CHARS)


def _walk_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files.extend(Path(directory, f) for f in filenames if not f.startswith("."))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def resolve_files(spec: str) -> list[Path]:
    """The files a path/directory/glob spec names, in deterministic order.

    Raises ``ValueError`` naming the spec when nothing exists there or nothing matches.
    """
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        return [path]
    if path.is_dir():
        files = _walk_files(path)
        if not files:
            raise ValueError(f"source {spec!r}: directory contains no files")
        return files
    if _is_glob(spec):
        matches = glob.glob(os.path.expanduser(spec), recursive=True)
        files = sorted((Path(m) for m in matches if os.path.isfile(m)), key=lambda p: str(p))
        if not files:
            raise ValueError(f"source {spec!r}: glob pattern matches no files")
        return files
    raise ValueError(f"source {spec!r}: no such file or directory (accepted: {SOURCE_FORMS})")


def check_sources_exist(specs: Iterable[str]) -> None:
    """Fail early (``ValueError`` naming the spec) when a local source does not exist."""
    for spec in specs:
        check_source_spec(spec)
        if is_token_spec(spec):
            token_source_files(spec)
        elif not (is_stdlib_spec(spec) or is_synthetic_spec(spec) or spec.startswith(HF_PREFIX)):
            resolve_files(spec)


# --------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------
def _name_without_gz(path: Path) -> str:
    name = path.name.lower()
    return name[:-3] if name.endswith(".gz") else name


def _open_binary(path: Path) -> BinaryIO:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


class _Emitter:
    """Counts documents, replacements and skipped binary documents; shared by the readers."""

    def __init__(self, stats: SourceStats, strict: bool = False) -> None:
        self.stats = stats
        self.strict = strict
        self.file_had_replacement = False
        self.file_had_binary = False

    def start_file(self) -> None:
        self.stats.files += 1
        self.file_had_replacement = False
        self.file_had_binary = False

    def binary(self, size: int, where: str) -> None:
        """Skip a binary document of ``size`` bytes (strict mode: raise at ``where``)."""
        if self.strict:
            raise binary_error(where)
        self.stats.binary_documents += 1
        self.stats.binary_bytes += size
        if not self.file_had_binary:
            self.file_had_binary = True
            self.stats.binary_files += 1

    def document(self, text: str, replaced: int, where: str) -> str | None:
        """The text to yield, or ``None`` when it is binary (skipped and counted)."""
        if "\x00" in text:
            self.binary(len(text.encode("utf-8", errors="replace")), where)
            return None
        text, more = clean_text(text)
        if more and self.strict:
            raise TextError(
                f"{where}: text holds {more} unpaired surrogate(s), which are not valid "
                "UTF-8; refused in strict mode (without it, they become U+FFFD and are counted)"
            )
        replaced += more
        if replaced:
            self.stats.replaced_bytes += replaced
            self.stats.replaced_documents += 1
            if not self.file_had_replacement:
                self.file_had_replacement = True
                self.stats.replaced_files += 1
        return text

    def row(self, value: Any, where: str, holds: str) -> str | None:
        """The text to yield for one row's ``value`` of a table (``None`` for a null, empty or
        binary one); a value that is neither text nor bytes raises ``ValueError`` saying
        ``f"{holds} <its type>, expected strings"``."""
        if value is None:
            return None
        if not isinstance(value, bytes | bytearray | str):
            raise ValueError(f"{holds} {type(value).__name__}, expected strings")
        if isinstance(value, str):
            text, replaced = value, 0
        else:
            text, replaced = decode(bytes(value), self.strict, lambda i: f"{where}, byte {i}")
        return self.document(text, replaced, where) if text else None


def _remaining_bytes(handle: BinaryIO, already: int) -> int:
    """``already`` plus the bytes left in ``handle``, counted in chunks (bounded memory)."""
    total = already
    while chunk := handle.read(1 << 20):
        total += len(chunk)
    return total


def read_text_file(
    path: str | os.PathLike[str],
    *,
    split: DocumentSplit = "file",
    stats: SourceStats | None = None,
    strict: bool = False,
) -> Iterator[str]:
    """Documents of one text file (whole file, paragraphs or lines; ``.gz`` is decompressed).

    A file with a NUL byte in its first :data:`BINARY_SNIFF_BYTES` bytes is binary and is
    skipped whole, as is any document holding a NUL byte (``strict``: :class:`TextError`).
    """
    if split not in DOCUMENT_SPLITS:
        raise ValueError(f"split must be one of {DOCUMENT_SPLITS}, got {split!r}")
    path = Path(path)
    emit = _Emitter(stats if stats is not None else SourceStats(), strict)
    emit.start_file()
    gz = path.name.lower().endswith(".gz")

    def where(offset: int) -> str:
        return f"{path}: {'decompressed ' if gz else ''}byte {offset}"

    with _open_binary(path) as handle:
        if split == "file":
            data = handle.read()
            nul = data.find(b"\x00")
            if nul >= 0:
                emit.binary(len(data), where(nul))
                return
            text, replaced = decode(data, strict, where)
            if text:
                document = emit.document(text, replaced, where(0))
                if document is not None:
                    yield document
            return
        head = handle.read(BINARY_SNIFF_BYTES)
        nul = head.find(b"\x00")
        if nul >= 0:
            emit.binary(_remaining_bytes(handle, len(head)), where(nul))
            return
        handle.seek(0)
        # Line by line: '\n' is never part of a multi-byte UTF-8 sequence, so decoding each
        # line gives exactly the whole-file result with bounded memory.
        paragraph: list[str] = []
        paragraph_replaced = 0
        paragraph_start = offset = 0
        for raw in handle:
            start, offset = offset, offset + len(raw)
            line, replaced = decode(raw, strict, lambda i, start=start: where(start + i))
            if split == "line":
                line = line.rstrip("\r\n")
                if line:
                    document = emit.document(line, replaced, where(start))
                    if document is not None:
                        yield document
                continue
            if line.strip():
                if not paragraph:
                    paragraph_start = start
                paragraph.append(line)
                paragraph_replaced += replaced
            elif paragraph:
                text = "".join(paragraph).rstrip("\r\n")
                document = emit.document(text, paragraph_replaced, where(paragraph_start))
                if document is not None:
                    yield document
                paragraph, paragraph_replaced = [], 0
        if paragraph:
            text = "".join(paragraph).rstrip("\r\n")
            document = emit.document(text, paragraph_replaced, where(paragraph_start))
            if document is not None:
                yield document


def read_jsonl_file(
    path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    stats: SourceStats | None = None,
    strict: bool = False,
) -> Iterator[str]:
    """The ``text_field`` string of each JSON object in a JSON-lines file (blank lines skipped).

    A line that is not a JSON object with a string ``text_field`` raises ``ValueError`` naming
    the file, the line number and the field.
    """
    path = Path(path)
    emit = _Emitter(stats if stats is not None else SourceStats(), strict)
    emit.start_file()
    offset = 0
    with _open_binary(path) as handle:
        for number, raw in enumerate(handle, start=1):
            start, offset = offset, offset + len(raw)
            line, replaced = decode(
                raw,
                strict,
                lambda i, number=number, start=start: f"{path}:{number}: byte {start + i}",
            )
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{number}: no text field {text_field!r} (found {keys}); "
                    "set text_field to the key that holds the text"
                )
            value = record[text_field]
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(
                    f"{path}:{number}: field {text_field!r} holds {type(value).__name__}, "
                    "expected a string"
                )
            if value:
                document = emit.document(value, replaced, f"{path}:{number}: byte {start}")
                if document is not None:
                    yield document


def read_parquet_file(
    path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    stats: SourceStats | None = None,
    batch_rows: int = _PARQUET_BATCH_ROWS,
    strict: bool = False,
) -> Iterator[str]:
    """The ``text_field`` column of a Parquet file, streamed batch by batch (nulls skipped)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as error:  # pragma: no cover - pyarrow is installed in tests
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from error
    path = Path(path)
    emit = _Emitter(stats if stats is not None else SourceStats(), strict)
    emit.start_file()
    parquet = pq.ParquetFile(path)
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise ValueError(
            f"{path}: no column {text_field!r} (columns: {columns}); "
            "set text_field to the column that holds the text"
        )
    row = -1
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            row += 1
            document = emit.row(value, f"{path}: row {row}", f"{path}: column {text_field!r} holds")
            if document is not None:
                yield document


def read_hf_dataset(
    spec: str | HFDatasetSpec,
    *,
    text_field: str = "text",
    stats: SourceStats | None = None,
    strict: bool = False,
    **load_kwargs: Any,
) -> Iterator[str]:
    """Stream the ``text_field`` column of a ``datasets`` dataset (streaming ``load_dataset``).

    Extra keyword arguments go to ``datasets.load_dataset``. Hub datasets need network access
    (or a populated HF cache); the packaged builders (``text``, ``json``, ``parquet``, ``csv``)
    read local ``data_files`` offline.
    """
    parsed = parse_hf_spec(spec) if isinstance(spec, str) else spec
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"source 'hf:{parsed.name}' needs the datasets package: pip install datasets"
        ) from error
    kwargs = {**dict(parsed.options), **load_kwargs}
    emit = _Emitter(stats if stats is not None else SourceStats(), strict)
    emit.start_file()
    dataset = datasets.load_dataset(
        parsed.name, parsed.config, split=parsed.split, streaming=True, **kwargs
    )
    columns = getattr(dataset, "column_names", None)

    def missing(columns: Any) -> ValueError:
        return ValueError(
            f"dataset 'hf:{parsed.name}' has no column {text_field!r} (columns: {columns}); "
            "set text_field to the column that holds the text"
        )

    if columns is not None and text_field not in columns:
        raise missing(columns)
    source = f"dataset 'hf:{parsed.name}'"
    for row, record in enumerate(dataset):
        # a streaming dataset may not know its columns before the first row (datasets < 3):
        # a column that the first row lacks is missing, never a run of silently skipped rows
        if row == 0 and columns is None and text_field not in record:
            raise missing(sorted(record))
        document = emit.row(
            record.get(text_field), f"{source}: row {row}", f"{source}: field {text_field!r} holds"
        )
        if document is not None:
            yield document


def read_file(
    path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    split: DocumentSplit = "file",
    stats: SourceStats | None = None,
    strict: bool = False,
) -> Iterator[str]:
    """Documents of one file, dispatched on its suffix (JSON lines, Parquet or text)."""
    path = Path(path)
    kind = _name_without_gz(path)
    if kind.endswith(".jsonl"):
        return read_jsonl_file(path, text_field=text_field, stats=stats, strict=strict)
    if path.name.lower().endswith(".parquet"):
        return read_parquet_file(path, text_field=text_field, stats=stats, strict=strict)
    return read_text_file(path, split=split, stats=stats, strict=strict)


def _iter_one(
    spec: str, text_field: str, split: DocumentSplit, stats: SourceStats, strict: bool
) -> Iterator[str]:
    if is_stdlib_spec(spec):
        cap, used = stdlib_spec_cap(spec), 0
        for path in stdlib_files():
            for text in read_text_file(path, stats=stats, strict=strict):
                size = len(text.encode("utf-8"))
                if cap is not None and used + size > cap:
                    stats.truncated = True
                    text = _fit_utf8(text, cap - used)
                    if text:
                        yield text
                    return
                used += size
                yield text
    elif is_synthetic_spec(spec):
        yield from synthetic_documents(spec)
    elif spec.startswith(HF_PREFIX):
        yield from read_hf_dataset(spec, text_field=text_field, stats=stats, strict=strict)
    elif is_token_spec(spec):
        raise ValueError(f"source {spec!r} holds token ids, not text documents")
    else:
        for path in resolve_files(spec):
            yield from read_file(
                path, text_field=text_field, split=split, stats=stats, strict=strict
            )


def _fit_utf8(text: str, budget: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 encoding has at most ``budget`` bytes."""
    return text.encode("utf-8")[:budget].decode("utf-8", errors="ignore")


def iter_documents(
    sources: str | Iterable[str],
    *,
    text_field: str = "text",
    split: DocumentSplit = "file",
    max_bytes: int | None = None,
    stats: SourceStats | None = None,
    strict: bool = False,
) -> Iterator[str]:
    """All documents of ``sources`` (specs, in the given order), as ``str``.

    ``max_bytes`` caps the total UTF-8 bytes: reading stops there, the last document cut at a
    character boundary. ``stats`` (a :class:`SourceStats`) is updated while iterating:
    invalid UTF-8 is replaced by U+FFFD and binary documents (NUL bytes) are skipped, both
    counted; ``strict=True`` raises :class:`TextError` at the first of either instead. No
    error is raised for an empty corpus here; :func:`diffattn.data.prepare_data` does that.
    """
    specs = [sources] if isinstance(sources, str) else list(sources)
    for spec in specs:
        check_source_spec(spec)
    if split not in DOCUMENT_SPLITS:
        raise ValueError(f"split must be one of {DOCUMENT_SPLITS}, got {split!r}")
    if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
    stats = stats if stats is not None else SourceStats()
    for spec in specs:
        for text in _iter_one(spec, text_field, split, stats, bool(strict)):
            size = len(text.encode("utf-8"))
            if max_bytes is not None and stats.bytes + size > max_bytes:
                text = _fit_utf8(text, max_bytes - stats.bytes)
                stats.truncated = True
                if text:
                    stats.documents += 1
                    stats.bytes += len(text.encode("utf-8"))
                    yield text
                return
            stats.documents += 1
            stats.bytes += size
            yield text


# --------------------------------------------------------------------------------------------
# fingerprints (cache keys)
# --------------------------------------------------------------------------------------------
def _file_entry(path: Path, root: Path | None = None) -> list[Any]:
    info = path.stat()
    name = path.relative_to(root).as_posix() if root is not None else str(path.resolve())
    return [name, info.st_size, info.st_mtime_ns]


def fingerprint_sources(
    sources: str | Iterable[str],
    **settings: Any,
) -> str:
    """A cheap fingerprint of the corpus the specs name, plus any reader ``settings``.

    Local files count by path, size and modification time (no content read), the embedded
    corpus by the interpreter version and its files, ``hf:`` datasets by their spec. Touching
    or editing a file therefore changes the fingerprint; a hub dataset that changes under the
    same name and revision does not.
    """
    specs = [sources] if isinstance(sources, str) else list(sources)
    entries: list[Any] = []
    for spec in specs:
        check_source_spec(spec)
        if is_stdlib_spec(spec):
            root = stdlib_root()
            entries.append([spec, sys.version, [_file_entry(p, root) for p in stdlib_files()]])
        elif is_synthetic_spec(spec):
            entries.append([spec, SYNTHETIC_GENERATOR_VERSION])
        elif spec.startswith(HF_PREFIX):
            entries.append([spec])
        elif is_token_spec(spec):
            entries.append([spec, [_file_entry(p) for p in token_source_files(spec)]])
        else:
            entries.append([spec, [_file_entry(p) for p in resolve_files(spec)]])
    payload = json.dumps(
        {"sources": entries, "settings": settings, "text_policy": TEXT_POLICY},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()
