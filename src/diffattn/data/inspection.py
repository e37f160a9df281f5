"""What a preparation or a shard set holds, read without changing it (``diffattn data inspect``).

:func:`inspect_path` reads a prepared directory (``CACHE/shards/KEY`` with ``prepared.json``)
or one shard-set directory (``manifest.json``): totals, the train/valid split, fingerprints,
the tokenizer, each shard with its size, and a few documents decoded (spread evenly over the
set: document ⌊i·N/K⌋ of N for i < K). :func:`find_prepared` finds the cache entry of a
:class:`~diffattn.data.prepare.DataConfig` without preparing anything. A truncated shard, a
garbled ``manifest.json`` or ``prepared.json``, or the temporary directory of an interrupted
preparation raises one ``ValueError`` naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from diffattn.data.external import STREAM_FILE, TokenStream
from diffattn.data.prepare import PREPARED, PREPARED_FORMAT, DataConfig, load_prepared_tokenizer
from diffattn.data.shards import MANIFEST, ShardSet
from diffattn.data.sources import fingerprint_sources
from diffattn.data.tokenizers import Tokenizer, load_tokenizer, parse_tokenizer_spec
from diffattn.fileio import is_partial_write, read_json

SAMPLE_CHARS = 400
"""Characters of a decoded sample document shown (the rest elided)."""
SPLITS = ("train", "valid")


def _refuse_partial(path: Path) -> None:
    for part in path.resolve().parts:
        if is_partial_write(part):
            raise ValueError(
                f"{path}: the temporary directory of an interrupted write; not read "
                "(prepare again: the complete entry replaces it)"
            )


def _open_set(directory: Path, verify: bool) -> Any:
    """The shard set in ``directory`` (or, without ``manifest.json``, the stream of token files
    read in place that a ``megatron:``/``datatrove:`` preparation saved there); a manifest of
    the right format that lacks an entry is named like any other corrupt file."""
    if not (directory / MANIFEST).is_file() and (directory / STREAM_FILE).is_file():
        return TokenStream.open(directory)
    try:
        return ShardSet.open(directory, verify="sha256" if verify else "size")
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{directory / MANIFEST}: malformed manifest ({error!r})") from None


def _shard_rows(shards: ShardSet | TokenStream, root: Path) -> list[dict[str, Any]]:
    if isinstance(shards, TokenStream):  # token files read in place: no shards of ours
        return []
    return [
        {
            "file": shard.path.relative_to(root).as_posix(),
            "tokens": shard.num_tokens,
            "documents": shard.num_documents,
            "bytes": shard.path.stat().st_size,
        }
        for shard in shards.shards
    ]


def _document(shards: ShardSet | TokenStream, index: int) -> np.ndarray:
    """Document ``index`` of the set (its ids without EOS)."""
    if isinstance(shards, TokenStream):
        offsets = shards.document_offsets
        last = index + 1 == shards.num_documents
        end = shards.num_tokens if last else int(offsets[index + 1])
        return shards.read(int(offsets[index]), end - int(offsets[index]))[:-1]
    for shard in shards.shards:
        if index < shard.num_documents:
            begin = int(shard.document_offsets[index])
            last = index + 1 == shard.num_documents
            end = shard.num_tokens if last else int(shard.document_offsets[index + 1])
            return np.asarray(shard.tokens[begin : end - 1], dtype=np.int64)
        index -= shard.num_documents
    raise IndexError(index)


def _samples(
    shards: ShardSet | TokenStream, tokenizer: Tokenizer | None, count: int
) -> list[dict[str, Any]]:
    total = shards.num_documents
    picks = sorted({i * total // count for i in range(count)}) if total and count else []
    rows = []
    for index in picks:
        ids = _document(shards, index)
        row: dict[str, Any] = {"document": index, "tokens": int(ids.size)}
        if tokenizer is not None:
            text = tokenizer.decode(ids.tolist())
            row["text"] = text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + " …"
        else:
            row["ids"] = ids[:32].tolist()
        rows.append(row)
    return rows


def _split_summary(
    shards: ShardSet | TokenStream, root: Path, tokenizer: Tokenizer | None, samples: int
) -> dict[str, Any]:
    rows = _shard_rows(shards, root)
    return {
        "documents": shards.num_documents,
        "tokens": shards.num_tokens,
        "fingerprint": shards.fingerprint,
        "bytes": sum(r["bytes"] for r in rows),
        "shards": rows,
        "samples": _samples(shards, tokenizer, samples),
    }


def _tokenizer_of_set(shards: ShardSet, directory: Path) -> Tokenizer | None:
    """The tokenizer to decode a lone shard set: its preparation's, else a ``tiktoken:`` spec
    by name; ``None`` when neither is at hand (samples then show ids)."""
    parent = directory.parent
    if (parent / PREPARED).is_file():
        return load_prepared_tokenizer(parent)
    try:
        spec = parse_tokenizer_spec(shards.tokenizer)
    except ValueError:
        return None
    return load_tokenizer(shards.tokenizer) if spec.kind == "tiktoken" else None


def _read_record(path: Path) -> dict[str, Any]:
    record = read_json(path)
    if record.get("format") != PREPARED_FORMAT:
        raise ValueError(f"{path}: not a {PREPARED_FORMAT} record")
    for key in ("config", "stats"):
        if not isinstance(record.get(key), dict):
            raise ValueError(f"{path}: malformed record (no {key!r} object)")
    return record


def inspect_path(path: str | os.PathLike[str], samples: int = 3, verify: bool = False) -> dict:
    """The summary of a prepared directory or a shard set (see the module docstring).

    ``verify``: re-hash every shard against its sidecar (else header, size and offsets are
    checked). ``samples``: documents decoded per split."""
    path = Path(path)
    _refuse_partial(path)
    if (path / PREPARED).is_file():
        record = _read_record(path / PREPARED)
        sets = {split: _open_set(path / split, verify) for split in SPLITS}
        tokenizer = load_prepared_tokenizer(path)
        stats = record["stats"]
        return {
            "kind": "prepared",
            "path": str(path),
            "tokenizer": _tokenizer_row(
                stats.get("tokenizer", tokenizer.name), tokenizer.vocab_size, tokenizer.eos_id
            ),
            "documents": stats.get("documents"),
            "tokens": sum(s.num_tokens for s in sets.values()),
            "text_bytes": stats.get("text_bytes"),
            "fingerprint": stats.get("fingerprint"),
            "source_fingerprint": stats.get("source_fingerprint"),
            "sources": record["config"].get("sources"),
            "mixture": record.get("mixture"),
            "splits": {
                name: _split_summary(shards, path, tokenizer, samples)
                for name, shards in sets.items()
            },
        }
    if (path / MANIFEST).is_file():
        shards = _open_set(path, verify)
        tokenizer = _tokenizer_of_set(shards, path)
        return {
            "kind": "shards",
            "path": str(path),
            "tokenizer": _tokenizer_row(shards.tokenizer, shards.vocab_size, shards.eos_id),
            "documents": shards.num_documents,
            "tokens": shards.num_tokens,
            "fingerprint": shards.fingerprint,
            "splits": {path.name: _split_summary(shards, path, tokenizer, samples)},
        }
    raise ValueError(
        f"{path}: neither a prepared data directory ({PREPARED}) nor a token shard set "
        f"({MANIFEST}) nor a recipe"
    )


def _tokenizer_row(name: str | None, vocab_size: int, eos_id: int) -> dict[str, Any]:
    return {"name": name, "vocab_size": int(vocab_size), "eos_id": int(eos_id)}


def find_prepared(config: DataConfig) -> Path:
    """The newest cache entry prepared from ``config`` and from its sources as they are now
    (same configuration and source fingerprint), found without preparing; ``ValueError`` when
    there is none."""
    expected = config.to_dict()
    reading = ("text_field", "document_split", "max_bytes")  # as prepare_data hashes them
    sources = fingerprint_sources(config.sources, **{k: getattr(config, k) for k in reading})
    found = []
    for record_path in sorted((config.cache_path / "shards").glob(f"*/{PREPARED}")):
        if is_partial_write(record_path.parent.name):
            continue
        try:
            record = _read_record(record_path)
        except ValueError:
            continue
        same = record["config"] == expected
        if same and record["stats"].get("source_fingerprint") == sources:
            found.append(record_path.parent)
    if not found:
        raise ValueError(
            f"no prepared data for these sources in {config.cache_path / 'shards'}; "
            "prepare it first (diffattn data prepare)"
        )
    return max(found, key=lambda p: (p / PREPARED).stat().st_mtime_ns)


def describe(summary: dict[str, Any]) -> list[str]:
    """The lines ``diffattn data`` prints for a summary of :func:`inspect_path`."""
    tok = summary["tokenizer"]
    lines = [
        f"{'prepared data' if summary['kind'] == 'prepared' else 'shard set'}: {summary['path']}"
    ]
    lines.append(f"  tokenizer    {tok['name']} (vocab {tok['vocab_size']:,}, EOS {tok['eos_id']})")
    if summary.get("text_bytes") is not None:
        lines.append(
            f"  read         {summary['documents']:,} documents, {summary['text_bytes']:,} bytes"
        )
    lines.append(f"  fingerprint  {summary['fingerprint']}")
    for name, split in summary["splits"].items():
        where = (
            f"{len(split['shards'])} shard(s), {split['bytes']:,} bytes"
            if split["shards"]
            else "token files read in place"
        )
        lines.append(
            f"  {name:<12} {split['documents']:,} documents, {split['tokens']:,} tokens, {where}"
        )
    if summary.get("mixture"):
        for entry in summary["mixture"]["sources"]:
            lines.append(
                f"  mixture      {entry['source']}: weight {entry['weight']:g}, share "
                f"{entry['share']:.3f} (target {entry['target_share']:.3f}), "
                f"{entry['copies']:.2f} copies"
            )
    return lines


def describe_shards(summary: dict[str, Any]) -> list[str]:
    """One line per shard file, then the sample documents."""
    lines = ["shards"]
    for split in summary["splits"].values():
        for row in split["shards"]:
            lines.append(
                f"  {row['file']:<28} {row['tokens']:>12,} tokens {row['documents']:>9,} "
                f"documents {row['bytes']:>13,} bytes"
            )
    lines.append("samples")
    for name, split in summary["splits"].items():
        for row in split["samples"]:
            shown = repr(row["text"]) if "text" in row else f"ids {row['ids']}"
            lines.append(f"  {name} #{row['document']} ({row['tokens']:,} tokens): {shown}")
    return lines


__all__ = ["describe", "describe_shards", "find_prepared", "inspect_path"]
