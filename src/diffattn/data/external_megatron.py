"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) opened as token files.

The layout is the one ``megatron.core.datasets.indexed_dataset`` writes
(``IndexedDatasetBuilder`` / ``_IndexWriter.write``) and reads (``_IndexReader``):

``PREFIX.idx``, little-endian:

=========================  ==============================================================
bytes                      content
=========================  ==============================================================
0-8                        magic ``b"MMIDIDX\\x00\\x00"``
9-16                       version (u64, 1)
17                         token dtype code (u8: 1 uint8, 2 int8, 3 int16, 4 int32,
                           5 int64, 8 uint16; 6/7 are floats)
18-25                      S, the number of sequences (u64)
26-33                      D + 1, the number of document indices (u64)
34-...                     sequence lengths (int32 × S), sequence byte pointers into
                           ``.bin`` (int64 × S), document indices (int64 × (D + 1): the
                           sequence index where each document starts, from 0, ending at S),
                           then a sequence mode per sequence (int8 × S) in multimodal files
=========================  ==============================================================

``PREFIX.bin``: the sequences' tokens back to back, nothing else. A document is the sequences
``document_indices[i] … document_indices[i + 1] − 1`` (one sequence per document unless the
corpus was prepared with ``--split-sentences``).
"""

from __future__ import annotations

import glob
import os
import struct
from pathlib import Path

import numpy as np

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<9sQBQQ")
TOKEN_DTYPES = {1: "<u1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2", 2: "<i1"}
"""Megatron's integer dtype codes (``DType``) and the numpy types they name."""


def _bad(path: Path, message: str) -> ValueError:
    return ValueError(f"{path}: corrupt Megatron index: {message}")


def megatron_prefixes(prefix: str) -> list[str]:
    """The dataset prefixes ``prefix`` names: itself when ``PREFIX.idx`` or ``PREFIX.bin``
    exists, else the sorted matches of the glob ``PREFIX.idx``; ``ValueError`` for none."""
    expanded = os.path.expanduser(prefix)
    if os.path.exists(expanded + ".idx") or os.path.exists(expanded + ".bin"):
        return [expanded]
    if any(char in expanded for char in "*?["):
        found = sorted(path[: -len(".idx")] for path in glob.glob(expanded + ".idx"))
        if found:
            return found
        raise ValueError(f"source 'megatron:{prefix}': the glob {prefix}.idx matches no file")
    raise ValueError(f"source 'megatron:{prefix}': no {prefix}.idx or {prefix}.bin")


def megatron_files(prefix: str) -> list[Path]:
    """The ``.idx`` and ``.bin`` files of every dataset ``prefix`` names; ``ValueError``
    naming a missing one."""
    files = []
    for found in megatron_prefixes(prefix):
        idx, bin_path = Path(found + ".idx"), Path(found + ".bin")
        for path in (idx, bin_path):
            if not path.is_file():
                raise ValueError(f"{path}: missing (a Megatron dataset is {idx} and {bin_path})")
        files += [idx, bin_path]
    return files


def _read_header(idx: Path) -> tuple[np.dtype, int, int]:
    """``(token dtype, sequences, document indices)`` of ``idx``; ``ValueError`` naming it."""
    size = idx.stat().st_size
    if size < _HEAD.size:
        raise _bad(idx, f"truncated: {size} bytes, the header alone has {_HEAD.size}")
    with open(idx, "rb") as handle:
        magic, version, code, sequences, indices = _HEAD.unpack(handle.read(_HEAD.size))
    if magic != MEGATRON_MAGIC:
        raise _bad(idx, f"byte 0: bad magic {magic!r} (expected {MEGATRON_MAGIC!r})")
    if version != 1:
        raise _bad(idx, f"byte 9: version {version}, this reader knows 1")
    if code not in TOKEN_DTYPES:
        raise _bad(idx, f"byte 17: dtype code {code} is not an integer token type")
    if indices < 1:
        raise _bad(idx, "byte 26: no document indices")
    body = 12 * sequences + 8 * indices
    if size not in (_HEAD.size + body, _HEAD.size + body + sequences):
        kind = "truncated" if size < _HEAD.size + body else "has trailing bytes"
        raise _bad(
            idx,
            f"{kind}: {size} bytes, {sequences} sequences and {indices} document indices "
            f"need {_HEAD.size + body} (or {_HEAD.size + body + sequences} with modes)",
        )
    return np.dtype(TOKEN_DTYPES[code]), int(sequences), int(indices)


def read_megatron(prefix: str) -> tuple[Path, np.dtype, np.ndarray]:
    """``(bin path, token dtype, document bounds)`` of the dataset at ``prefix``.

    The bounds are token offsets into ``.bin`` (int64, D + 1 entries: document i is
    ``tokens[bounds[i]:bounds[i + 1]]``). Checks the header, the index's size, that the
    sequence pointers lie back to back from byte 0, that the document indices rise from 0 to
    S, and that ``.bin`` holds exactly the tokens the index promises; each failure is one
    ``ValueError`` naming the file (and the byte or entry).
    """
    idx, bin_path = megatron_files(prefix)
    dtype, sequences, indices = _read_header(idx)
    index = np.memmap(idx, dtype=np.uint8, mode="r")
    start = _HEAD.size
    lengths = np.frombuffer(index, dtype="<i4", count=sequences, offset=start)
    pointers = np.frombuffer(index, dtype="<i8", count=sequences, offset=start + 4 * sequences)
    documents = np.frombuffer(index, dtype="<i8", count=indices, offset=start + 12 * sequences)
    if sequences and lengths.min() < 0:
        bad = int(np.argmin(lengths))
        raise _bad(idx, f"sequence {bad} has length {int(lengths[bad])}")
    token_starts = np.zeros(sequences + 1, dtype=np.int64)
    np.cumsum(lengths, out=token_starts[1:])
    expected = token_starts[:-1] * dtype.itemsize
    if not np.array_equal(pointers, expected):
        bad = int(np.argmax(pointers != expected))
        raise _bad(
            idx,
            f"sequence {bad} starts at byte {int(pointers[bad])} of {bin_path.name}, "
            f"the lengths before it end at byte {int(expected[bad])}",
        )
    if documents[0] != 0 or documents[-1] != sequences or np.any(np.diff(documents) < 0):
        raise _bad(idx, f"the document indices do not rise from 0 to {sequences} sequences")
    bounds = token_starts[documents]
    promised = int(token_starts[-1]) * dtype.itemsize
    size = bin_path.stat().st_size
    if size != promised:
        where = ""
        if size < promised:
            cut = int(np.searchsorted(bounds, size // dtype.itemsize, side="right")) - 1
            where = f"; document {cut} is cut at byte {size}"
        raise ValueError(
            f"{bin_path}: {'truncated' if size < promised else 'has trailing bytes'}: {size} "
            f"bytes, {idx.name} promises {promised} ({int(token_starts[-1])} tokens of "
            f"{dtype.itemsize} bytes){where}"
        )
    return bin_path, dtype, bounds
