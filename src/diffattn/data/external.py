"""Token files other tools wrote, read in place: Megatron-LM indexed datasets and datatrove
tokenized folders, as a token stream the :class:`~diffattn.data.loader.BatchLoader` reads.

Source specs (``DataConfig.sources``; all of a configuration's sources must be token sources):

* ``megatron:PREFIX``: ``PREFIX.bin`` + ``PREFIX.idx`` (:mod:`diffattn.data.external_megatron`);
  a glob pattern in ``PREFIX`` takes every matching ``.idx``, sorted;
* ``datatrove:DIR``: every ``*.ds`` below ``DIR`` with its ``.ds.index``, or one ``.ds`` file
  (:mod:`diffattn.data.external_datatrove`).

A :class:`TokenStream` is a selection of the files' documents (the train or the valid split,
:mod:`diffattn.data.external_prepare`) read as one stream with EOS after every document, as a
:class:`~diffattn.data.shards.ShardSet` reads: a document that ends in the tokenizer's EOS id is
read as it is, one that does not gets EOS appended on the fly (so ``document_masking``, which
starts a document after every EOS, sees the files' documents). The stream is described by
*segments*, runs of tokens that lie back to back in one file followed by an appended EOS or not;
the token files are memory-mapped and never read whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diffattn.data.external_datatrove import datatrove_files, datatrove_token_files, read_datatrove
from diffattn.data.external_megatron import megatron_files, megatron_prefixes, read_megatron

MEGATRON_PREFIX = "megatron:"
DATATROVE_PREFIX = "datatrove:"
TOKEN_SOURCE_FORMS = "'megatron:PREFIX' (Megatron-LM PREFIX.bin + PREFIX.idx), 'datatrove:DIR'"
STREAM_FORMAT = "diffattn-token-stream"
STREAM_VERSION = 1
STREAM_FILE = "stream.json"
SEGMENTS_FILE = "segments.npy"
DOCUMENTS_FILE = "documents.npy"
GATHER_SEGMENTS = 8
"""A read over more segments than this gathers by index arrays (:meth:`TokenStream._gather`)."""
SEGMENT_FIELDS = ("start", "file", "offset", "length", "eos")
"""Rows of the segments array (shape ``(5, S)``, int64): segment s begins at stream position
``start[s]`` with ``length[s]`` tokens of file ``file[s]`` from token ``offset[s]``, then one
appended EOS when ``eos[s]`` is 1."""


def is_token_spec(spec: object) -> bool:
    """Whether ``spec`` names token files (``megatron:`` or ``datatrove:``)."""
    return isinstance(spec, str) and spec.startswith((MEGATRON_PREFIX, DATATROVE_PREFIX))


def check_token_spec(spec: str) -> str:
    """The path part of a token source spec; ``ValueError`` naming the spec when it is empty."""
    path = spec.partition(":")[2]
    if not path.strip():
        raise ValueError(f"bad token source {spec!r}: expected {TOKEN_SOURCE_FORMS}")
    return path


def token_source_files(spec: str) -> list[Path]:
    """Every file of a token source (token files, indices, metadata), for existence checks and
    the cache key; ``ValueError`` naming the spec when nothing is there."""
    path = check_token_spec(spec)
    if spec.startswith(MEGATRON_PREFIX):
        return megatron_files(path)
    return datatrove_files(path)


def token_sources(specs: Iterable[str]) -> bool:
    """Whether ``specs`` are token sources; a mix of token and text sources is refused."""
    specs = list(specs)
    kinds = {is_token_spec(spec) for spec in specs}
    if len(kinds) > 1:
        tokens = [s for s in specs if is_token_spec(s)]
        raise ValueError(
            f"sources {specs}: token files ({', '.join(tokens)}) cannot be mixed with text "
            "sources; prepare the text with the same tokenizer into token files, or train on "
            "either kind alone"
        )
    return kinds == {True}


@dataclass(frozen=True)
class TokenFile:
    """One token file of a source: its documents as token offsets into it."""

    path: Path
    index: Path
    """The file holding the document boundaries (``.idx`` or ``.ds.index``)."""
    dtype: np.dtype
    bounds: np.ndarray
    """int64, documents + 1 entries from 0: document i is ``tokens[bounds[i]:bounds[i+1]]``."""
    tokenizer: str | None = None
    """The tokenizer the file names (datatrove's metadata), if any."""
    token_bytes: int | None = None
    """The token width the metadata names (datatrove), if any."""

    @property
    def num_tokens(self) -> int:
        return int(self.bounds[-1])

    @property
    def num_documents(self) -> int:
        return int(self.bounds.shape[0]) - 1

    def tokens(self) -> np.ndarray:
        """The file's tokens, memory-mapped read-only."""
        return _map_tokens(self.path, self.dtype, self.num_tokens)


def _map_tokens(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def open_token_files(spec: str) -> list[TokenFile]:
    """The token files of a source spec, validated (``ValueError`` naming a bad file)."""
    path = check_token_spec(spec)
    if spec.startswith(MEGATRON_PREFIX):
        files = []
        for prefix in megatron_prefixes(path):
            bin_path, dtype, bounds = read_megatron(prefix)
            files.append(TokenFile(bin_path, Path(prefix + ".idx"), dtype, bounds))
        return files
    files = []
    for ds in datatrove_token_files(path):
        dtype, bounds, metadata = read_datatrove(ds)
        files.append(
            TokenFile(
                ds,
                ds.with_name(ds.name + ".index"),
                dtype,
                bounds,
                tokenizer=metadata.tokenizer if metadata else None,
                token_bytes=metadata.token_bytes if metadata else None,
            )
        )
    return files


class TokenStream:
    """Documents of token files read as one stream, EOS after every document: what a
    :class:`~diffattn.data.shards.ShardSet` offers the loader (``num_tokens``,
    ``num_documents``, ``dtype``, ``read``, ``documents``, ``document_offsets``, ``eos_id``,
    ``vocab_size``, ``fingerprint``)."""

    def __init__(
        self,
        files: list[tuple[Path, np.dtype, int]],
        segments: np.ndarray,
        document_offsets: np.ndarray,
        *,
        vocab_size: int,
        eos_id: int,
        tokenizer: str | None,
        fingerprint: str,
        directory: Path | None = None,
    ) -> None:
        self.files = [path for path, _, _ in files]
        self._tokens = [_map_tokens(path, dtype, count) for path, dtype, count in files]
        self._dtypes = [np.dtype(dtype) for _, dtype, _ in files]
        self.segments = segments
        self.document_offsets = document_offsets
        """Stream position of each document's first token (int64)."""
        self.vocab_size = int(vocab_size)
        self.eos_id = int(eos_id)
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.directory = directory
        count = segments.shape[1]
        self._num_tokens = int(segments[0, -1] + segments[3, -1] + segments[4, -1]) if count else 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_documents(self) -> int:
        return int(self.document_offsets.shape[0])

    @property
    def dtype(self) -> np.dtype:
        """The widest token type of the files (reads come back as int64)."""
        return max(self._dtypes, key=lambda d: d.itemsize) if self._dtypes else np.dtype("<u2")

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens of the stream from ``start``, as int64."""
        end = start + length
        if start < 0 or length < 0 or end > self.num_tokens:
            raise IndexError(
                f"tokens [{start}, {end}) outside the token stream of {self.num_tokens}"
            )
        out = np.empty(length, dtype=np.int64)
        if length == 0:
            return out
        starts = self.segments[0]
        first = int(np.searchsorted(starts, start, side="right")) - 1
        last = int(np.searchsorted(starts, end, side="left"))
        rows = np.asarray(self.segments[:, first:last])
        if rows.shape[1] > GATHER_SEGMENTS:
            self._gather(out, start, rows)
        else:
            self._copy_segments(out, start, rows)
        return out

    def _copy_segments(self, out: np.ndarray, start: int, rows: np.ndarray) -> None:
        """Fill ``out`` (the stream from ``start``) from the segments ``rows`` one by one: the
        reference :meth:`_gather` is tested against."""
        end = start + out.shape[0]
        for begin, file, offset, count, eos in rows.T.tolist():
            lo, hi = max(start, begin), min(end, begin + count)
            if hi > lo:
                source = self._tokens[file]
                out[lo - start : hi - start] = source[offset + lo - begin : offset + hi - begin]
            if eos and start <= begin + count < end:
                out[begin + count - start] = self.eos_id

    def _gather(self, out: np.ndarray, start: int, rows: np.ndarray) -> None:
        """What :meth:`_copy_segments` does, with one index array per file instead of a
        Python step per segment (windows over many short documents)."""
        begin, file, offset, count, eos = rows
        end = start + out.shape[0]
        lo, hi = np.maximum(begin, start), np.minimum(begin + count, end)
        take = np.maximum(hi - lo, 0)
        within = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
        target = np.repeat(lo - start, take) + within
        source = np.repeat(offset + lo - begin, take) + within
        files = np.unique(file)
        if files.shape[0] == 1:
            out[target] = self._tokens[int(files[0])][source]
        else:
            owner = np.repeat(file, take)
            for number in files.tolist():
                mine = owner == number
                out[target[mine]] = self._tokens[number][source[mine]]
        ends = begin + count
        appended = (eos == 1) & (ends >= start) & (ends < end)
        out[ends[appended] - start] = self.eos_id

    def documents(self) -> Iterator[np.ndarray]:
        """Each document's tokens (without its EOS), in order."""
        offsets = self.document_offsets
        ends = [*np.asarray(offsets[1:]).tolist(), self.num_tokens]
        for begin, end in zip(np.asarray(offsets).tolist(), ends, strict=True):
            yield self.read(begin, end - begin - 1)

    def __repr__(self) -> str:
        return (
            f"TokenStream({self.num_tokens} tokens, {self.num_documents} documents, "
            f"{len(self.files)} file(s), directory={str(self.directory)!r})"
        )

    # -- on disk ------------------------------------------------------------------------------
    def save(self, directory: Path, record: dict[str, Any]) -> None:
        """Write ``stream.json`` (files, sizes, totals, ``record``) and the arrays."""
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / SEGMENTS_FILE, np.ascontiguousarray(self.segments))
        np.save(directory / DOCUMENTS_FILE, np.ascontiguousarray(self.document_offsets))
        files = [
            {"path": str(path), "dtype": dtype.str, "tokens": int(tokens.shape[0])}
            for path, dtype, tokens in zip(self.files, self._dtypes, self._tokens, strict=True)
        ]
        payload = {
            "format": STREAM_FORMAT,
            "version": STREAM_VERSION,
            "files": files,
            "tokens": self.num_tokens,
            "documents": self.num_documents,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer": self.tokenizer,
            "fingerprint": self.fingerprint,
            **record,
        }
        text = json.dumps(payload, indent=2) + "\n"
        (directory / STREAM_FILE).write_text(text, encoding="utf-8")

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> TokenStream:
        """The stream saved in ``directory``; ``ValueError`` when a token file it reads is gone
        or changed size since."""
        directory = Path(directory)
        try:
            payload = json.loads((directory / STREAM_FILE).read_text(encoding="utf-8"))
            segments = np.load(directory / SEGMENTS_FILE, mmap_mode="r")
            documents = np.load(directory / DOCUMENTS_FILE, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise ValueError(f"{directory}: not a readable token stream ({error})") from None
        if payload.get("format") != STREAM_FORMAT or payload.get("version") != STREAM_VERSION:
            raise ValueError(f"{directory / STREAM_FILE}: not a {STREAM_FORMAT} file")
        files = []
        for entry in payload["files"]:
            path, dtype = Path(entry["path"]), np.dtype(entry["dtype"])
            expected = entry["tokens"] * dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != expected:
                raise ValueError(
                    f"{path}: {'missing' if size is None else f'{size} bytes'} where "
                    f"{expected} were prepared; the token files changed (prepare again)"
                )
            files.append((path, dtype, int(entry["tokens"])))
        return cls(
            files,
            segments,
            documents,
            vocab_size=payload["vocab_size"],
            eos_id=payload["eos_id"],
            tokenizer=payload.get("tokenizer"),
            fingerprint=payload["fingerprint"],
            directory=directory,
        )
