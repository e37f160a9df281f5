"""datatrove tokenized output (``*.ds`` with ``*.ds.index`` and ``*.ds.metadata``) opened as
token files.

The layout is the one ``datatrove.pipeline.tokens.tokenizer.TokenizedFile`` writes (the
``DocumentTokenizer`` step and the merger) and ``datatrove.utils.dataset.DatatroveFileDataset``
reads:

* ``NAME.ds``: the documents' tokens back to back, no header; little-endian ``uint16`` (struct
  ``"H"``) or, for tokenizers with more than 65,536 ids, ``uint32`` (``"I"``);
* ``NAME.ds.index``: each document's end offset in tokens (``uint64``, cumulative, the last one
  the file's token count);
* ``NAME.ds.metadata`` (written by default): text lines ``TOKENIZER|TOKEN_BYTES``, the token
  count, a humanised count;
* ``NAME.ds.loss`` (optional loss masks): not read.

A folder is read as ``DatatroveFolderDataset`` reads one: every ``*.ds`` below it, here in
sorted order of the relative path (hidden files and folders skipped).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class DatatroveMetadata:
    """What ``NAME.ds.metadata`` says."""

    tokenizer: str | None
    """The ``tokenizer_name_or_path`` datatrove tokenised with; ``None`` when it wrote
    ``Unknown Tokenizer``."""
    token_bytes: int | None
    """2 or 4; ``None`` from datatrove before 0.3, which wrote no width (and only 2-byte
    tokens)."""
    tokens: int


def datatrove_token_files(folder: str) -> list[Path]:
    """The ``*.ds`` files of ``folder`` (or the one file it names), sorted by relative path;
    ``ValueError`` when there is none."""
    root = Path(os.path.expanduser(folder))
    if root.is_file() and root.name.endswith(".ds"):
        return [root]
    if not root.is_dir():
        raise ValueError(f"source 'datatrove:{folder}': no such folder or .ds file")
    found: list[Path] = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(directory, f) for f in filenames if f.endswith(".ds") and f[0] != "."]
    if not found:
        raise ValueError(f"source 'datatrove:{folder}': no *.ds file below {root}")
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def datatrove_files(folder: str) -> list[Path]:
    """Every file of the source that exists: the ``.ds`` files with their index and metadata."""
    files = []
    for path in datatrove_token_files(folder):
        files += [p for p in (path, _index(path), _metadata(path)) if p.is_file()]
    return files


def _index(path: Path) -> Path:
    return path.with_name(path.name + ".index")


def _metadata(path: Path) -> Path:
    return path.with_name(path.name + ".metadata")


def read_datatrove_metadata(path: Path) -> DatatroveMetadata | None:
    """``NAME.ds.metadata`` of the token file ``path``; ``None`` when absent."""
    meta = _metadata(path)
    if not meta.is_file():
        return None
    lines = meta.read_text(encoding="utf-8", errors="replace").splitlines()
    if len(lines) < 2 or not lines[0] or not lines[1].isdigit():
        raise ValueError(
            f"{meta}: not a datatrove metadata file (expected 'TOKENIZER|2' or 'TOKENIZER|4' "
            "and a token count on its first two lines)"
        )
    name, _, width = lines[0].rpartition("|")
    if width not in ("2", "4"):  # datatrove < 0.3: the name alone
        name, width = lines[0], ""
    # "Unknown Tokenizer|2|2" from datatrove 0.3 to 0.5
    tokenizer = None if name.startswith("Unknown Tokenizer") else name
    return DatatroveMetadata(
        tokenizer=tokenizer, token_bytes=int(width) if width else None, tokens=int(lines[1])
    )


def read_datatrove(path: Path) -> tuple[np.dtype, np.ndarray, DatatroveMetadata | None]:
    """``(token dtype, document bounds, metadata)`` of the datatrove token file ``path``.

    The bounds are token offsets (int64, D + 1 entries from 0: document i is
    ``tokens[bounds[i]:bounds[i + 1]]``). The token width comes from the metadata, else from
    the file size over the index's last offset. Checks that the index exists, is whole
    ``uint64`` entries that never decrease, and that ``.ds`` holds exactly its tokens; each
    failure is one ``ValueError`` naming the file (and the entry or byte).
    """
    index = _index(path)
    if not index.is_file():
        raise ValueError(f"{index}: missing (datatrove writes it beside {path.name})")
    size, index_size = path.stat().st_size, index.stat().st_size
    if index_size % 8:
        raise ValueError(f"{index}: {index_size} bytes is not a whole number of uint64 offsets")
    ends = np.fromfile(index, dtype="<u8").astype(np.int64)
    metadata = read_datatrove_metadata(path)
    tokens = int(ends[-1]) if ends.size else 0
    if np.any(ends < 0) or np.any(np.diff(ends) < 0):
        bad = int(np.argmax(np.diff(np.concatenate([[0], ends])) < 0))
        raise ValueError(
            f"{index}: document end {bad} (byte {8 * bad}) lies before the one before it"
        )
    if metadata is not None and metadata.tokens != tokens:
        raise ValueError(
            f"{_metadata(path)}: says {metadata.tokens} tokens, {index.name} ends at {tokens}"
        )
    if metadata is not None and metadata.token_bytes is not None:
        width = metadata.token_bytes
    else:
        width = size // tokens if tokens and size // tokens in (2, 4) else 2
    if size != tokens * width:
        kind = "truncated" if size < tokens * width else "has trailing bytes"
        where = ""
        if size < tokens * width:
            cut = int(np.searchsorted(ends, size // width, side="right"))
            where = f"; document {cut} is cut at byte {size}"
        raise ValueError(
            f"{path}: {kind}: {size} bytes, {index.name} promises {tokens} tokens of "
            f"{width} bytes ({tokens * width}){where}"
        )
    bounds = np.concatenate([np.zeros(1, dtype=np.int64), ends])
    return np.dtype("<u2" if width == 2 else "<u4"), bounds, metadata
