"""glibc's allocator, set for the worker processes of ``diffattn compare``: freed memory is
kept for the next allocation instead of being handed back to the system and faulted in again.

By default glibc serves every allocation above a moving threshold (128 KiB at first) with a
fresh ``mmap`` and returns it on ``free``; the trimming threshold hands the top of the heap back
as well. A language-modelling run of the default comparison allocates and frees tensors of up
to 16 MiB (its logits: 16 windows × 128 positions × 2048 tokens, fp32) many times per step, so
the system zeroes and maps about 2.5 million pages per run again and again (measured: 7.8 s of
system time per run). With the thresholds below the pages stay mapped and are reused: fewer than
half the page faults and about half the system time, and the same numbers, since only where
the bytes live changes.

The setting holds for the whole process, so it is made only in processes the comparison owns:
its spawned workers and the ``diffattn compare`` command itself, never on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's ``malloc.h``)."""

MMAP_THRESHOLD = 32 * 2**20
"""Allocations up to 32 MiB (glibc's ceiling for this setting on 64-bit systems) come from the
heap, where freed memory is reused."""
TRIM_THRESHOLD = 256 * 2**20
"""Up to 256 MiB of free memory at the top of the heap is kept rather than handed back."""


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (above) for this process; ``True`` when glibc took them, ``False``
    elsewhere (macOS, Windows, musl) where nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no C library found, or one without mallopt (musl)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # the mmap threshold first: setting the trim threshold alone also freezes the mmap
    # threshold at 128 KiB, which maps far more (measured: 2.8 million faults per 50 steps)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
