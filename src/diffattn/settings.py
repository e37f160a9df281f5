"""One declaration per setting of a command or an experiment.

A setting is a field of the command's (or experiment's) settings dataclass (a
:class:`Settings`), declared once with :func:`setting`: its default, its type (``int``,
``float``, ``str``, ``Path``, ``bool``, ``tuple[X, ...]``, ``X | None``, ``Literal[...]``), its
bounds (``min``/``max``, or ``choices``; a ``Literal`` type gives them), its help text and its
flag (``--max-heads`` for ``max_heads`` unless ``flag`` says otherwise). From that one class
come

1. the command's options (:meth:`Settings.add_arguments`): option strings, ``type``,
   ``nargs``, ``choices``, ``default``, ``metavar`` and ``help`` (where ``{default}`` is
   replaced by the field's default, a tuple written as its items separated by spaces); a
   :func:`nested` setting contributes the options of its own settings class in its place;
2. the settings object from the parsed command line (:meth:`Settings.from_args`);
3. its validation (:meth:`Settings.check`): each bound's own error message, word for word as
   the experiments have always worded it; settings that share one message are checked as one;
4. the keyword form of ``run`` (:meth:`Settings.given`): ``run(models, settings)``, or
   ``run(models, windows=3)`` as before, a misspelt name being the ``TypeError`` Python gives
   (:func:`takes_settings` writes that ``run`` around an experiment's body);
5. the report's settings block (:meth:`Settings.report`, from :func:`dataclasses.asdict`).

Why not jsonargparse (or another library that builds parsers from dataclasses): it would be a
new dependency for a need of about 150 lines, and it writes a command line of its own, while
every flag, default, help text and error message of ``diffattn eval`` must stay as it is
(``tests/test_eval_cli_surface.py`` pins them). Tried with jsonargparse 4.53 on a dataclass
like :class:`~diffattn.eval.effective.EffectiveSettings`: the flags keep the underscores
(``--max_heads``, where ours is ``--max-heads``), each help ends in ``(type: int, default:
2)``, the fields are listed under a ``<class ...>`` heading, a bad value reads ``Parser key
"optimizer": Expected a typing.Literal['adam', 'sgd']. Got value: x`` instead of argparse's
``invalid choice``, and ``--lengths 1 2`` is refused (a tuple is given as ``[1,2]``). Nor does
it know our two conventions: document settings that default to the evaluated run's recipe
(``recipe``), and options that every experiment shares
(:class:`~diffattn.eval.common.CommonOptions`, :func:`shared`).

This module imports nothing of diffattn and not torch: every layer may use it (the eval
experiments, the benchmarks, the commands).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import operator
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

RECIPE_DEFAULTS = "data_defaults"
"""The parser default under which ``diffattn eval`` finds the defaults of the ``recipe``
settings, used when no run's recipe gives them (:func:`diffattn.eval.run_split.resolve`)."""

S = TypeVar("S", bound="Settings")
R = TypeVar("R")
SAME: Any = type("Same", (), {"__repr__": lambda self: "SAME"})()
"""``cli_default`` of a setting whose option defaults to the setting's default."""


@dataclass(frozen=True)
class Spec:
    """What a setting says besides its name, type and default (see :func:`setting`)."""

    help: str | None = None
    flag: str | None = None
    dest: str | None = None
    metavar: str | None = None
    choices: tuple[Any, ...] | Callable[[], Sequence[Any]] | None = None
    min: float | None = None
    max: float | None = None
    error: str | None = None
    max_error: str | None = None
    required: bool = False
    positional: bool = False
    recipe: bool = False
    command_only: bool = False
    report_last: bool = False
    group: str | None = None
    cli_default: Any = SAME
    parse: Callable[[Any], Any] | None = None
    shared: bool = False
    nargs: Any = None
    const: Any = None
    action: str | None = None
    type: Callable[[str], Any] | None = None
    suppress: bool = False
    nested: type[Settings] | None = None


def setting(default: Any = MISSING, **spec: Any) -> Any:
    """A setting with its ``default`` (none: a required one) and what :class:`Spec` names:

    * ``help``: the option's help; ``{default}`` in it is the default.
    * ``flag``: the option string (default ``--`` and the name with dashes); ``dest``: where
      argparse stores it when that is not the name (``--query`` → ``query``).
    * ``min``/``max``: bounds, of each item of a tuple (which must not be empty); ``choices``
      (a ``Literal`` type gives them; a function gives them when the parser is built);
      ``error``: the message when a bound fails or, given with choices, when a value is not
      among them (choices without it are left to argparse);
      ``max_error``: the message when only ``max`` fails. ``{name}`` in a message is the
      value of setting ``name`` (a tuple as a list).
    * ``required``: the command line must give it; ``positional``: an argument, not an option;
      ``metavar``; ``group``: a required group of mutually exclusive options.
    * ``recipe``: a document setting whose option defaults to ``None``, filled by
      ``diffattn eval`` from the evaluated run's recipe, else from this default.
    * ``command_only``: an option of the command that is no setting of ``run`` (not in the
      report's settings block, not taken by ``run``); ``report_last``: at the end of the
      report's settings block, where it has always been.
    * ``cli_default`` and ``parse``: the option's own default and how its value becomes the
      setting (``"all"`` → ``None``), for options whose text is not the value itself; an
      option with ``parse`` that is left out (``None``) gives the setting's default.
    * ``nargs``, ``const``, ``action`` and ``type``: argparse's own, for an option that the
      type alone does not describe (``--compile [MODE]``: ``nargs="?"``, ``const``; a value
      checked by a function of its own: ``type``); each overrides what the type gives.
    * ``suppress``: the option's help is ``argparse.SUPPRESS`` (an option kept working but
      no longer listed).
    """
    return dataclasses.field(default=default, metadata={"setting": Spec(**spec)})


def progress_switch(help: str = "no progress output") -> Any:
    """A ``progress: bool`` setting (default ``True``) whose option is ``--quiet``: stored
    under ``quiet`` on the command line, the setting is its negation."""
    return setting(
        True, flag="--quiet", dest="quiet", cli_default=False, parse=operator.not_, help=help
    )


def nested(options: type[Settings], build: Callable[[Any], Any], default: Callable[[], Any]) -> Any:
    """A setting whose command-line options are those of the settings class ``options``,
    added in its place (field order); parsed, it is ``build(options.from_args(args))``.
    ``default()`` makes its default (a setting that is itself an object of settings, such as
    ``diffattn compare``'s measurements)."""
    return dataclasses.field(
        default_factory=default, metadata={"setting": Spec(nested=options, parse=build)}
    )


def like(source: type[Settings], name: str, default: Any = MISSING, **changes: Any) -> Any:
    """Setting ``name`` of ``source`` declared in another settings class, with another default
    or other :class:`Spec` entries (an experiment's own ``seq_len``, its own bounds)."""
    original = source.__dataclass_fields__[name]
    spec = dataclasses.replace(_spec(original), **changes)
    return dataclasses.field(
        default=original.default if default is MISSING else default,
        metadata={"setting": spec},
    )


def shared(source: type[Settings], name: str, default: Any = MISSING, **changes: Any) -> Any:
    """Setting ``name`` of ``source``, whose option ``source`` adds to the parser (the options
    every experiment shares): read from the parsed command line, not added again."""
    return like(source, name, default, shared=True, **changes)


def _spec(f: dataclasses.Field) -> Spec:
    return f.metadata.get("setting", Spec())


def _shown(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class _Words:
    """A default as help shows it: a tuple as its items separated by spaces."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __format__(self, spec: str) -> str:
        if isinstance(self.value, tuple | list):
            return " ".join(str(v) for v in self.value)
        return format(self.value, spec)


class Settings:
    """The base of an experiment's settings dataclass (``@dataclass(frozen=True)``)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field]]

    # ---- the command line -------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: Any) -> None:
        """Add every setting's option to ``parser``, in field order (see the module's doc)."""
        hints = typing.get_type_hints(cls)
        groups: dict[str, Any] = {}
        recipe: dict[str, Any] = {}
        for f in fields(cls):
            spec = _spec(f)
            if spec.shared:
                continue
            if spec.nested is not None:
                spec.nested.add_arguments(parser)
                continue
            if spec.recipe:
                recipe[f.name] = _shown(f.default)
            target = parser
            if spec.group is not None:
                if spec.group not in groups:
                    groups[spec.group] = parser.add_mutually_exclusive_group(required=True)
                target = groups[spec.group]
            names, options = _option(f, spec, hints[f.name])
            target.add_argument(*names, **options)
        if recipe:
            parser.set_defaults(**{RECIPE_DEFAULTS: recipe})

    @classmethod
    def from_args(cls: type[S], args: argparse.Namespace) -> S:
        """The settings of a parsed command line (``recipe`` settings already filled in)."""
        values = {}
        for f in fields(cls):
            spec = _spec(f)
            if spec.nested is not None:
                values[f.name] = spec.parse(spec.nested.from_args(args))
                continue
            value = getattr(args, spec.dest or f.name)
            if spec.parse is not None:  # an option left out (None) is the setting's default
                value = f.default if value is None else spec.parse(value)
            values[f.name] = value
        return cls(**values)

    # ---- run ---------------------------------------------------------------------------------
    @classmethod
    def given(
        cls: type[S], settings: S | None, changes: Mapping[str, Any], function: str = "run"
    ) -> S:
        """``settings`` (default: every default) with ``changes`` by name, as ``run`` takes
        them; a name that is no setting of ``run`` is Python's ``TypeError``."""
        known = {f.name for f in fields(cls) if not _spec(f).command_only}
        for name in changes:
            if name not in known:
                raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
        if settings is None:
            settings = cls()
        elif not isinstance(settings, cls):
            raise TypeError(
                f"{function}() takes {cls.__name__}, got {type(settings).__name__}: pass the "
                "settings by name"
            )
        return dataclasses.replace(settings, **changes) if changes else settings

    def check(self) -> None:
        """``ValueError`` with the message of the first setting out of its bounds, in field
        order (settings that share a message fail together)."""
        shown = {f.name: _shown(getattr(self, f.name)) for f in fields(self)}
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            spec = _spec(f)
            value = getattr(self, f.name)
            if value is None or (spec.min is None and spec.max is None and spec.error is None):
                continue
            items = list(value) if isinstance(value, tuple | list) else [value]
            choices = _choices(spec) or _literal(hints[f.name])
            if choices is not None:
                if spec.error is not None and (not items or any(v not in choices for v in items)):
                    raise ValueError(spec.error.format(**shown))
                continue
            low = spec.min is not None and (not items or any(v < spec.min for v in items))
            high = spec.max is not None and any(v > spec.max for v in items)
            if high and spec.max_error is not None:
                raise ValueError(spec.max_error.format(**shown))
            if low or high:
                raise ValueError(_message(f.name, spec, low).format(**shown))

    # ---- the report --------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The report's settings block: every setting of ``run``, in field order."""
        values = dataclasses.asdict(self)  # type: ignore[call-overload]
        kept = [f for f in fields(self) if not _spec(f).command_only]
        ordered = [f for f in kept if not _spec(f).report_last]
        ordered += [f for f in kept if _spec(f).report_last]
        return {f.name: values[f.name] for f in ordered}


def takes_settings(
    settings_type: type[S],
) -> Callable[[Callable[[Sequence[Any], S, bool], R]], Callable[..., R]]:
    """The ``run`` of an experiment from its body ``body(models, settings, quiet)``:
    ``run(models, settings=None, *, quiet=True, **changes)`` takes a ``settings_type`` or its
    fields by name (:meth:`Settings.given`), checks it (:meth:`Settings.check`) and calls the
    body. ``inspect.signature(run)`` shows that public signature; ``run.body`` is the body."""

    def decorate(body: Callable[[Sequence[Any], S, bool], R]) -> Callable[..., R]:
        @functools.wraps(body)
        def run(models: Sequence[Any], settings: S | None = None, *, quiet: bool = True, **changes):
            resolved = settings_type.given(settings, changes)
            resolved.check()
            return body(models, resolved, quiet)

        keyword, named = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
        public = inspect.signature(body)
        models, _, _ = public.parameters.values()
        run.__signature__ = public.replace(  # type: ignore[attr-defined]
            parameters=[
                models,
                inspect.Parameter(
                    "settings", named, default=None, annotation=f"{settings_type.__name__} | None"
                ),
                inspect.Parameter("quiet", keyword, default=True, annotation="bool"),
                inspect.Parameter("changes", inspect.Parameter.VAR_KEYWORD, annotation="Any"),
            ]
        )
        run.body = body  # type: ignore[attr-defined]
        return run

    return decorate


def _message(name: str, spec: Spec, low: bool) -> str:
    if spec.error is not None:
        return spec.error
    flag = spec.flag or "--" + name.replace("_", "-")
    if low:
        return f"{flag} must be at least {spec.min:g}, got {{{name}}}"
    return f"{flag} must be at most {spec.max:g}, got {{{name}}}"


def _choices(spec: Spec) -> tuple[Any, ...] | None:
    """A setting's choices; a callable gives them when the parser is built (choices that need
    an import the command line should not pay for until then)."""
    if callable(spec.choices):
        return tuple(spec.choices())
    return spec.choices


def _item_type(hint: Any) -> tuple[Any, bool]:
    """The type of one value of a setting (``X`` of ``X | None`` and of ``tuple[X, ...]``),
    and whether the setting holds several."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _literal(hint: Any) -> tuple[Any, ...] | None:
    kind, _ = _item_type(hint)
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def _option(f: dataclasses.Field, spec: Spec, hint: Any) -> tuple[list[str], dict[str, Any]]:
    """The ``add_argument`` arguments of one setting."""
    flag = spec.flag or ("" if spec.positional else "--") + f.name.replace("_", "-")
    options: dict[str, Any] = {}
    default = f.default if spec.cli_default is SAME else spec.cli_default
    if spec.recipe:
        default = None
    kind, several = _item_type(hint)
    if kind is bool:
        options["action"] = "store_false" if default else "store_true"
    else:
        if spec.parse is None:  # the option's text is the value (or its items)
            if several:
                options["nargs"] = "+"
            if kind in (int, float, Path):
                options["type"] = kind
        choices = _choices(spec) or _literal(hint)
        if choices is not None:
            options["choices"] = choices
        if not spec.required and not spec.positional:
            options["default"] = _shown(default)
    if spec.required:
        options["required"] = True
    if spec.metavar is not None:
        options["metavar"] = spec.metavar
    if spec.help is not None:
        options["help"] = spec.help.format(default=_Words(f.default))
    if spec.suppress:
        options["help"] = argparse.SUPPRESS
    for name in ("nargs", "const", "action", "type"):
        value = getattr(spec, name)
        if value is not None:
            options[name] = value
    if options.get("action") in ("store_true", "store_false", "store_const", "count"):
        options.pop("type", None)
        options.pop("nargs", None)
    if not spec.positional:
        options["dest"] = spec.dest or f.name
    return [flag], options
