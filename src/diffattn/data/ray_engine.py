"""``diffattn data prepare --engine ray``: read and tokenise the documents on Ray Data.

The input becomes *tasks*: runs of consecutive files of one source (about ``task_bytes`` of
input each; a Parquet file with several row groups one per group, a larger JSON lines file one
per byte range of whole lines, an ``hf:`` or ``synthetic:`` source one). Ray Data runs them on
``workers`` processes (an embedded local Ray, or the cluster at ``address``); each returns its
documents' ids, UTF-8 sizes, splits and reading counts. The driver commits each result
atomically beside the cache entry (``CACHE/shards/.KEY.work/task-NNNNNN/``) and writes the
shards itself, in input order, with the local path's :class:`~diffattn.data.shards.ShardWriter`:
the shards, fingerprint and cache key are the local path's whatever the number of workers. A
re-run of the same plan (``plan.json``) after a kill reads the committed tasks; the work
directory goes once the entry is published. Byte caps apply as the local path applies them
(:class:`CapWalk`).

Ray is imported lazily (``pip install 'diffattn[ray]'``), so ``import diffattn`` never needs it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from diffattn.data import sources
from diffattn.data.shards import ShardWriter, WriteResult, is_validation_document
from diffattn.data.sources import SourceStats, is_stdlib_spec, stdlib_spec_cap
from diffattn.data.stdlib import stdlib_files
from diffattn.data.synthetic import is_synthetic_spec
from diffattn.data.tokenizers import Tokenizer, encode_batch
from diffattn.fileio import atomic_directory, remove_partial_writes

if TYPE_CHECKING:
    from diffattn.data.prepare import DataConfig

RAY_HINT = "pip install 'diffattn[ray]'"
TASK_DELAY_ENV = "DIFFATTN_RAY_TASK_DELAY"
"""Seconds each task sleeps before it returns (tests kill a run in the middle with it)."""
DEFAULT_TASK_BYTES = 4 << 20
"""Input bytes gathered into one task (a file larger than this is a task of its own)."""
WORK_FORMAT = "diffattn-ray-prepare-work"
RESULT = "result.npz"
SPLIT_NAMES = {False: "train", True: "valid"}
_COUNTERS = ("files", "replaced_documents", "replaced_bytes", "binary_documents", "binary_bytes")


# -- the plan: pieces of input gathered into tasks ----------------------------------------------
@dataclass(frozen=True)
class Piece:
    """One readable part of a source: a whole file, one Parquet row group, or the source."""

    kind: str
    """``file``, ``row_group``, ``lines`` (JSON lines starting in a byte range) or ``source``
    (``hf:``/``synthetic:``, read whole)."""
    name: str
    """The file's path, or the spec of a ``source`` piece."""
    size: int
    split: str = "file"
    row_group: int = 0
    start: int = 0
    """The first row of a ``row_group`` piece, the first byte of a ``lines`` piece."""


@dataclass(frozen=True)
class Task:
    """Consecutive pieces of one source: what one Ray task reads and tokenises."""

    index: int
    source: int
    pieces: tuple[Piece, ...]
    spare: bool = False
    """Past a byte cap by file sizes: likely never read (see :meth:`RayEngine._windows`)."""


def _source_pieces(spec: str, split: str, task_bytes: int) -> list[Piece]:
    if is_stdlib_spec(spec):
        return [Piece("file", str(p), p.stat().st_size) for p in stdlib_files()]
    if is_synthetic_spec(spec) or spec.startswith(sources.HF_PREFIX):
        return [Piece("source", spec, 0)]
    pieces = []
    for path in sources.resolve_files(spec):
        size = path.stat().st_size
        whole = [Piece("file", str(path), size, split)]
        pieces.extend(_row_group_pieces(path) or _line_ranges(path, size, task_bytes) or whole)
    return pieces


def _line_ranges(path: Path, size: int, task_bytes: int) -> list[Piece]:
    """A JSON lines file (not gzipped) larger than ``task_bytes`` in ranges of that size."""
    if not path.name.lower().endswith(".jsonl") or size <= task_bytes:
        return []
    ends = range(0, size, task_bytes)
    return [Piece("lines", str(path), min(task_bytes, size - at), start=at) for at in ends]


def _row_group_pieces(path: Path) -> list[Piece]:
    """One piece per row group of a Parquet file with more than one, else none."""
    if not path.name.lower().endswith(".parquet"):
        return []
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    if metadata.num_row_groups < 2:
        return []
    pieces, first = [], 0
    for group in range(metadata.num_row_groups):
        info = metadata.row_group(group)
        pieces.append(Piece("row_group", str(path), info.total_byte_size, "file", group, first))
        first += info.num_rows
    return pieces


def plan_tasks(config: DataConfig, task_bytes: int = DEFAULT_TASK_BYTES) -> list[Task]:
    """The tasks of ``config``'s sources in input order: consecutive pieces of one source
    until ``task_bytes`` of input; the pieces that start past a byte cap (``stdlib:N``,
    ``max_bytes``) by file size are tasks of their own, ``spare``."""
    tasks: list[Task] = []
    total = 0
    for source, spec in enumerate(config.sources):
        cap = stdlib_spec_cap(spec) if is_stdlib_spec(spec) else None
        run: list[Piece] = []
        used = spare = 0
        for piece in _source_pieces(spec, config.document_split, task_bytes):
            past = (cap is not None and used >= cap) or (
                config.max_bytes is not None and total >= config.max_bytes
            )
            if run and (past != spare or sum(p.size for p in run) + piece.size > task_bytes):
                tasks.append(Task(len(tasks), source, tuple(run), bool(spare)))
                run = []
            run.append(piece)
            spare, used, total = past, used + piece.size, total + piece.size
        if run:
            tasks.append(Task(len(tasks), source, tuple(run), bool(spare)))
    return tasks


# -- reading one task (on a worker, or on the driver for the task a cap cuts) -------------------
@dataclass
class TaskStats:
    """Reading statistics of a task, per piece, so that files split over pieces (row groups)
    count once however the pieces fall into tasks."""

    pieces: list[tuple[str, SourceStats]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: 0 for name in _COUNTERS}
        replaced, binary = set(), set()
        for key, stats in self.pieces:
            for name in _COUNTERS:
                out[name] += getattr(stats, name)
            if stats.replaced_files:
                replaced.add(key)
            if stats.binary_files:
                binary.add(key)
        return {**out, "replaced_keys": sorted(replaced), "binary_keys": sorted(binary)}


def _read_row_group(
    piece: Piece, text_field: str, stats: SourceStats, strict: bool
) -> Iterator[str]:
    """The documents of one Parquet row group, as ``read_parquet_file`` reads them."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(piece.name)
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise ValueError(
            f"{piece.name}: no column {text_field!r} (columns: {columns}); "
            "set text_field to the column that holds the text"
        )
    emit = sources._Emitter(stats, strict)
    stats.files += piece.start == 0  # the file counts once, at its first row group
    row = piece.start - 1
    holds = f"{piece.name}: column {text_field!r} holds"
    for batch in parquet.iter_batches(row_groups=[piece.row_group], columns=[text_field]):
        for value in batch.column(0).to_pylist():
            row += 1
            document = emit.row(value, f"{piece.name}: row {row}", holds)
            if document is not None:
                yield document


def _read_line_range(
    piece: Piece, text_field: str, stats: SourceStats, strict: bool
) -> Iterator[str]:
    """The documents of the JSON lines that start in ``piece``'s byte range, read as
    ``read_jsonl_file`` reads the file (from a copy of the range). Its first error is the first
    of the file (the ranges before were read), raised as the whole file's reading raises it."""
    with open(piece.name, "rb") as handle, tempfile.NamedTemporaryFile(suffix=".jsonl") as copy:
        if piece.start:
            handle.seek(piece.start - 1)
            handle.readline()  # the end of the line before the range
        while handle.tell() < piece.start + piece.size and (line := handle.readline()):
            copy.write(line)
        copy.flush()
        stats.files -= piece.start > 0  # the file counts once, at its first range
        read = {"text_field": text_field, "strict": strict}
        try:
            yield from sources.read_jsonl_file(copy.name, stats=stats, **read)
        except ValueError:
            for _ in sources.read_jsonl_file(piece.name, **read):
                pass
            raise


def task_documents(task: Task, spec: str, config: DataConfig, stats: TaskStats) -> Iterator[str]:
    """The documents of ``task`` in order (before any byte cap), counted into ``stats``."""
    text_field, strict = config.text_field, config.strict
    for piece in task.pieces:
        read = {"stats": SourceStats(), "strict": strict}
        stats.pieces.append((f"{task.source}:{piece.name}", read["stats"]))
        if piece.kind in ("row_group", "lines"):
            reader = _read_row_group if piece.kind == "row_group" else _read_line_range
            yield from reader(piece, text_field, read["stats"], strict)
        elif piece.kind == "source":
            split = config.document_split
            yield from sources.iter_documents([spec], text_field=text_field, split=split, **read)
        elif is_stdlib_spec(spec):
            yield from sources.read_text_file(piece.name, **read)
        else:
            yield from sources.read_file(
                piece.name, text_field=text_field, split=piece.split, **read
            )


def _pack(arrays: dict[str, np.ndarray], summary: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    meta = np.frombuffer(json.dumps(summary).encode("utf-8"), dtype=np.uint8)
    np.savez(buffer, meta=meta, **arrays)
    return buffer.getvalue()


def _unpack(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(io.BytesIO(payload), allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    return arrays, json.loads(arrays.pop("meta").tobytes().decode("utf-8"))


def tokenize_task(task: Task, spec: str, config: DataConfig, tokenizer: Tokenizer) -> bytes:
    """Read and tokenise one task: ids (concatenated), per-document token counts, UTF-8 sizes
    and validation flags, and the task's statistics, packed as ``.npz`` bytes."""
    stats = TaskStats()
    texts = list(task_documents(task, spec, config, stats))
    ids = encode_batch(tokenizer, texts) if texts else []
    lengths = np.array([len(row) for row in ids], dtype=np.int64)
    flat = np.concatenate([np.asarray(row, dtype=np.uint32) for row in ids] or [[]])
    flat = flat.astype(np.uint32, copy=False)  # an empty task's too
    split = {"seed": config.seed, "valid_fraction": config.valid_fraction}
    arrays = {
        "ids": flat,
        "lengths": lengths,
        "sizes": np.array([_size(t) for t in texts], dtype=np.int64),
        "valid": np.array([is_validation_document(t, **split) for t in texts], dtype=bool),
    }
    return _pack(arrays, stats.summary())


def read_task(task: Task, spec: str, config: DataConfig) -> bytes:
    """Read one task: its documents' UTF-8 bytes concatenated and their sizes (``.npz``)."""
    texts = [t.encode("utf-8") for t in task_documents(task, spec, config, TaskStats())]
    arrays = {
        "text": np.frombuffer(b"".join(texts), dtype=np.uint8),
        "sizes": np.array([len(t) for t in texts], dtype=np.int64),
    }
    return _pack(arrays, {})


# -- byte caps, applied in input order as iter_documents applies them ---------------------------
class CapWalk:
    """The ``stdlib:N`` source caps and ``max_bytes``, over documents met in input order."""

    def __init__(self, config: DataConfig) -> None:
        self.caps = [stdlib_spec_cap(s) if is_stdlib_spec(s) else None for s in config.sources]
        self.max_bytes = config.max_bytes
        self.used = [0] * len(config.sources)
        self.total = 0
        self.truncated = False
        self.stopped = False
        self.closed: set[int] = set()

    def skips(self, task: Task) -> bool:
        """The cap of ``task``'s source, or ``max_bytes``, is already reached."""
        return self.stopped or task.source in self.closed

    def take_whole(self, source: int, size: int) -> bool:
        """Whether documents of ``size`` bytes together pass both caps uncut (then counted)."""
        cap = self.caps[source]
        if cap is not None and self.used[source] + size > cap:
            return False
        if self.max_bytes is not None and self.total + size > self.max_bytes:
            return False
        self.used[source] += size
        self.total += size
        return True

    def admit(self, source: int, text: str) -> str | None:
        """``text`` as it passes the caps (cut at a character boundary; ``None``: nothing
        left); a cut closes the source (``stdlib:N``) or stops the corpus (``max_bytes``)."""
        size = len(text.encode("utf-8"))
        cap = self.caps[source]
        if cap is not None and self.used[source] + size > cap:
            text = sources._fit_utf8(text, cap - self.used[source])
            self.truncated = True
            self.closed.add(source)
            if not text:
                return None
            size = len(text.encode("utf-8"))
        else:
            self.used[source] += size
        if self.max_bytes is not None and self.total + size > self.max_bytes:
            text = sources._fit_utf8(text, self.max_bytes - self.total)
            self.truncated = self.stopped = True
        self.total += len(text.encode("utf-8"))
        return text or None


def _add_summary(stats: SourceStats, keys: dict[str, set[str]], summary: dict[str, Any]) -> None:
    for name in _COUNTERS:
        setattr(stats, name, getattr(stats, name) + summary[name])
    keys["replaced"].update(summary["replaced_keys"])
    keys["binary"].update(summary["binary_keys"])
    stats.replaced_files = len(keys["replaced"])
    stats.binary_files = len(keys["binary"])


def _documents_here(
    task: Task, config: DataConfig, walk: CapWalk, stats: TaskStats
) -> Iterator[str]:
    """``task``'s documents as they pass the caps, read on the driver document by document
    (the task a cap cuts, or one whose worker failed: its error is raised here, in order)."""
    for text in task_documents(task, config.sources[task.source], config, stats):
        admitted = walk.admit(task.source, text)
        if admitted is not None:
            yield admitted
        if walk.skips(task):
            return


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _document_ids(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each document's ids out of a task's concatenated ``ids``."""
    lengths = arrays["lengths"]
    return np.split(arrays["ids"], np.cumsum(lengths)[:-1]) if lengths.size else []


def _split_texts(arrays: dict[str, np.ndarray]) -> Iterator[str]:
    data, ends = arrays["text"].tobytes(), np.cumsum(arrays["sizes"]).tolist()
    return (data[a:b].decode("utf-8") for a, b in zip([0, *ends][:-1], ends, strict=True))


@dataclass
class _Writing:
    """What the driver carries from task to task while it writes the shards."""

    walk: CapWalk
    writers: dict[bool, ShardWriter]
    stats: SourceStats
    documents: int = 0
    bytes: int = 0
    keys: dict[str, set[str]] = field(default_factory=lambda: {"replaced": set(), "binary": set()})


def _progress_bar(enabled: bool, total: int) -> Any:
    from tqdm import tqdm  # the train extra's, as the local path's bar

    shown = enabled and sys.stderr.isatty()
    return tqdm(total=total, unit="task", desc="tokenising (ray)", disable=not shown)


@contextlib.contextmanager
def _split_writers(out: Path, tokenizer: Tokenizer, shard_tokens: int) -> Iterator[dict]:
    """The train (``False``) and valid (``True``) shard writers under ``out``, their
    unfinished shards dropped when the block fails."""
    common = {"vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    common |= {"tokenizer_name": tokenizer.name, "shard_tokens": shard_tokens}
    writers = {valid: ShardWriter(out / SPLIT_NAMES[valid], **common) for valid in (False, True)}
    try:
        yield writers
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise


# -- the engine ---------------------------------------------------------------------------------
def import_ray() -> Any:
    """The ``ray`` module with Ray Data; without it one ``ValueError`` naming the extra."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise ValueError(f"--engine ray needs Ray Data: {RAY_HINT}") from None
    return ray


def check_reachable(address: str, timeout: float) -> None:
    """``ValueError`` (one line) when nothing answers at ``address`` within ``timeout`` s."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise ValueError(
            f"--address {address}: no Ray cluster answers there ({error.strerror or error}); "
            "start one with `ray start --head`, or leave out --address for an embedded Ray"
        ) from None


class RayEngine:
    """Reads and tokenises on Ray Data (see the module docstring); a
    :class:`~diffattn.data.prepare.PrepareEngine`. :meth:`connect` first (an embedded Ray
    with ``workers`` CPUs, the cluster at ``address``, or the Ray this process already runs),
    :meth:`close` after."""

    def __init__(
        self,
        workers: int | None = None,
        address: str | None = None,
        task_bytes: int = DEFAULT_TASK_BYTES,
        connect_timeout: float = 5.0,
    ) -> None:
        if workers is not None and (isinstance(workers, bool) or workers < 1):
            raise ValueError(f"--workers must be at least 1, got {workers}")
        if task_bytes < 1:
            raise ValueError(f"task_bytes must be positive, got {task_bytes}")
        self.workers = workers
        self.address = address
        self.task_bytes = task_bytes
        self.connect_timeout = connect_timeout
        self.progress: dict[str, int] = {}
        """What the last :meth:`write_shards` counted: tasks written (its progress bar),
        ``resumed`` from the work directory, ``computed`` by Ray, documents and bytes, and
        ``write_ms``, the driver's time unpacking results and writing shards."""
        self._owned = False
        self._ray: Any = None

    def connect(self) -> RayEngine:
        import logging

        ray = import_ray()
        self._ray = ray
        if self.address is not None:
            check_reachable(self.address, self.connect_timeout)
        if ray.is_initialized():
            return self
        quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
        if self.address is not None:
            try:
                ray.init(address=self.address, **quiet)
            except Exception as error:  # Ray raises many kinds: one line
                message = str(error).strip().splitlines()[0] if str(error).strip() else ""
                raise ValueError(f"--address {self.address}: cannot join: {message}") from None
        else:
            cpus = self.workers or os.cpu_count() or 1  # "local": never a cluster found running
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, **quiet)
        self._owned = True
        return self

    def close(self) -> None:
        """Shut down the Ray this engine started (not one it found running)."""
        if self._owned and self._ray is not None:
            self._ray.shutdown()
        self._owned = False

    @property
    def concurrency(self) -> int:
        """Tasks run at once: ``workers``, else the cluster's CPUs."""
        if self.workers is not None:
            return self.workers
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    # -- streaming ----------------------------------------------------------------------
    def _stream(
        self, tasks: list[Task], job: Callable[[Task], bytes]
    ) -> Iterator[tuple[int, bytes | None]]:
        """``(index, payload)`` of each task as Ray finishes it (any order); ``None``: the
        worker raised a ``ValueError`` or ``OSError`` (the driver repeats the task to raise it
        in input order)."""
        import logging

        import ray.data

        logging.getLogger("ray.data").setLevel(logging.ERROR)  # no notes on each dataset
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        # Ray Data holds CPUs back for operators that a one-operator plan does not have
        context.op_resource_reservation_enabled = False
        by_index = {task.index: task for task in tasks}
        delay = float(os.environ.get(TASK_DELAY_ENV) or 0)

        def run(row: dict[str, Any]) -> dict[str, Any]:
            try:
                payload = job(by_index[int(row["task"])])
            except (ValueError, OSError):
                payload = b""
            if delay:
                time.sleep(delay)
            return {"task": row["task"], "payload": payload}

        items = [{"task": task.index} for task in tasks]
        size = min(self.concurrency, len(items))
        pool = getattr(ray.data, "TaskPoolStrategy", None)  # older Ray Data: concurrency=
        limit = {"concurrency": size} if pool is None else {"compute": pool(size=size)}
        dataset = ray.data.from_items(items, override_num_blocks=len(items))
        dataset = dataset.map(run, num_cpus=1, **limit)
        for row in dataset.iter_rows():
            yield int(row["task"]), bytes(row["payload"]) or None

    def _windows(
        self, tasks: list[Task], job: Callable[[Task], bytes], skip: Callable[[Task], bool]
    ) -> Iterator[tuple[int, bytes | None]]:
        """:meth:`_stream` over windows of consecutive tasks, leaving out those ``skip``
        refuses when the window starts. Each window is twice the last of its kind: from two
        per worker, and from one for ``spare`` tasks (never in a window with others), so a
        reader that stops at a byte cap wastes little."""
        sizes, start = {False: 2 * self.concurrency, True: 1}, 0
        while start < len(tasks):
            kind, window = tasks[start].spare, []
            while start < len(tasks) and tasks[start].spare == kind and len(window) < sizes[kind]:
                if not skip(tasks[start]):
                    window.append(tasks[start])
                start += 1
            if window:
                yield from self._stream(window, job)
                sizes[kind] *= 2

    def _ordered(
        self,
        tasks: list[Task],
        job: Callable[[Task], bytes],
        work: Path | None,
        skip: Callable[[Task], bool],
    ) -> Iterator[tuple[Task, bytes | None]]:
        """Each task ``skip`` does not refuse (asked at its turn) with its payload, in input
        order: from ``work`` when a previous run committed it, else from Ray (committed to
        ``work`` as it arrives)."""

        def saved(task: Task) -> Path | None:
            path = None if work is None else work / f"task-{task.index:06d}" / RESULT
            return path if path is not None and path.is_file() else None

        stream = self._windows([task for task in tasks if saved(task) is None], job, skip)
        arrived: dict[int, bytes | None] = {}
        try:
            for task in tasks:
                path = saved(task)
                if skip(task):
                    continue
                if path is not None:
                    yield task, path.read_bytes()
                    continue
                while task.index not in arrived:
                    index, payload = next(stream)
                    self.progress["computed"] = self.progress.get("computed", 0) + 1
                    if work is not None and payload is not None:
                        with atomic_directory(work / f"task-{index:06d}", overwrite=True) as tmp:
                            (tmp / RESULT).write_bytes(payload)
                    arrived[index] = payload
                yield task, arrived.pop(task.index)
        finally:
            stream.close()

    # -- PrepareEngine ------------------------------------------------------------------
    def documents(self, config: DataConfig) -> Iterator[str]:
        """``config``'s documents in input order, read by the workers."""
        walk = CapWalk(config)
        tasks = plan_tasks(config, self.task_bytes)

        def job(task: Task) -> bytes:
            return read_task(task, config.sources[task.source], config)

        for task, payload in self._ordered(tasks, job, None, walk.skips):
            arrays = _unpack(payload)[0] if payload is not None else None
            if arrays is not None and walk.take_whole(task.source, int(arrays["sizes"].sum())):
                yield from _split_texts(arrays)
            else:
                yield from _documents_here(task, config, walk, TaskStats())

    def write_shards(
        self,
        config: DataConfig,
        stats: SourceStats,
        tokenizer: Tokenizer,
        out: Path,
        entry: Path,
        progress: bool,
    ) -> WriteResult:
        """Tokenise on the workers; write ``out``'s train and valid shard sets here, in
        input order (resuming from the work directory beside ``entry``)."""
        tasks = plan_tasks(config, self.task_bytes)
        work = self._work_directory(config, tokenizer, tasks, entry)

        def job(task: Task) -> bytes:
            return tokenize_task(task, config.sources[task.source], config, tokenizer)

        resumed = sum(1 for _ in work.glob(f"task-*/{RESULT}"))
        if resumed and progress:
            notice = f"diffattn data: resuming: {resumed} of {len(tasks)} task(s) done in {work}"
            print(notice, file=sys.stderr, flush=True)
        bar = _progress_bar(progress, len(tasks))
        self.progress = {"tasks": 0, "resumed": resumed, "computed": 0, "documents": 0, "bytes": 0}
        self.progress["write_ms"] = 0
        with _split_writers(out, tokenizer, config.shard_tokens) as writers:
            state = _Writing(CapWalk(config), writers, stats)
            try:
                for task, payload in self._ordered(tasks, job, work, state.walk.skips):
                    started = time.perf_counter()
                    self._write_task(task, payload, config, tokenizer, state)
                    self._advance(bar, state, time.perf_counter() - started)
            finally:
                bar.close()
            train, valid = (writers[split].close() for split in (False, True))
        stats.truncated = state.walk.truncated
        documents = (state.documents, train.num_documents, valid.num_documents)
        return WriteResult(
            train, valid, *documents, train.num_tokens, valid.num_tokens, state.bytes
        )

    def _advance(self, bar: Any, state: _Writing, seconds: float) -> None:
        self.progress.update(
            tasks=self.progress["tasks"] + 1, documents=state.documents, bytes=state.bytes
        )
        self.progress["write_ms"] += round(seconds * 1000)
        bar.set_postfix(documents=state.documents, MB=round(state.bytes / 1e6, 1))
        bar.update(1)

    @staticmethod
    def _write_task(
        task: Task, payload: bytes | None, config: DataConfig, tokenizer: Tokenizer, state: _Writing
    ) -> None:
        """One task's documents into the writers: the worker's ids when the whole task passes
        the caps, else the task read and encoded here."""
        arrays, summary = _unpack(payload) if payload is not None else (None, None)
        worker_ids = _document_ids(arrays) if arrays is not None else []
        writers, size = state.writers, 0 if arrays is None else int(arrays["sizes"].sum())
        if arrays is not None and state.walk.take_whole(task.source, size):
            for ids, valid in zip(worker_ids, arrays["valid"].tolist(), strict=True):
                writers[valid].add(ids)
            state.documents += len(worker_ids)
            state.bytes += size
            _add_summary(state.stats, state.keys, summary)
            return
        # read again here (cheap next to tokenising) to cut where the caps cut; only the cut
        # document (or, when the worker failed, every one) is encoded here
        task_stats = TaskStats()
        texts = list(_documents_here(task, config, state.walk, task_stats))
        sizes = [] if arrays is None else arrays["sizes"].tolist()
        fresh = [i for i, text in enumerate(texts) if i >= len(sizes) or _size(text) != sizes[i]]
        encoded = dict(zip(fresh, encode_batch(tokenizer, [texts[i] for i in fresh]), strict=True))
        split = {"seed": config.seed, "valid_fraction": config.valid_fraction}
        for number, text in enumerate(texts):
            ids = encoded[number] if number in encoded else worker_ids[number]
            writers[is_validation_document(text, **split)].add(ids)
            state.documents += 1
            state.bytes += _size(text)
        _add_summary(state.stats, state.keys, task_stats.summary())

    def _work_directory(
        self, config: DataConfig, tokenizer: Tokenizer, tasks: list[Task], entry: Path
    ) -> Path:
        """``.KEY.work`` beside the cache entry, kept when it holds this plan (a resume),
        else emptied and given it."""
        from diffattn.data.tokenizers import tokenizer_fingerprint

        work = entry.parent / f".{entry.name}.work"
        reading = [config.text_field, config.document_split, config.strict]
        fields = {"format": WORK_FORMAT, "tokenizer": tokenizer_fingerprint(tokenizer)}
        fields |= {"reading": reading, "split": [config.seed, config.valid_fraction]}
        plan = json.dumps({**fields, "tasks": [asdict(task) for task in tasks]}, sort_keys=True)
        plan_file = work / "plan.json"
        if plan_file.is_file() and plan_file.read_text(encoding="utf-8") == plan:
            remove_partial_writes(work)
            return work
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        tmp = work / ".plan.json.tmp"
        tmp.write_text(plan, encoding="utf-8")
        os.replace(tmp, plan_file)
        return work

    def published(self, entry: Path) -> None:
        shutil.rmtree(entry.parent / f".{entry.name}.work", ignore_errors=True)
