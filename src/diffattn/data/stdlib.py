"""The files of the embedded default corpus: the standard library's own ``.py`` sources.

Every ``*.py`` file below ``sysconfig.get_paths()["stdlib"]``, excluding ``site-packages`` /
``dist-packages``, the test suites (``test``, ``tests``, ``idle_test``), ``__pycache__`` and
hidden directories, in sorted order of the path relative to the stdlib root. The corpus itself
(documents, cap, licence) is described in :mod:`diffattn.data.corpus`; the source spec
``"stdlib"`` of :mod:`diffattn.data.sources` reads these files.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_root() -> Path:
    """The directory of the standard library's pure-Python modules."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def _stdlib_files(root: str) -> tuple[Path, ...]:
    base = Path(root)
    found: list[Path] = []
    for directory, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        found.extend(Path(directory, name) for name in filenames if name.endswith(".py"))
    return tuple(sorted(found, key=lambda p: p.relative_to(base).as_posix()))


def stdlib_files() -> list[Path]:
    """The files of the embedded corpus, in their deterministic order."""
    files = list(_stdlib_files(str(stdlib_root())))
    if not files:
        raise ValueError(
            f"source 'stdlib': no .py files found under {stdlib_root()} "
            "(this Python ships without its standard library sources)"
        )
    return files
