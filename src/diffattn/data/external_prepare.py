"""Preparing token files (``megatron:`` and ``datatrove:`` sources) for training: one pass that
checks the ids against the tokenizer, finds the documents that lack a final EOS and splits the
documents into train and valid, cached as two :class:`~diffattn.data.external.TokenStream`
descriptions (the tokens stay in the files).

* **EOS.** A document whose last token is the tokenizer's EOS id (Megatron's
  ``--append-eod``, datatrove's ``eos_token``) is read as it is; any other gets one EOS appended
  when read. Every document of the stream thus ends in exactly one EOS, as in diffattn's shards.
  A document that is empty, or nothing but EOS, is skipped (diffattn skips empty documents too).
* **Validation split.** Document d is held out when the keyed BLAKE2b hash (8 bytes, key = the
  seed, as :func:`~diffattn.data.shards.is_validation_document` keys it) of its ids, without a
  final EOS, as little-endian uint32, falls below ``valid_fraction · 2⁶⁴``: deterministic,
  independent of order, of the files' token width and of whether they hold EOS; identical
  documents share a split.
* **Tokenizer.** The files hold ids only; ``data.tokenizer`` names the tokenizer (``hf:`` or
  ``tiktoken:``). The largest id must lie below its vocabulary size, and a datatrove file's
  metadata (tokenizer name, token width) must agree with it.
* **Cache key.** Every file's path, size and modification time (no content read), the
  tokenizer's content hash, ``valid_fraction`` and ``seed``, as for text sources: a start with
  unchanged files reads nothing but the cached description. The streams' fingerprint (kept in
  the loader's state) hashes the content of the token and index files, taken during the
  preparation's one pass over the tokens, and the split: a copy of the files elsewhere resumes
  the same run, other tokens of the same size do not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from diffattn.data.external import (
    TokenFile,
    TokenStream,
    open_token_files,
    token_source_files,
)
from diffattn.data.tokenizers import (
    Tokenizer,
    load_tokenizer,
    parse_tokenizer_spec,
    tokenizer_fingerprint,
)
from diffattn.fileio import atomic_directory

PREPARED = "prepared.json"
PREPARED_FORMAT = "diffattn-prepared-data"
TOKENS_FORMAT = "diffattn-token-files-1"
TEXT_SETTINGS = (
    "text_field",
    "document_split",
    "max_bytes",
    "bpe_train_bytes",
    "shard_tokens",
    "strict",
)
"""``DataConfig`` fields that shape how text becomes tokens: token files take their defaults.
(Mixture weights are refused for token files by ``prepare_data`` before this module runs.)"""
SCAN_TOKENS = 1 << 22
"""Tokens read at once while scanning a file."""


@dataclass
class TokenPreparation:
    """What :func:`prepare_token_files` gives ``prepare_data``."""

    tokenizer: Tokenizer
    train: TokenStream
    valid: TokenStream
    stats: dict[str, Any]
    """``DataStats`` fields."""
    directory: Path
    cached: bool = False


@dataclass
class _Documents:
    """Per document of all files: file, first token, tokens, EOS needed, kept, held out."""

    file: list[np.ndarray] = field(default_factory=list)
    start: list[np.ndarray] = field(default_factory=list)
    length: list[np.ndarray] = field(default_factory=list)
    needs_eos: list[np.ndarray] = field(default_factory=list)
    keep: list[np.ndarray] = field(default_factory=list)
    valid: list[np.ndarray] = field(default_factory=list)

    def joined(self) -> dict[str, np.ndarray]:
        return {
            name: np.concatenate(getattr(self, name))
            if getattr(self, name)
            else np.empty(0, dtype=np.int64)
            for name in ("file", "start", "length", "needs_eos", "keep", "valid")
        }


def _hash(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_token_config(config: Any) -> Tokenizer:
    """The tokenizer of a configuration of token sources; ``ValueError`` for a ``bpe:``
    tokenizer and for any setting of :data:`TEXT_SETTINGS` other than its default."""
    if parse_tokenizer_spec(config.tokenizer).kind == "bpe":
        raise ValueError(
            f"DataConfig.tokenizer: token files hold ids only; name the tokenizer they were "
            f"written with (hf:PATH or tiktoken:NAME), not {config.tokenizer!r}"
        )
    for setting in dataclasses.fields(config):
        value = getattr(config, setting.name)
        if setting.name in TEXT_SETTINGS and value != setting.default:
            raise ValueError(
                f"DataConfig.{setting.name}: {value!r} applies to text sources, not to token "
                f"files ({', '.join(config.sources)}); leave it at {setting.default!r}"
            )
    return load_tokenizer(config.tokenizer)


def sources_fingerprint(specs: Sequence[str]) -> str:
    """Every file's path, size and modification time (the cache key's part for the sources)."""
    entries = []
    for spec in specs:
        files = token_source_files(spec)
        entries.append(
            [spec, [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]]
        )
    return _hash({"format": TOKENS_FORMAT, "sources": entries})


def prepare_token_files(config: Any, progress: bool = True) -> TokenPreparation:
    """Prepare (or open from the cache) the token sources of ``config`` (a ``DataConfig``)."""
    started = time.perf_counter()
    tokenizer = check_token_config(config)
    source_fingerprint = sources_fingerprint(config.sources)
    key = _hash(
        {
            "format": TOKENS_FORMAT,
            "sources": source_fingerprint,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "valid_fraction": config.valid_fraction,
            "seed": config.seed,
        }
    )[:24]
    directory = config.cache_path / "shards" / key
    if (directory / PREPARED).is_file():
        record = json.loads((directory / PREPARED).read_text(encoding="utf-8"))
        train, valid = (TokenStream.open(directory / name) for name in ("train", "valid"))
        return TokenPreparation(tokenizer, train, valid, record["stats"], directory, cached=True)
    files = [f for spec in config.sources for f in open_token_files(spec)]
    for file in files:
        check_file_tokenizer(file, tokenizer)
    documents = _Documents()
    described = []
    for number, file in enumerate(files):
        content = _scan(file, number, tokenizer, config.seed, config.valid_fraction, documents)
        described.append([file.dtype.str, file.num_tokens, content, _file_sha256(file.index)])
    table = documents.joined()
    with atomic_directory(directory, overwrite=True) as tmp:
        streams = {}
        for split in ("train", "valid"):
            streams[split] = _stream(files, described, table, split, tokenizer, config)
            streams[split].save(tmp / split, {"split": split})
        if streams["train"].num_tokens == 0:
            raise ValueError(
                f"empty corpus: no training tokens in sources {list(config.sources)} "
                f"({len(table['keep'])} documents, valid_fraction={config.valid_fraction})"
            )
        if getattr(tokenizer, "backend", None) is not None:
            tokenizer.save(tmp / "tokenizer")
        stats = _stats(streams, table, files, source_fingerprint, tokenizer, started)
        record = {
            "format": PREPARED_FORMAT,
            "config": config.to_dict(),
            "stats": stats,
            "token_files": {
                "files": [str(f.path.resolve()) for f in files],
                "documents": len(table["keep"]),
                "skipped_empty": int((~table["keep"]).sum()),
                "eos_appended": int((table["needs_eos"] & table["keep"]).sum()),
            },
        }
        (tmp / PREPARED).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    train, valid = (TokenStream.open(directory / name) for name in ("train", "valid"))
    return TokenPreparation(tokenizer, train, valid, stats, directory)


def _tokenizer_key(name: str) -> str:
    """A tokenizer's name without the spec kind, a trailing ``tokenizer.json`` or slashes,
    last path component only: ``hf:/models/gpt2/tokenizer.json`` and ``openai/gpt2`` give
    ``gpt2``."""
    name = name.partition(":")[2] if name.startswith(("hf:", "tiktoken:")) else name
    name = name.rstrip("/")
    if name.endswith("tokenizer.json"):
        name = name[: -len("tokenizer.json")].rstrip("/")
    return name.rsplit("/", 1)[-1]


def check_file_tokenizer(file: TokenFile, tokenizer: Tokenizer) -> None:
    """Refuse a token file whose metadata (datatrove's) names another tokenizer than
    ``tokenizer``, or a token width it would not have written for it."""
    if file.token_bytes is not None:
        width = 4 if tokenizer.vocab_size > 1 << 16 else 2
        if file.token_bytes != width:
            raise ValueError(
                f"{file.path}: written with {file.token_bytes}-byte tokens, but "
                f"{tokenizer.name} ({tokenizer.vocab_size} ids) is written with {width}-byte "
                "tokens; name the tokenizer the files were written with (data.tokenizer)"
            )
    if file.tokenizer is None or _tokenizer_key(file.tokenizer) == _tokenizer_key(tokenizer.name):
        return
    written = Path(file.tokenizer).expanduser()
    if written.exists():
        try:
            same = tokenizer_fingerprint(load_tokenizer(f"hf:{written}")) == tokenizer_fingerprint(
                tokenizer
            )
        except (ValueError, OSError, ImportError):
            same = False
        if same:
            return
    raise ValueError(
        f"{file.path}: written with tokenizer {file.tokenizer!r} (its .metadata), but "
        f"data.tokenizer is {tokenizer.name!r}; name the tokenizer the files were written with"
    )


def _scan(
    file: TokenFile,
    number: int,
    tokenizer: Tokenizer,
    seed: int,
    valid_fraction: float,
    out: _Documents,
) -> str:
    """Append ``file``'s documents to ``out``: each one's EOS, emptiness and split, reading
    the file in pieces of about :data:`SCAN_TOKENS` tokens; ``ValueError`` naming the file and
    the token for an id outside the vocabulary. Returns the sha256 of the file's tokens."""
    tokens, bounds, eos = file.tokens(), file.bounds, tokenizer.eos_id
    content_digest = hashlib.sha256()
    key = seed.to_bytes(8, "little", signed=True)
    threshold = valid_fraction * 2.0**64
    first = 0
    while first < file.num_documents:
        base = int(bounds[first])
        last = int(np.searchsorted(bounds, base + SCAN_TOKENS, side="right")) - 1
        last = min(max(last, first + 1), file.num_documents)
        raw = tokens[base : int(bounds[last])]
        content_digest.update(memoryview(np.ascontiguousarray(raw)).cast("B"))
        piece = np.asarray(raw, dtype=np.int64)
        if piece.size and (piece.min() < 0 or piece.max() >= tokenizer.vocab_size):
            bad = int(np.argmax((piece < 0) | (piece >= tokenizer.vocab_size)))
            raise ValueError(
                f"{file.path}: token {base + bad} is id {int(piece[bad])}, outside the "
                f"vocabulary of {tokenizer.name} ({tokenizer.vocab_size} ids); name the "
                "tokenizer the files were written with (data.tokenizer)"
            )
        starts = np.asarray(bounds[first:last], dtype=np.int64)
        lengths = np.asarray(bounds[first + 1 : last + 1], dtype=np.int64) - starts
        ends_in_eos = np.zeros(len(starts), dtype=bool)
        filled = lengths > 0
        ends_in_eos[filled] = piece[starts[filled] + lengths[filled] - 1 - base] == eos
        content = lengths - ends_in_eos
        held_out = np.zeros(len(starts), dtype=bool)
        if valid_fraction > 0:
            words = piece.astype("<u4")
            for i, (begin, count) in enumerate(
                zip((starts - base).tolist(), content.tolist(), strict=True)
            ):
                data = words[begin : begin + count].tobytes()
                digest = hashlib.blake2b(data, digest_size=8, key=key).digest()
                held_out[i] = int.from_bytes(digest, "little") < threshold
        out.file.append(np.full(len(starts), number, dtype=np.int64))
        out.start.append(starts)
        out.length.append(lengths)
        out.needs_eos.append(~ends_in_eos)
        out.keep.append(content > 0)
        out.valid.append(held_out)
        first = last
    return content_digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _stream(
    files: list[TokenFile],
    described: list[Any],
    table: dict[str, np.ndarray],
    split: str,
    tokenizer: Tokenizer,
    config: Any,
) -> TokenStream:
    """The documents of ``split`` as a stream: consecutive documents that lie back to back in
    one file and need no EOS between them form one segment. ``described`` identifies the files
    (token type, tokens, the sha256 of the tokens and of the index) in the fingerprint."""
    chosen = table["keep"] & (table["valid"] if split == "valid" else ~table["valid"])
    picked = np.flatnonzero(chosen)
    file, start = table["file"][picked], table["start"][picked]
    length, eos = table["length"][picked], table["needs_eos"][picked].astype(np.int64)
    spans = length + eos
    offsets = np.zeros(len(picked), dtype=np.int64)
    if len(picked) > 1:
        np.cumsum(spans[:-1], out=offsets[1:])
    new = np.ones(len(picked), dtype=bool)
    new[1:] = (file[1:] != file[:-1]) | (eos[:-1] == 1) | (start[1:] != start[:-1] + length[:-1])
    heads = np.flatnonzero(new)
    tails = np.append(heads[1:] - 1, len(picked) - 1) if len(heads) else heads
    segments = np.stack(
        [
            offsets[heads],
            file[heads],
            start[heads],
            np.add.reduceat(length, heads) if len(heads) else heads,
            eos[tails],
        ]
    ).astype(np.int64)
    fingerprint = _hash(
        {
            "files": described,
            "eos": tokenizer.eos_id,
            "vocab": tokenizer.vocab_size,
            "split": [split, config.seed, config.valid_fraction],
            "segments": hashlib.sha256(segments.tobytes()).hexdigest(),
        }
    )
    return TokenStream(
        [(f.path.resolve(), f.dtype, f.num_tokens) for f in files],
        segments,
        offsets,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        tokenizer=tokenizer.name,
        fingerprint=fingerprint,
    )


def _stats(
    streams: dict[str, TokenStream],
    table: dict[str, np.ndarray],
    files: list[TokenFile],
    source_fingerprint: str,
    tokenizer: Tokenizer,
    started: float,
) -> dict[str, Any]:
    """``DataStats`` fields of a preparation of token files (no text: its byte counts are 0)."""
    train, valid = streams["train"], streams["valid"]
    return {
        "documents": train.num_documents + valid.num_documents,
        "train_documents": train.num_documents,
        "valid_documents": valid.num_documents,
        "tokens": train.num_tokens + valid.num_tokens,
        "train_tokens": train.num_tokens,
        "valid_tokens": valid.num_tokens,
        "text_bytes": 0,
        "files": len(files),
        "replaced_files": 0,
        "replaced_documents": 0,
        "replaced_bytes": 0,
        "truncated": False,
        "fingerprint": _hash([train.fingerprint, valid.fingerprint]),
        "source_fingerprint": source_fingerprint,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "seconds": round(time.perf_counter() - started, 3),
    }
