"""The embedded default corpus: the Python standard library's own ``.py`` sources.

Every Python installation carries its standard library as source files, so a language model
can be trained with zero downloads. The corpus is:

* every ``*.py`` file below ``sysconfig.get_paths()["stdlib"]``;
* excluding ``site-packages`` / ``dist-packages`` (third-party code), the test suites
  (directories named ``test``, ``tests`` or ``idle_test``), ``__pycache__`` and hidden
  directories;
* one document per file, files in sorted order of their path relative to the stdlib root;
* bytes that are not UTF-8 replaced by U+FFFD and counted (see :mod:`diffattn.data.sources`);
* capped at ``max_bytes`` UTF-8 bytes in total (the last file cut short); 16 MB by default.

On CPython 3.11 this is about 730 files and 12 MB of text. The content depends on the Python
version, so a corpus fingerprint includes ``sys.version``.

Licence: the Python standard library is distributed under the Python Software Foundation
License (PSF License Agreement, version 2), a permissive, GPL-compatible licence. It is used
here as training text; nothing of it is copied into this package.

Use it through the source spec ``"stdlib"`` (the default of :class:`diffattn.data.DataConfig`;
``"stdlib:1000000"`` caps it at 1 MB, ``"stdlib:all"`` lifts the cap) or directly with
:func:`default_corpus`.
"""

from __future__ import annotations

from collections.abc import Iterator

from diffattn.data.sources import STDLIB_DEFAULT_BYTES, SourceStats, iter_documents
from diffattn.data.stdlib import EXCLUDED_DIRS, stdlib_files, stdlib_root

DEFAULT_CORPUS_BYTES = STDLIB_DEFAULT_BYTES
"""Default cap of :func:`default_corpus` and of the ``"stdlib"`` source spec (16 MB): all of
the stdlib on current CPythons (~12 MB)."""

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "EXCLUDED_DIRS",
    "default_corpus",
    "stdlib_files",
    "stdlib_root",
]


def default_corpus(
    max_bytes: int | None = DEFAULT_CORPUS_BYTES,
    *,
    stats: SourceStats | None = None,
) -> Iterator[str]:
    """Documents of the embedded corpus (one per stdlib file), capped at ``max_bytes``."""
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
    ):
        raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
    spec = "stdlib:all" if max_bytes is None else f"stdlib:{max_bytes}"
    return iter_documents([spec], stats=stats)
