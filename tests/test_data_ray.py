"""``diffattn data prepare --engine ray``: the shards, fingerprint and cache key of the local
path at 1, 2 and 3 workers, the same BPE training sample, byte caps cut where the local path
cuts, a resume after ``kill -9``, the progress counts, and bad input (one line, exit code 2,
nothing written).

One local Ray (3 CPUs) serves the whole module; the bad-input tests that need no Ray run
without it (``--engine ray`` without Ray installed is refused with the extra's name). The
``kill -9`` test slows each task with ``DIFFATTN_RAY_TASK_DELAY`` (seconds a task sleeps before
it returns, read by ``diffattn.data.ray_engine``) so that the driver dies with some tasks
committed and some not.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffattn.cli import main
from extras import require_extra

pytestmark = require_extra("train", "parquet")  # and "ray", where Ray runs

import pyarrow as pa
import pyarrow.parquet as pq

from diffattn.data import DataConfig, prepare_data
from diffattn.data.ray_engine import TASK_DELAY_ENV, RayEngine, plan_tasks
from diffattn.data.sources import iter_documents

TASK_BYTES = 6000
WORDS = ["river", "copper", "needle", "tunnel", "dolphin", "garlic", "valley", "rabbit", "ozone"]


@pytest.fixture(scope="module")
def ray_session():
    require_extra("ray")  # skips the tests that run Ray where it is not installed
    import ray

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _text(rng: random.Random, paragraphs: int) -> str:
    return "\n\n".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(paragraphs)
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """Text files (one with invalid UTF-8, one binary), a Parquet file of three row groups,
    a JSON lines file and a cut embedded corpus: the sources of every test here."""
    root = tmp_path_factory.mktemp("ray-corpus")
    rng = random.Random(0)
    texts = root / "texts"
    texts.mkdir()
    for i in range(24):
        (texts / f"t{i:02d}.txt").write_text(_text(rng, rng.randint(1, 8)), encoding="utf-8")
    (texts / "t05b.txt").write_bytes(b"bad \xff\xfe bytes\n\nthen words\n")
    (texts / "t07b.bin").write_bytes(b"\x00\x01binary")
    rows = [_text(rng, 1) for _ in range(60)]
    pq.write_table(pa.table({"text": rows}), root / "rows.parquet", row_group_size=20)
    with open(root / "notes.jsonl", "w", encoding="utf-8") as handle:
        for _ in range(40):
            handle.write(json.dumps({"text": _text(rng, 1)}) + "\n")
    return [str(texts), str(root / "rows.parquet"), str(root / "notes.jsonl"), "stdlib:60000"]


def _flags(corpus: list[str], cache: Path, *more: str) -> list[str]:
    return [
        "data",
        "prepare",
        "--source",
        *corpus,
        "--tokenizer",
        "bpe:320",
        "--document-split",
        "paragraph",
        "--valid-fraction",
        "0.2",
        "--shard-tokens",
        "3000",
        "--cache-dir",
        str(cache),
        "--quiet",
        *more,
    ]


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _entry(cache: Path) -> Path:
    (entry,) = [p for p in (cache / "shards").iterdir() if not p.name.startswith(".")]
    return entry


def _inspected(capsys, entry: Path) -> dict:
    assert main(["data", "inspect", str(entry), "--json", "--samples", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    summary.pop("path")
    return summary


def _shard_bytes(entry: Path) -> dict[str, bytes]:
    return {
        p.relative_to(entry).as_posix(): p.read_bytes()
        for split in ("train", "valid")
        for p in sorted((entry / split).iterdir())
    }


@pytest.fixture(scope="module")
def local(corpus, tmp_path_factory):
    """The local path's preparation of the corpus (``--engine local``), with its summary."""
    cache = tmp_path_factory.mktemp("ray-local") / "cache"
    assert main(_flags(corpus, cache)) == 0
    entry = _entry(cache)
    return entry, _shard_bytes(entry)


def _same_as_local(capsys, local, cache: Path) -> None:
    entry, shards = local
    ray_entry = _entry(cache)
    assert ray_entry.name == entry.name  # the cache key train looks up
    assert _shard_bytes(ray_entry) == shards
    # the BPE learnt from the sample drawn through Ray is the local one
    tokenizer = "tokenizer/tokenizer.json"
    assert (ray_entry / tokenizer).read_bytes() == (entry / tokenizer).read_bytes()
    assert _inspected(capsys, ray_entry) == _inspected(capsys, entry)
    ours = json.loads((ray_entry / "prepared.json").read_text())["stats"]
    theirs = json.loads((entry / "prepared.json").read_text())["stats"]
    ours.pop("seconds"), theirs.pop("seconds")
    assert ours == theirs
    assert theirs["truncated"] and theirs["replaced_documents"] and theirs["binary_documents"]
    assert not list(cache.glob("shards/.*.work"))  # the work directory goes once published


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_same_shards_as_local(ray_session, corpus, local, capsys, tmp_path, workers):
    cache = tmp_path / "cache"
    argv = _flags(corpus, cache, "--engine", "ray", "--workers", str(workers))
    code, out, err = _run(capsys, [*argv, "--task-bytes", str(TASK_BYTES)])
    assert code == 0, err
    assert out.startswith("diffattn data: prepared in")
    _same_as_local(capsys, local, cache)


def test_tasks_follow_files_and_row_groups(corpus):
    config = DataConfig(sources=corpus, document_split="paragraph")
    pieces = [p for task in plan_tasks(config, task_bytes=1) for p in task.pieces]
    assert [p.row_group for p in pieces if p.kind == "row_group"] == [0, 1, 2]
    assert [p.start for p in pieces if p.kind == "row_group"] == [0, 20, 40]
    # a JSON lines file larger than a task: byte ranges of whole lines, one task each
    ranges = [
        p for task in plan_tasks(config, TASK_BYTES) for p in task.pieces if p.kind == "lines"
    ]
    size = Path(corpus[2]).stat().st_size
    assert [p.start for p in ranges] == list(range(0, size, TASK_BYTES)) and len(ranges) > 1
    assert sum(p.size for p in ranges) == size
    assert len(plan_tasks(config, task_bytes=1)) == len(pieces)  # one piece each
    whole = plan_tasks(config, task_bytes=1 << 40)
    # tasks never span two sources; stdlib:60000's files past 60,000 bytes are spare tasks
    assert [(task.source, task.spare) for task in whole] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1)]
    assert sum(piece.size for piece in whole[3].pieces[:-1]) < 60000
    assert sum(piece.size for piece in whole[3].pieces) >= 60000


def test_training_sample_and_byte_cap_as_local(ray_session, corpus):
    """The documents a BPE learns from (and the shards read) pass ``max_bytes`` as the local
    path passes it: cut mid-task, at a character boundary, the rest never read."""
    local_documents = list(iter_documents(corpus, split="paragraph", max_bytes=9000))
    config = DataConfig(sources=corpus, document_split="paragraph", max_bytes=9000)
    engine = RayEngine(workers=2, task_bytes=TASK_BYTES).connect()
    assert list(engine.documents(config)) == local_documents
    assert len(local_documents) < len(list(iter_documents(corpus, split="paragraph")))
    assert sum(len(t.encode()) for t in local_documents) == 9000


def _local_and_ray(settings: dict, tmp_path: Path):
    """``settings`` prepared locally and on Ray (2 workers): the same key and shard files."""
    local = prepare_data(DataConfig(**settings, cache_dir=str(tmp_path / "a")), progress=False)
    engine = RayEngine(workers=2, task_bytes=TASK_BYTES).connect()
    ours = prepare_data(
        DataConfig(**settings, cache_dir=str(tmp_path / "b")), progress=False, engine=engine
    )
    assert ours.directory.name == local.directory.name
    assert _shard_bytes(ours.directory) == _shard_bytes(local.directory)
    return local, ours, engine


def test_byte_cap_shards_and_stats_as_local(ray_session, corpus, tmp_path):
    settings = {"sources": corpus, "document_split": "paragraph", "tokenizer": "bpe:300"}
    settings |= {"max_bytes": 20000, "valid_fraction": 0.3}
    local, ours, engine = _local_and_ray(settings, tmp_path)
    assert {**ours.stats.to_dict(), "seconds": 0} == {**local.stats.to_dict(), "seconds": 0}
    assert local.stats.truncated and local.stats.text_bytes == 20000
    # the progress counts: every task read, every document and byte written
    assert engine.progress["documents"] == local.stats.documents
    assert engine.progress["bytes"] == local.stats.text_bytes
    assert 1 < engine.progress["tasks"] < len(plan_tasks(ours.config, TASK_BYTES))


@pytest.mark.extra("tiktoken")
def test_generated_source_and_tiktoken_as_local(ray_session, corpus, tmp_path):
    """A ``synthetic:`` source (one task, read by a worker) beside files, with a tokenizer
    that is not trained (no sample drawn; the workers load the encoding by name)."""
    settings = {"sources": ["synthetic:recall?docs=40", corpus[0]], "valid_fraction": 0.2}
    settings |= {"tokenizer": "tiktoken:cl100k_base", "shard_tokens": 2000}
    _, ours, _ = _local_and_ray(settings, tmp_path)
    assert plan_tasks(ours.config, TASK_BYTES)[0].pieces[0].kind == "source"


def test_strict_error_is_the_local_one(ray_session, corpus, tmp_path):
    config = {"sources": corpus, "document_split": "paragraph", "strict": True}
    with pytest.raises(ValueError) as local:
        prepare_data(DataConfig(**config, cache_dir=str(tmp_path / "a")), progress=False)
    engine = RayEngine(workers=2, task_bytes=TASK_BYTES).connect()
    with pytest.raises(ValueError) as ours:
        prepare_data(DataConfig(**config, cache_dir=str(tmp_path / "b")), engine=engine)
    assert "t05b.txt: byte 4" in str(local.value)
    assert str(ours.value) == str(local.value)
    assert not (tmp_path / "b" / "shards").exists()


def test_bad_line_in_a_later_range_is_the_local_error(ray_session, tmp_path):
    """A JSON lines file read in byte ranges: the bad line's number is counted from the
    start of the file, as the local reader counts it."""
    lines = [json.dumps({"text": f"line {i} " + "word " * 40}) for i in range(60)]
    lines[47] = '{"text": "cut off'
    path = tmp_path / "notes.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = {"sources": [str(path)], "tokenizer": "bpe:300"}
    with pytest.raises(ValueError) as local:
        prepare_data(DataConfig(**config, cache_dir=str(tmp_path / "a")), progress=False)
    engine = RayEngine(workers=2, task_bytes=TASK_BYTES).connect()
    assert len(plan_tasks(DataConfig(**config), TASK_BYTES)) > 2
    with pytest.raises(ValueError) as ours:
        prepare_data(DataConfig(**config, cache_dir=str(tmp_path / "b")), engine=engine)
    assert f"{path}:48: not valid JSON" in str(local.value)
    assert str(ours.value) == str(local.value)


def test_resume_reads_committed_tasks(ray_session, corpus, local, capsys, tmp_path, monkeypatch):
    """A run whose entry is gone but whose work directory stays (as after a kill) tokenises
    only the tasks missing there."""
    cache = tmp_path / "cache"
    argv = [*_flags(corpus, cache, "--engine", "ray", "--workers", "2")]
    argv += ["--task-bytes", str(TASK_BYTES)]
    with monkeypatch.context() as patched:
        patched.setattr(RayEngine, "published", lambda self, entry: None)
        assert _run(capsys, argv)[0] == 0
    entry = _entry(cache)
    work = cache / "shards" / f".{entry.name}.work"
    done = sorted(work.glob("task-*"))
    shutil.rmtree(entry)
    for path in done[1::2]:
        shutil.rmtree(path)
    kept = len(done[::2])
    engines = []
    original = RayEngine.connect

    def connect(self):
        engines.append(self)
        return original(self)

    monkeypatch.setattr(RayEngine, "connect", connect)
    code, _, err = _run(capsys, [a for a in argv if a != "--quiet"])
    assert code == 0, err
    assert f"resuming: {kept} of " in err
    assert engines[0].progress["resumed"] == kept
    assert engines[0].progress["computed"] == len(done) - kept
    _same_as_local(capsys, local, cache)


def test_kill_9_then_resume(ray_session, corpus, local, capsys, tmp_path):
    cache = tmp_path / "cache"
    # the tokenizer the local path trained (the same: test_same_shards_as_local), so that the
    # slowed tasks are those that tokenise
    shutil.copytree(local[0].parents[1] / "tokenizers", cache / "tokenizers")
    argv = _flags(corpus, cache, "--engine", "ray", "--workers", "1")
    argv += ["--task-bytes", str(TASK_BYTES)]
    env = {**os.environ, TASK_DELAY_ENV: "1", "RAY_ADDRESS": ""}
    process = subprocess.Popen(
        [sys.executable, "-m", "diffattn", *argv],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        while len(list(cache.glob("shards/.*.work/task-*/result.npz"))) < 3:
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "no task committed in time"
            time.sleep(0.2)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the embedded Ray it started
        process.stderr.close()
    assert not list(cache.glob("shards/*/prepared.json"))  # nothing published half-way
    committed = len(list(cache.glob("shards/.*.work/task-*/result.npz")))
    code, _, err = _run(capsys, [a for a in argv if a != "--quiet"])
    assert code == 0, err
    assert f"resuming: {committed} of " in err
    _same_as_local(capsys, local, cache)
    # as on the local path, the killed run's temporary entry stays, never read
    assert len(list(cache.glob("shards/.*.tmp-*"))) == 1


# --------------------------------------------------------------------------------------------
# bad input: one line, exit code 2, nothing written
# --------------------------------------------------------------------------------------------
def _one_error(capsys, argv: list[str], *named: str) -> None:
    code, out, err = _run(capsys, argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for text in named:
        assert text in lines[0], lines[0]


@pytest.mark.extra("ray")
def test_unreachable_address(corpus, capsys, tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    argv = _flags(corpus, tmp_path / "cache", "--engine", "ray", "--address", f"127.0.0.1:{port}")
    _one_error(capsys, argv, f"--address 127.0.0.1:{port}", "no Ray cluster answers there")
    assert time.monotonic() - started < 30
    assert not (tmp_path / "cache").exists()


def test_engine_ray_without_ray(corpus, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    argv = _flags(corpus, tmp_path / "cache", "--engine", "ray")
    _one_error(capsys, argv, "--engine ray", "pip install 'diffattn[ray]'")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "more, named",
    [
        (["--engine", "ray", "--workers", "0"], "--workers must be at least 1, got 0"),
        (["--engine", "ray", "--task-bytes", "0"], "--task-bytes must be at least 1, got 0"),
        (["--workers", "2"], "--workers applies to --engine ray"),
        (["--address", "127.0.0.1:6379"], "--address applies to --engine ray"),
        (
            ["--engine", "ray", "--weight", "1", "1", "1", "1"],
            "mixture weights are prepared by this process alone",
        ),
    ],
)
def test_bad_engine_options(corpus, capsys, tmp_path, more, named):
    _one_error(capsys, _flags(corpus, tmp_path / "cache", *more), named)
    assert not list(tmp_path.glob("cache/shards/*"))


def test_import_diffattn_needs_no_ray():
    code = (
        "import sys; sys.modules['ray'] = None; "
        "import diffattn, diffattn.data.ray_engine, diffattn.commands.data"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
