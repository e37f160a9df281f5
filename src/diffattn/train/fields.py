"""Typed recipe entries: a mapping read into nested dataclasses, each value checked against
its annotation, every problem one :class:`ConfigError` naming the entry's key."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """An invalid training setting. ``key`` is the dotted name of the entry at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


# ----------------------------------------------------------------------------------------
# generic dataclass building
def _require_mapping(data: Any, key: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(key, f"expected a mapping, got {type(data).__name__} {data!r}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(key, f"keys must be strings, got {bad[0]!r}")
    return data


def _build_dataclass(cls: type, data: dict[str, Any], prefix: str) -> Any:
    data = _require_mapping(data, prefix.rstrip(".") or "config")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        section = prefix.rstrip(".") or "the top level"
        raise ConfigError(
            f"{prefix}{unknown[0]}", f"unknown key; valid keys in {section} are {', '.join(names)}"
        )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        hint = hints[name]
        key = prefix + name
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = _build_dataclass(hint, data[name], key + ".")
        else:
            kwargs[name] = _coerce(key, data[name], hint)
    return cls(**kwargs)


def _describe(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(hint))
    if hint is type(None):
        return "null"
    if hint is float:
        return "a number"
    if hint is int:
        return "an integer"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if origin is tuple:
        return f"a list of {len(get_args(hint))} numbers"
    if origin is dict or hint is dict:
        return "a mapping"
    return str(hint)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """``value`` checked against the type ``hint``; a mismatch raises :class:`ConfigError`."""
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(key, f"expected {_describe(hint)}, got {value!r}")
    if origin is Literal:
        if value in get_args(hint) and isinstance(value, str):
            return value
        raise ConfigError(key, f"expected {_describe(hint)}, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                number = None
        else:
            number = None
        if number is not None and not math.isnan(number):
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        items = get_args(hint)
        if isinstance(value, list | tuple) and len(value) == len(items):
            return tuple(
                _coerce(f"{key}[{i}]", v, t)
                for i, (v, t) in enumerate(zip(value, items, strict=True))
            )
    elif origin is dict or hint is dict:
        if isinstance(value, dict):
            return dict(value)
    else:  # pragma: no cover - a field type this module does not know
        raise TypeError(f"unsupported config field type {hint!r} for {key}")
    raise ConfigError(key, f"expected {_describe(hint)}, got {value!r}")
