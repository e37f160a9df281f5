"""Token shards: documents tokenised once into memory-mapped files, EOS after every document.

A *shard* is one binary file ``NAME.bin``:

=========  =====================================================================
bytes      content
=========  =====================================================================
0-63       header: magic ``b"DIFFTOKS"``, format version (u32), bytes per token
           (u32: 2 = uint16, 4 = uint32), tokens (u64), documents (u64),
           vocab size (u64), EOS id (u64), zero padding; all little-endian
64-...     the tokens (uint16 when every id fits in 16 bits, else uint32)
then       document start offsets within the shard (u64 each)
=========  =====================================================================

and a sidecar ``NAME.json`` with the same numbers plus the tokenizer name, the file size and
the sha256 of everything after the header. Opening a shard checks the header and the file size
(a truncated or padded file raises ``ValueError`` naming it); ``verify="sha256"`` also checks
the hash. Shards are written streaming through a fixed-size buffer (memory stays bounded
whatever the corpus size), to a temporary name that is renamed into place when complete.

A *shard set* is a directory holding shards and ``manifest.json`` (totals, tokenizer, shard
list and a fingerprint of the token content); :class:`ShardSet` reads it as one concatenated
token stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from diffattn.data.tokenizers import Tokenizer, encode_batch
from diffattn.fileio import CheckpointError, give_usual_permissions, read_json

MAGIC = b"DIFFTOKS"
FORMAT_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQQQ")
SHARD_FORMAT = "diffattn-token-shard"
SET_FORMAT = "diffattn-token-shards"
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 1 << 27
"""Tokens per shard before the writer starts a new one (at the next document boundary)."""
DEFAULT_BUFFER_TOKENS = 1 << 20
"""Tokens held in memory before they are flushed to the shard file."""
DEFAULT_BATCH_BYTES = 4 << 20
"""Text (UTF-8 bytes) handed to the tokenizer's batch encoder at once."""

Verify = Literal["size", "sha256"]


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id (< ``vocab_size``) fits in 16 bits, else ``uint32``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if vocab_size > 1 << 32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records about one finished shard."""

    file: str
    tokens: int
    documents: int
    bytes: int
    sha256: str


class ShardWriter:
    """Streams documents into numbered shards ``PREFIX-00000.bin``, ... in ``directory``.

    Each :meth:`add` call is one document; EOS is appended. At most ``buffer_tokens`` tokens
    are held in memory. A new shard starts at the first document boundary after a shard
    reaches ``shard_tokens``. :meth:`close` finishes the last shard and writes the manifest.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        vocab_size: int,
        eos_id: int,
        tokenizer_name: str,
        prefix: str = "shard",
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        buffer_tokens: int = DEFAULT_BUFFER_TOKENS,
        extra: dict[str, Any] | None = None,
    ) -> None:
        for name, value in (("shard_tokens", shard_tokens), ("buffer_tokens", buffer_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id {eos_id} is outside the vocabulary (size {vocab_size})")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.tokenizer_name = tokenizer_name
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.dtype = token_dtype(vocab_size)
        self.extra = dict(extra or {})
        self._buffer = np.empty(buffer_tokens, dtype=self.dtype)
        self._filled = 0
        self._handle: Any = None
        self._tmp_path: Path | None = None
        self._digest: Any = None
        self._shard_count = 0
        self._shard_docs = array("Q")
        self._finished: list[ShardInfo] = []
        self._closed = False

    # -- public ---------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Tokens written so far, EOS included."""
        return sum(s.tokens for s in self._finished) + self._shard_count

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self._finished) + len(self._shard_docs)

    def add(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (its ids, then EOS)."""
        if self._closed:
            raise ValueError(f"shard writer for {self.directory} is closed")
        values = np.asarray(ids, dtype=np.int64).reshape(-1)
        if values.size and (values.min() < 0 or values.max() >= self.vocab_size):
            bad = int(values.max() if values.max() >= self.vocab_size else values.min())
            raise ValueError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        length = values.size + 1
        if self._shard_count and self._shard_count + length > self.shard_tokens:
            self._finish_shard()
        if self._handle is None:
            self._start_shard()
        self._shard_docs.append(self._shard_count)
        self._push(values.astype(self.dtype, copy=False))
        self._push(np.array([self.eos_id], dtype=self.dtype))
        self._shard_count += length

    def close(self) -> ShardSet:
        """Finish the last shard, write ``manifest.json`` and open the set."""
        if not self._closed:
            if self._handle is not None:
                self._finish_shard()
            self._closed = True
            self._write_manifest()
        return ShardSet.open(self.directory)

    # -- internals ------------------------------------------------------------------------
    def _start_shard(self) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{self.prefix}.", suffix=".tmp", dir=self.directory)
        give_usual_permissions(tmp)  # mkstemp makes 0600
        self._handle = os.fdopen(fd, "wb")
        self._tmp_path = Path(tmp)
        self._handle.write(b"\0" * HEADER_BYTES)
        self._digest = hashlib.sha256()
        self._shard_count = 0
        self._shard_docs = array("Q")

    def _push(self, values: np.ndarray) -> None:
        start = 0
        while start < values.size:
            room = self._buffer.size - self._filled
            take = min(room, values.size - start)
            self._buffer[self._filled : self._filled + take] = values[start : start + take]
            self._filled += take
            start += take
            if self._filled == self._buffer.size:
                self._flush()

    def _flush(self) -> None:
        if self._filled:
            data = self._buffer[: self._filled].tobytes()
            self._digest.update(data)
            self._handle.write(data)
            self._filled = 0

    def _finish_shard(self) -> None:
        self._flush()
        offsets = np.frombuffer(self._shard_docs, dtype=np.uint64).astype("<u8").tobytes()
        self._digest.update(offsets)
        self._handle.write(offsets)
        header = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            self.dtype.itemsize,
            self._shard_count,
            len(self._shard_docs),
            self.vocab_size,
            self.eos_id,
        )
        self._handle.seek(0)
        self._handle.write(header.ljust(HEADER_BYTES, b"\0"))
        self._handle.close()
        size = HEADER_BYTES + self._shard_count * self.dtype.itemsize + len(offsets)
        self._handle = None
        name = f"{self.prefix}-{len(self._finished):05d}"
        final = self.directory / f"{name}.bin"
        assert self._tmp_path is not None
        os.replace(self._tmp_path, final)
        info = ShardInfo(
            file=final.name,
            tokens=self._shard_count,
            documents=len(self._shard_docs),
            bytes=size,
            sha256=self._digest.hexdigest(),
        )
        _write_json_atomically(
            self.directory / f"{name}.json",
            {
                "format": SHARD_FORMAT,
                "version": FORMAT_VERSION,
                "dtype": self.dtype.name,
                "vocab_size": self.vocab_size,
                "eos_id": self.eos_id,
                "tokenizer": self.tokenizer_name,
                **info.__dict__,
            },
        )
        self._finished.append(info)
        self._shard_count = 0
        self._shard_docs = array("Q")

    def _write_manifest(self) -> None:
        shards = [info.__dict__ for info in self._finished]
        manifest = {
            "format": SET_FORMAT,
            "version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer": self.tokenizer_name,
            "tokens": sum(s.tokens for s in self._finished),
            "documents": sum(s.documents for s in self._finished),
            "fingerprint": _set_fingerprint(self.dtype.name, self.vocab_size, shards),
            "shards": shards,
            **({"extra": self.extra} if self.extra else {}),
        }
        _write_json_atomically(self.directory / MANIFEST, manifest)

    def abort(self) -> None:
        """Drop the unfinished shard (its temporary file)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._tmp_path is not None and self._tmp_path.exists():
            self._tmp_path.unlink()
        self._closed = True


def _set_fingerprint(dtype: str, vocab_size: int, shards: Sequence[dict[str, Any]]) -> str:
    payload = json.dumps(
        {
            "dtype": dtype,
            "vocab": vocab_size,
            "shards": [[s["tokens"], s["sha256"]] for s in shards],
        }
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------
def _corrupt(path: Path, message: str) -> ValueError:
    return ValueError(f"{path}: corrupt token shard: {message}")


@dataclass
class Shard:
    """One opened shard: its tokens and document offsets as read-only memory maps."""

    path: Path
    tokens: np.ndarray
    document_offsets: np.ndarray
    vocab_size: int
    eos_id: int
    sha256: str | None
    tokenizer: str | None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_offsets.shape[0])

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: Verify = "size") -> Shard:
        """Open ``path``; a truncated, padded or otherwise corrupt file raises ``ValueError``."""
        path = Path(path)
        if verify not in ("size", "sha256"):
            raise ValueError(f"verify must be 'size' or 'sha256', got {verify!r}")
        if not path.is_file():
            raise ValueError(f"{path}: token shard not found")
        size = path.stat().st_size
        if size < HEADER_BYTES:
            raise _corrupt(path, f"truncated: {size} bytes, the header alone has {HEADER_BYTES}")
        with open(path, "rb") as handle:
            header = handle.read(HEADER_BYTES)
        magic, version, itemsize, n_tokens, n_docs, vocab_size, eos_id = _HEADER.unpack(
            header[: _HEADER.size]
        )
        if magic != MAGIC:
            raise _corrupt(path, f"bad magic {magic!r} (expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise _corrupt(path, f"format version {version}, this reader knows {FORMAT_VERSION}")
        if itemsize not in (2, 4):
            raise _corrupt(path, f"bad token width {itemsize} bytes")
        expected = HEADER_BYTES + n_tokens * itemsize + n_docs * 8
        if size != expected:
            kind = "truncated" if size < expected else "has trailing bytes"
            raise _corrupt(path, f"{kind}: {size} bytes, the header promises {expected}")
        if n_tokens == 0 or n_docs == 0:
            raise _corrupt(path, "empty shard")
        sidecar = path.with_suffix(".json")
        meta: dict[str, Any] = {}
        if sidecar.is_file():
            try:
                meta = read_json(sidecar)
            except CheckpointError as error:
                raise _corrupt(path, f"sidecar {error}") from error
            for key, value in (("tokens", n_tokens), ("documents", n_docs), ("bytes", size)):
                if meta.get(key) != value:
                    raise _corrupt(
                        path, f"sidecar says {key}={meta.get(key)!r}, the file has {value}"
                    )
        dtype = np.dtype("<u2") if itemsize == 2 else np.dtype("<u4")
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))
        offsets = np.memmap(
            path,
            dtype="<u8",
            mode="r",
            offset=HEADER_BYTES + n_tokens * itemsize,
            shape=(n_docs,),
        )
        if offsets[0] != 0 or offsets[-1] >= n_tokens or np.any(np.diff(offsets) <= 0):
            raise _corrupt(path, "document offsets are not increasing from 0")
        if tokens[-1] != eos_id:
            raise _corrupt(path, "the last token is not EOS")
        digest = meta.get("sha256")
        if verify == "sha256":
            if not digest:
                raise _corrupt(path, "no sha256 to verify against (sidecar missing)")
            actual = _file_sha256(path, HEADER_BYTES)
            if actual != digest:
                raise _corrupt(path, f"sha256 mismatch ({actual[:12]}... != {digest[:12]}...)")
        return cls(
            path=path,
            tokens=tokens,
            document_offsets=offsets,
            vocab_size=int(vocab_size),
            eos_id=int(eos_id),
            sha256=digest,
            tokenizer=meta.get("tokenizer"),
        )


def _file_sha256(path: Path, offset: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        handle.seek(offset)
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class ShardSet:
    """Shards read as one concatenated token stream (documents separated by EOS)."""

    shards: list[Shard]
    vocab_size: int
    eos_id: int
    tokenizer: str | None
    fingerprint: str
    directory: Path | None = None
    _starts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64), repr=False)

    def __post_init__(self) -> None:
        counts = [s.num_tokens for s in self.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | ShardSet,
        *,
        verify: Verify = "size",
    ) -> ShardSet:
        """Open a shard-set directory (with ``manifest.json``) or a list of shard files."""
        if isinstance(source, ShardSet):
            return source
        if isinstance(source, str | os.PathLike):
            directory = Path(source)
            manifest_path = directory / MANIFEST
            if not manifest_path.is_file():
                if directory.is_file():
                    return cls.open([directory], verify=verify)
                raise ValueError(f"{directory}: no {MANIFEST}; not a token shard set")
            manifest = read_json(manifest_path)
            if manifest.get("format") != SET_FORMAT or manifest.get("version") != FORMAT_VERSION:
                raise ValueError(
                    f"{manifest_path}: not a version-{FORMAT_VERSION} {SET_FORMAT} manifest"
                )
            shards = []
            for entry in manifest["shards"]:
                shard = Shard.open(directory / entry["file"], verify=verify)
                if shard.num_tokens != entry["tokens"] or shard.sha256 != entry["sha256"]:
                    raise _corrupt(shard.path, f"does not match {manifest_path}")
                shards.append(shard)
            return cls(
                shards=shards,
                vocab_size=int(manifest["vocab_size"]),
                eos_id=int(manifest["eos_id"]),
                tokenizer=manifest.get("tokenizer"),
                fingerprint=manifest["fingerprint"],
                directory=directory,
            )
        paths = [Path(p) for p in source]
        if not paths:
            raise ValueError("no shard files given")
        shards = [Shard.open(p, verify=verify) for p in paths]
        first = shards[0]
        for shard in shards[1:]:
            if (shard.vocab_size, shard.eos_id) != (first.vocab_size, first.eos_id):
                raise ValueError(
                    f"{shard.path}: vocab size/EOS ({shard.vocab_size}, {shard.eos_id}) differ "
                    f"from {first.path} ({first.vocab_size}, {first.eos_id})"
                )
        entries = [
            {"tokens": s.num_tokens, "sha256": s.sha256 or _file_sha256(s.path, HEADER_BYTES)}
            for s in shards
        ]
        dtype = first.tokens.dtype.name
        return cls(
            shards=shards,
            vocab_size=first.vocab_size,
            eos_id=first.eos_id,
            tokenizer=first.tokenizer,
            fingerprint=_set_fingerprint(dtype, first.vocab_size, entries),
        )

    # -- access ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self._starts[-1])

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    @property
    def dtype(self) -> np.dtype:
        return self.shards[0].tokens.dtype if self.shards else token_dtype(self.vocab_size)

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens of the concatenated stream from ``start``, as int64."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(
                f"tokens [{start}, {start + length}) outside the shard set of {self.num_tokens}"
            )
        out = np.empty(length, dtype=np.int64)
        index = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < length:
            shard = self.shards[index]
            local = start + done - int(self._starts[index])
            take = min(length - done, shard.num_tokens - local)
            out[done : done + take] = shard.tokens[local : local + take]
            done += take
            index += 1
        return out

    def documents(self) -> Iterator[np.ndarray]:
        """Each document's tokens (without its EOS), in order."""
        for shard in self.shards:
            ends = [*shard.document_offsets[1:].tolist(), shard.num_tokens]
            for begin, end in zip(shard.document_offsets.tolist(), ends, strict=True):
                yield np.asarray(shard.tokens[begin : end - 1], dtype=np.int64)

    def verify(self) -> None:
        """Re-hash every shard against its sidecar (``ValueError`` naming a bad file)."""
        for shard in self.shards:
            Shard.open(shard.path, verify="sha256")


# --------------------------------------------------------------------------------------------
# documents -> train/valid shard sets
# --------------------------------------------------------------------------------------------
def is_validation_document(text: str, *, seed: int, valid_fraction: float) -> bool:
    """Whether a document belongs to the validation split.

    Decided by a keyed hash of the document's content, so it is deterministic for a seed,
    independent of order and of other documents, and identical documents share a split.
    """
    if valid_fraction <= 0.0:
        return False
    key = seed.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") < valid_fraction * 2.0**64


@dataclass
class WriteResult:
    """Both shard sets and the counts of one :func:`write_token_shards` run."""

    train: ShardSet
    valid: ShardSet
    documents: int
    train_documents: int
    valid_documents: int
    train_tokens: int
    valid_tokens: int
    text_bytes: int


def _progress_bar(enabled: bool, total: int | None) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="tokenising",
        disable=None if sys.stderr.isatty() else True,
    )


def write_token_shards(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    directory: str | os.PathLike[str],
    *,
    valid_fraction: float = 0.0,
    seed: int = 0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    buffer_tokens: int = DEFAULT_BUFFER_TOKENS,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: bool = False,
    progress_total: int | None = None,
) -> WriteResult:
    """Tokenise ``documents`` into ``directory/train`` and ``directory/valid`` shard sets.

    Documents go to the validation set by :func:`is_validation_document`. Text is encoded in
    batches of about ``batch_bytes`` through the tokenizer's batch encoder; memory stays
    bounded by one batch plus the writers' buffers.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must lie in [0, 1), got {valid_fraction!r}")
    directory = Path(directory)
    common = {
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer_name": tokenizer.name,
        "shard_tokens": shard_tokens,
        "buffer_tokens": buffer_tokens,
    }
    writers = {
        False: ShardWriter(directory / "train", **common),
        True: ShardWriter(directory / "valid", **common),
    }
    bar = _progress_bar(progress, progress_total)
    batch: list[str] = []
    batch_size = 0
    counts = {"documents": 0, "bytes": 0}

    def flush() -> None:
        nonlocal batch, batch_size
        if not batch:
            return
        for text, ids in zip(batch, encode_batch(tokenizer, batch), strict=True):
            writers[is_validation_document(text, seed=seed, valid_fraction=valid_fraction)].add(ids)
        if bar is not None:
            bar.update(batch_size)
        batch, batch_size = [], 0

    try:
        for text in documents:
            if not text:
                continue
            size = len(text.encode("utf-8"))
            counts["documents"] += 1
            counts["bytes"] += size
            batch.append(text)
            batch_size += size
            if batch_size >= batch_bytes:
                flush()
        flush()
        train = writers[False].close()
        valid = writers[True].close()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return WriteResult(
        train=train,
        valid=valid,
        documents=counts["documents"],
        train_documents=train.num_documents,
        valid_documents=valid.num_documents,
        train_tokens=train.num_tokens,
        valid_tokens=valid.num_tokens,
        text_bytes=counts["bytes"],
    )
