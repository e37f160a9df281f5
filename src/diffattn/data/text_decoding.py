"""UTF-8 decoding of source text: invalid bytes replaced and counted, or refused (strict).

:func:`decode_utf8` turns each byte sequence that is not valid UTF-8 into U+FFFD and counts
the bytes it replaced (a codec error handler of its own, so the count is exact); in strict mode
:func:`strict_decode` raises :class:`TextError` naming where the first bad byte is. The readers
of :mod:`diffattn.data.sources` use both.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable

_COUNT_ERRORS = "diffattn-count-replace"
_counter = threading.local()


def _count_and_replace(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeDecodeError):
        raise error
    _counter.value = getattr(_counter, "value", 0) + (error.end - error.start)
    return "\ufffd", error.end


codecs.register_error(_COUNT_ERRORS, _count_and_replace)


def decode_utf8(data: bytes) -> tuple[str, int]:
    """Decode ``data`` as UTF-8, replacing invalid sequences; returns (text, bytes replaced)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    _counter.value = 0
    text = data.decode("utf-8", errors=_COUNT_ERRORS)
    replaced, _counter.value = _counter.value, 0
    return text, replaced


class TextError(ValueError):
    """Strict mode: a source holds binary data or bytes that are not valid UTF-8."""


def strict_decode(data: bytes, where: Callable[[int], str]) -> str:
    """``data`` as UTF-8; invalid bytes raise :class:`TextError` at ``where(offset)``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TextError(
            f"{where(error.start)}: not valid UTF-8 (byte 0x{data[error.start]:02x}); "
            "refused in strict mode (without it, invalid bytes become U+FFFD and are counted)"
        ) from None


def binary_error(where: str) -> TextError:
    return TextError(
        f"{where}: binary data (NUL byte); refused in strict mode "
        "(without it, binary documents are skipped and counted)"
    )


def decode(data: bytes, strict: bool, where: Callable[[int], str]) -> tuple[str, int]:
    if strict:
        return strict_decode(data, where), 0
    return decode_utf8(data)


def clean_text(text: str) -> tuple[str, int]:
    """Replace lone surrogates (possible in JSON escapes) so the text encodes as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        cleaned = text.encode("utf-8", errors="replace").decode("utf-8")
        return cleaned, sum(1 for a, b in zip(text, cleaned, strict=True) if a != b)
    return text, 0
