"""One call from a data configuration to a tokenizer and train/valid token shards.

:func:`prepare_data` reads the sources, builds the tokenizer (training a BPE on the training
documents when asked), tokenises everything into ``train`` and ``valid`` shard sets and caches
the result under ``cache_dir``: the same sources, tokenizer and settings give the same
directory, which a second call opens instantly.

Cache layout::

    CACHE/tokenizers/bpe-VOCAB-KEY/      trained BPE tokenizers
    CACHE/shards/KEY/prepared.json       totals, statistics, the configuration
    CACHE/shards/KEY/tokenizer/          the tokenizer (HF files) for HF/BPE tokenizers
    CACHE/shards/KEY/{train,valid}/      shard sets (manifest.json, shard-NNNNN.{bin,json})

A preparation is built in a temporary sibling directory and renamed into place when complete
(:func:`diffattn.fileio.atomic_directory`), so an interrupted run leaves no half-written cache
entry and concurrent runs do not clash.
Under ``torchrun`` prepare on rank 0 first, then barrier, then call it on every rank (a cache
hit).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from diffattn.config import reject_unknown_fields
from diffattn.data.external import token_sources
from diffattn.data.external_prepare import prepare_token_files
from diffattn.data.mixture import join_sources, split_sources, write_mixture_shards
from diffattn.data.shards import (
    DEFAULT_SHARD_TOKENS,
    FORMAT_VERSION,
    ShardSet,
    WriteResult,
    is_validation_document,
    write_token_shards,
)
from diffattn.data.sources import (
    DOCUMENT_SPLITS,
    SourceStats,
    check_source_spec,
    check_sources_exist,
    fingerprint_sources,
    iter_documents,
)
from diffattn.data.tokenizers import (
    Tokenizer,
    default_cache_dir,
    load_hf_tokenizer,
    load_tokenizer,
    parse_tokenizer_spec,
    tokenizer_fingerprint,
)
from diffattn.fileio import atomic_directory, read_json

PREPARED = "prepared.json"
PREPARED_FORMAT = "diffattn-prepared-data"


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it becomes tokens; validated on construction."""

    sources: tuple[str, ...] = ("stdlib",)
    """Source specs (see :mod:`diffattn.data.sources`); ``"stdlib"`` is the embedded corpus."""
    text_field: str = "text"
    """Field/column holding the text in JSON lines, Parquet and HF datasets."""
    document_split: str = "file"
    """How plain text files become documents: ``file``, ``paragraph`` or ``line``."""
    tokenizer: str = "bpe:8192"
    """Tokenizer spec: ``bpe:VOCAB``, ``tiktoken:NAME`` or ``hf:PATH``."""
    valid_fraction: float = 0.05
    """Expected fraction of documents held out for validation (by document, by hash)."""
    seed: int = 0
    """Seed of the validation split (the loader has its own seed)."""
    max_bytes: int | None = None
    """Cap on the UTF-8 bytes read from all sources together; ``None``: no cap (the
    ``"stdlib"`` source has its own 16 MB cap)."""
    bpe_train_bytes: int | None = 100_000_000
    """Cap on the training text a ``bpe:`` tokenizer learns from; ``None``: all of it."""
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    """Tokens per shard file."""
    cache_dir: str | None = None
    """Cache root; ``None``: ``$DIFFATTN_CACHE/data`` or ``~/.cache/diffattn/data``."""
    strict: bool = False
    """Refuse bad text: the first binary document (NUL byte) or invalid UTF-8 byte raises
    ``ValueError`` naming the file and offset. ``False``: binary documents are skipped and
    invalid bytes become U+FFFD, both counted in :class:`DataStats` and reported once."""
    weights: tuple[float, ...] | None = None
    """Mixture weights, one per source (:mod:`diffattn.data.mixture`); also written beside each
    source, ``{source: SPEC, weight: W}``. ``None``: every document once."""

    def __post_init__(self) -> None:
        sources = self.sources
        if isinstance(sources, str):
            sources = (sources,)
        if not isinstance(sources, list | tuple) or not sources:
            self._fail("sources", f"must be a non-empty list of source specs, got {sources!r}")
        try:
            sources, weights = split_sources(sources, self.weights)
        except ValueError as error:
            self._fail("sources", str(error))
        object.__setattr__(self, "sources", tuple(sources))
        object.__setattr__(self, "weights", weights)
        for spec in self.sources:
            try:
                check_source_spec(spec)
            except ValueError as error:
                self._fail("sources", str(error))
        if not isinstance(self.text_field, str) or not self.text_field:
            self._fail("text_field", f"must be a non-empty string, got {self.text_field!r}")
        if self.document_split not in DOCUMENT_SPLITS:
            self._fail(
                "document_split",
                f"must be one of {', '.join(DOCUMENT_SPLITS)}, got {self.document_split!r}",
            )
        try:
            parse_tokenizer_spec(self.tokenizer)
        except ValueError as error:
            self._fail("tokenizer", str(error))
        fraction = self.valid_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            self._fail("valid_fraction", f"must be a number in [0, 1), got {fraction!r}")
        if not 0.0 <= float(fraction) < 1.0:
            self._fail("valid_fraction", f"must lie in [0, 1), got {fraction!r}")
        object.__setattr__(self, "valid_fraction", float(fraction))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            self._fail("seed", f"must be a non-negative integer, got {self.seed!r}")
        for name in ("max_bytes", "bpe_train_bytes"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                self._fail(name, f"must be a positive integer or None, got {value!r}")
        if (
            isinstance(self.shard_tokens, bool)
            or not isinstance(self.shard_tokens, int)
            or self.shard_tokens <= 0
        ):
            self._fail("shard_tokens", f"must be a positive integer, got {self.shard_tokens!r}")
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, str | os.PathLike) or not str(self.cache_dir):
                self._fail("cache_dir", f"must be a path or None, got {self.cache_dir!r}")
            object.__setattr__(self, "cache_dir", str(self.cache_dir))
        if not isinstance(self.strict, bool):
            self._fail("strict", f"must be true or false, got {self.strict!r}")

    @staticmethod
    def _fail(name: str, message: str) -> None:
        raise ValueError(f"DataConfig.{name}: {message}")

    @property
    def cache_path(self) -> Path:
        """The resolved cache root."""
        if self.cache_dir is not None:
            return Path(os.path.expanduser(self.cache_dir))
        return default_cache_dir()

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["sources"] = join_sources(self.sources, self.weights)
        del data["weights"]  # beside each source of a mixture
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataConfig:
        """Build from a mapping; an unknown key raises ``ValueError`` naming it."""
        reject_unknown_fields("DataConfig", data, cls)
        return cls(**dict(data))

    def replace(self, **changes: Any) -> DataConfig:
        """A copy with ``changes``; new ``weights`` alone apply to these sources, new
        ``sources`` alone drop a mixture's weights."""
        if "weights" in changes and "sources" not in changes:
            changes["sources"] = list(self.sources)
        elif "sources" in changes and "weights" not in changes:
            changes["weights"] = None
        return DataConfig.from_dict({**self.to_dict(), **changes})


@dataclass(frozen=True)
class DataStats:
    """What a preparation read and wrote."""

    documents: int
    train_documents: int
    valid_documents: int
    tokens: int
    train_tokens: int
    valid_tokens: int
    text_bytes: int
    files: int
    replaced_files: int
    replaced_documents: int
    replaced_bytes: int
    truncated: bool
    fingerprint: str
    """Content hash of the train and valid token streams."""
    source_fingerprint: str
    tokenizer: str
    vocab_size: int
    seconds: float
    """Wall time of the preparation (of the original run when read from the cache)."""
    binary_files: int = 0
    binary_documents: int = 0
    """Documents skipped because they hold a NUL byte."""
    binary_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def clean(self) -> bool:
        """Nothing was replaced or skipped: a strict preparation gives the same data."""
        return not (self.replaced_bytes or self.replaced_documents or self.binary_documents)

    def text_notice(self) -> str | None:
        """One line saying what was skipped and replaced; ``None`` for a clean corpus."""
        if self.clean:
            return None
        parts = []
        if self.binary_documents:
            parts.append(
                f"skipped {self.binary_documents} binary document(s) (NUL bytes; "
                f"{self.binary_bytes} bytes) in {self.binary_files} file(s)"
            )
        if self.replaced_documents:
            parts.append(
                f"replaced {self.replaced_bytes} invalid UTF-8 byte(s) with U+FFFD in "
                f"{self.replaced_documents} document(s) of {self.replaced_files} file(s)"
            )
        return f"diffattn data: {'; '.join(parts)}; data.strict=true refuses them"


@dataclass
class PreparedData:
    """The result of :func:`prepare_data`."""

    config: DataConfig
    tokenizer: Tokenizer
    train: ShardSet
    valid: ShardSet
    stats: DataStats
    directory: Path
    cached: bool = False
    """True when the shards came from the cache."""


def _hash(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _documents(config: DataConfig, stats: SourceStats | None = None) -> Iterator[str]:
    return iter_documents(
        config.sources,
        text_field=config.text_field,
        split=config.document_split,  # type: ignore[arg-type]
        max_bytes=config.max_bytes,
        stats=stats,
        strict=config.strict,
    )


class PrepareEngine(Protocol):
    """What tokenises the documents when not this process alone (``diffattn data prepare
    --engine``, e.g. :class:`diffattn.data.ray_engine.RayEngine`): the same documents in the
    same order as :func:`iter_documents`, so the same tokenizer, shards and cache key.

    ``write_shards(config, stats, tokenizer, out, entry, progress)`` tokenises into ``out``'s
    train and valid shard sets as :func:`~diffattn.data.shards.write_token_shards` does,
    counting into ``stats``; ``entry`` is the cache entry ``out`` becomes (resumable work may
    live beside it)."""

    write_shards: Callable[[DataConfig, SourceStats, Tokenizer, Path, Path, bool], WriteResult]

    def documents(self, config: DataConfig) -> Iterator[str]:
        """``config``'s documents in input order (what a BPE tokenizer learns from)."""
        ...

    def published(self, entry: Path) -> None:
        """``entry`` is complete: work kept for a resume can go."""
        ...


def check_engine_config(config: DataConfig) -> None:
    """``ValueError`` for what only this process prepares (a mixture), before any engine."""
    if config.weights is not None:
        raise ValueError(
            "mixture weights are prepared by this process alone; leave out --engine ray"
        )


def _training_documents(
    config: DataConfig, documents: Iterable[str] | None = None
) -> Iterator[str]:
    """Training-split documents (of ``documents``, default: ``config``'s), capped at
    ``bpe_train_bytes`` (what a BPE learns from)."""
    used = 0
    for text in _documents(config) if documents is None else documents:
        if is_validation_document(text, seed=config.seed, valid_fraction=config.valid_fraction):
            continue
        yield text
        used += len(text.encode("utf-8"))
        if config.bpe_train_bytes is not None and used >= config.bpe_train_bytes:
            return


def _empty_corpus(config: DataConfig, detail: str) -> ValueError:
    return ValueError(f"empty corpus: {detail} in sources {list(config.sources)}")


def _build_tokenizer(
    config: DataConfig,
    source_fingerprint: str,
    progress: bool,
    engine: PrepareEngine | None = None,
) -> Tokenizer:
    spec = parse_tokenizer_spec(config.tokenizer)
    if spec.kind != "bpe":
        return load_tokenizer(config.tokenizer)
    corpus = _hash(
        {
            "sources": source_fingerprint,
            "seed": config.seed,
            "valid_fraction": config.valid_fraction,
            "bpe_train_bytes": config.bpe_train_bytes,
        }
    )
    try:
        return load_tokenizer(
            config.tokenizer,
            documents=lambda: _training_documents(
                config, None if engine is None else engine.documents(config)
            ),
            cache_dir=config.cache_path,
            fingerprint=corpus,
            progress=progress,
        )
    except ValueError as error:
        if "empty corpus" in str(error):
            raise _empty_corpus(config, "no training documents to learn a BPE from") from None
        raise


def _refuse_unclean_cache(config: DataConfig, stats: DataStats, directory: Path) -> None:
    """Strict mode and a cached preparation that replaced or skipped text: name the culprit."""
    for _ in _documents(config):  # raises TextError at the first offending file
        pass
    raise ValueError(  # pragma: no cover - the sources changed without changing the key
        f"strict mode: the cached preparation {directory} replaced or skipped text "
        f"({stats.text_notice()}); delete it to rebuild"
    )


def _open_prepared(config: DataConfig, directory: Path, tokenizer: Tokenizer) -> PreparedData:
    record = read_json(directory / PREPARED)
    try:
        train = ShardSet.open(directory / "train")
        valid = ShardSet.open(directory / "valid")
    except ValueError as error:
        raise ValueError(
            f"{error} (cached preparation {directory}; delete it to rebuild)"
        ) from None
    return PreparedData(
        config=config,
        tokenizer=tokenizer,
        train=train,
        valid=valid,
        stats=DataStats(**record["stats"]),
        directory=directory,
        cached=True,
    )


def prepare_data(
    config: DataConfig | Mapping[str, Any] | None = None,
    progress: bool = True,
    engine: PrepareEngine | None = None,
) -> PreparedData:
    """Tokenise ``config``'s sources into cached train/valid shard sets.

    ``engine``: what reads and tokenises the documents (:class:`PrepareEngine`; ``None``: this
    process). Returns the tokenizer, both :class:`~diffattn.data.shards.ShardSet` objects and
    :class:`DataStats`. Raises ``ValueError`` before any work for a bad configuration or a
    missing local source, and ``ValueError`` naming the sources for an empty corpus or one
    whose documents all fell into the validation split.
    """
    if config is None:
        config = DataConfig()
    elif not isinstance(config, DataConfig):
        config = DataConfig.from_dict(config)
    check_sources_exist(config.sources)
    if token_sources(config.sources):  # megatron:/datatrove: token files, read in place
        if config.weights is not None:
            raise ValueError(
                "mixture weights apply to text sources; megatron: and datatrove: token files "
                "are read in place, each document once"
            )
        return _prepare_token_files(config, progress)
    started = time.perf_counter()
    source_fingerprint = fingerprint_sources(
        config.sources,
        text_field=config.text_field,
        document_split=config.document_split,
        max_bytes=config.max_bytes,
    )
    if next(_documents(config), None) is None:
        raise _empty_corpus(config, "no documents")
    if engine is not None:
        check_engine_config(config)
    tokenizer = _build_tokenizer(config, source_fingerprint, progress, engine)
    root = config.cache_path / "shards"
    directory = root / _preparation_key(config, source_fingerprint, tokenizer)
    if (directory / PREPARED).is_file():
        return _reuse_prepared(config, directory, tokenizer, progress)

    # written whole or not at all; a directory written meanwhile by another process (the
    # same data: the name is a hash of everything that determines it) is replaced
    with atomic_directory(directory, overwrite=True) as tmp:
        source_stats = SourceStats()
        if engine is None:
            result, mixture = _write_shards(config, source_stats, tokenizer, tmp, progress)
        else:
            written = engine.write_shards(config, source_stats, tokenizer, tmp, directory, progress)
            result, mixture = _check_written(config, written, stacklevel=3), {}
        if getattr(tokenizer, "backend", None) is not None:
            tokenizer.save(tmp / "tokenizer")
        stats = _data_stats(result, source_stats, source_fingerprint, tokenizer, started)
        record = {
            "format": PREPARED_FORMAT,
            "version": FORMAT_VERSION,
            "config": config.to_dict(),
            "stats": stats.to_dict(),
            **mixture,
        }
        (tmp / PREPARED).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if engine is not None:
        engine.published(directory)
    notice = stats.text_notice()
    if notice:
        print(notice, file=sys.stderr, flush=True)
    prepared = _open_prepared(config, directory, tokenizer)
    prepared.cached = False
    return prepared


def _preparation_key(config: DataConfig, source_fingerprint: str, tokenizer: Tokenizer) -> str:
    """The cache entry's name: a hash of everything that determines the shards (the shard
    format, the sources' content, the tokenizer, the validation split and the shard size)."""
    return _hash(
        {
            "format": FORMAT_VERSION,
            "sources": source_fingerprint,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "valid_fraction": config.valid_fraction,
            "seed": config.seed,
            "shard_tokens": config.shard_tokens,
            # a plain source list keeps the key it always had
            **({"mixture": list(config.weights)} if config.weights is not None else {}),
        }
    )[:24]


def _reuse_prepared(
    config: DataConfig, directory: Path, tokenizer: Tokenizer, progress: bool
) -> PreparedData:
    """A cache hit: the preparation in ``directory``, refused in strict mode when it replaced or
    skipped text, its text notice printed when ``progress``."""
    # strict and lenient runs share an entry only when nothing was replaced or skipped,
    # i.e. when both give the same data
    cached = _open_prepared(config, directory, tokenizer)
    if config.strict and not cached.stats.clean:
        _refuse_unclean_cache(config, cached.stats, directory)
    notice = cached.stats.text_notice()
    if notice and progress:
        print(notice, file=sys.stderr, flush=True)
    return cached


def _write_shards(
    config: DataConfig, source_stats: SourceStats, tokenizer: Tokenizer, tmp: Path, progress: bool
) -> tuple[WriteResult, dict[str, Any]]:
    """Tokenise the documents into ``tmp``'s train and valid shard sets (a mixture's through
    :func:`~diffattn.data.mixture.write_mixture_shards`; then also ``{"mixture": record}``);
    refuse an empty corpus or one with no training tokens, and warn (at ``prepare_data``'s
    caller) when no document fell into the validation split."""
    extra: dict[str, Any] = {}
    split = {"valid_fraction": config.valid_fraction, "seed": config.seed}
    if config.weights is not None:
        read = {
            "text_field": config.text_field,
            "split": config.document_split,
            "max_bytes": config.max_bytes,
            "strict": config.strict,
        }
        result, extra["mixture"] = write_mixture_shards(
            config.sources,
            config.weights,
            tokenizer,
            tmp,
            read=read,
            stats=source_stats,
            shard_tokens=config.shard_tokens,
            progress=progress,
            **split,
        )
    else:
        result = write_token_shards(
            _documents(config, source_stats),
            tokenizer,
            tmp,
            shard_tokens=config.shard_tokens,
            progress=progress,
            **split,
        )
    return _check_written(config, result), extra


def _check_written(config: DataConfig, result: WriteResult, stacklevel: int = 4) -> WriteResult:
    """Refuse an empty corpus or one with no training tokens, and warn (at ``prepare_data``'s
    caller, ``stacklevel`` frames up) when no document fell into the validation split."""
    if result.documents == 0:
        raise _empty_corpus(config, "no documents")
    if result.train_tokens == 0:
        raise _empty_corpus(
            config,
            f"all {result.documents} document(s) fell into the validation split "
            f"(valid_fraction={config.valid_fraction}); no training tokens",
        )
    if config.valid_fraction > 0 and result.valid_documents == 0:
        warnings.warn(
            f"no document of the {result.documents} in sources {list(config.sources)} fell "
            f"into the validation split (valid_fraction={config.valid_fraction}); "
            "the valid shard set is empty",
            stacklevel=stacklevel,
        )
    return result


def _data_stats(
    result: WriteResult,
    source_stats: SourceStats,
    source_fingerprint: str,
    tokenizer: Tokenizer,
    started: float,
) -> DataStats:
    """What the preparation read (``source_stats``) and wrote (``result``), timed from
    ``started``."""
    return DataStats(
        documents=result.documents,
        train_documents=result.train_documents,
        valid_documents=result.valid_documents,
        tokens=result.train_tokens + result.valid_tokens,
        train_tokens=result.train_tokens,
        valid_tokens=result.valid_tokens,
        text_bytes=result.text_bytes,
        files=source_stats.files,
        replaced_files=source_stats.replaced_files,
        replaced_documents=source_stats.replaced_documents,
        replaced_bytes=source_stats.replaced_bytes,
        binary_files=source_stats.binary_files,
        binary_documents=source_stats.binary_documents,
        binary_bytes=source_stats.binary_bytes,
        truncated=source_stats.truncated,
        fingerprint=_hash([result.train.fingerprint, result.valid.fingerprint]),
        source_fingerprint=source_fingerprint,
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        seconds=round(time.perf_counter() - started, 3),
    )


def _prepare_token_files(config: DataConfig, progress: bool) -> PreparedData:
    """Token files other tools wrote (``megatron:``, ``datatrove:``), read in place and split
    by :func:`~diffattn.data.external_prepare.prepare_token_files`."""
    prepared = prepare_token_files(config, progress)
    return PreparedData(
        config=config,
        tokenizer=prepared.tokenizer,
        train=prepared.train,  # type: ignore[arg-type]  # reads like a ShardSet
        valid=prepared.valid,  # type: ignore[arg-type]
        stats=DataStats(**prepared.stats),
        directory=prepared.directory,
        cached=prepared.cached,
    )


def load_prepared_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer saved beside a preparation (HF/BPE tokenizers; tiktoken by its spec)."""
    directory = Path(directory)
    saved = directory / "tokenizer"
    if saved.is_dir():
        return load_hf_tokenizer(saved)
    return load_tokenizer(read_json(directory / PREPARED)["config"]["tokenizer"])
