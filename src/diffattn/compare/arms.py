"""The arms of ``diffattn compare`` and ``diffattn scaling``: a registered attention type, or an
ablation of one.

An arm is spelled ``TYPE`` or ``TYPE:option=value,...``, e.g. ``baseline``, ``gda:ratio=3`` or
``diff_v1:lambda_init=0.8``. An option is one of the type's declared options
(:attr:`~diffattn.attention.types.AttentionType.options`, kept in
``ModelConfig.attention_options[TYPE]``, its value read by
:meth:`~diffattn.attention.types.TypeOption.parse`) or one of the flat ``ModelConfig`` fields the
type reads (:attr:`~diffattn.attention.types.AttentionType.config_fields`, its value read as the
field's type). Anything else is one error naming the arm and its valid options.

Every arm of a comparison is trained at the baseline's parameter count on the same data: a type
whose declaration says :meth:`~diffattn.attention.types.AttentionType.matches_by_ffn` gets its
SwiGLU narrowed (:func:`diffattn.presets.match_v2_params`), as DIFF V2 always has.

The arm named :data:`REFERENCE` is the one every other arm is compared against (the matched
Transformer of DIFF V1 §3).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

REFERENCE = "baseline"
"""The arm every other arm is compared against: the matched Transformer baseline."""


@dataclass(frozen=True)
class Arm:
    """One arm: its name in reports (the canonical spelling), its attention type and what it
    changes in the model (``options``: the type's declared options; ``fields``: flat
    ``ModelConfig`` fields), each as ``(name, value)`` pairs in the order the type's
    declaration lists them."""

    name: str
    type: str
    options: tuple[tuple[str, Any], ...] = ()
    fields: tuple[tuple[str, Any], ...] = ()

    @property
    def declaration(self):
        """The type's :class:`~diffattn.attention.types.AttentionType`."""
        from diffattn.attention.types import attention_type

        return attention_type(self.type)

    @property
    def changes(self) -> tuple[tuple[str, Any], ...]:
        """Every change the arm makes, options then fields."""
        return self.options + self.fields

    @property
    def title(self) -> str:
        """The name reports print: the declaration's title, with the arm's changes."""
        title = self.declaration.title or self.type
        if not self.changes:
            return title
        return f"{title} ({', '.join(f'{k}={spell(v)}' for k, v in self.changes)})"

    @property
    def directory(self) -> str:
        """The arm's name as a directory name (``diff_v1-lambda_init=0.8``)."""
        return self.name.replace(":", "-").replace(",", "-")

    @property
    def paper_claims(self) -> bool:
        """Whether the papers' claims are judged for this arm: a type that declares them
        (:attr:`~diffattn.attention.types.AttentionType.paper_claims`), unchanged."""
        return bool(self.declaration.paper_claims) and not self.changes

    @property
    def lambda_key(self) -> str | None:
        """The key of the arm's per-layer λ in training records and measurements, or ``None``
        for a type without one."""
        declaration = self.declaration
        return declaration.lambda_key if declaration.lambda_label else None

    def attention_options(self) -> dict[str, dict[str, Any]]:
        """The arm's ``ModelConfig.attention_options`` entry (empty without options)."""
        return {self.type: dict(self.options)} if self.options else {}

    def model_fields(self) -> dict[str, Any]:
        """The ``ModelConfig`` fields the arm sets: its type, its flat fields, its options."""
        out: dict[str, Any] = {"attention": self.type, **dict(self.fields)}
        if self.options:
            out["attention_options"] = self.attention_options()
        return out

    def recipe_overrides(self) -> list[str]:
        """The arm as ``--set`` overrides of a training recipe's ``model:`` section (values
        written as JSON, which the recipe reads back as the same value)."""
        items = [f"model.attention={self.type}"]
        items += [f"model.{key}={json.dumps(value)}" for key, value in self.fields]
        items += [
            f"model.attention_options.{self.type}.{key}={json.dumps(value)}"
            for key, value in self.options
        ]
        return items


def matched_config(arm: Arm, load: Any, overrides: list[str]) -> Any:
    """The training config ``load(overrides)`` gives for ``arm`` (``overrides`` holding
    :meth:`Arm.recipe_overrides`), its model matched to the baseline's parameter count: with
    ``model.match_params`` where the arm's type narrows the FFN
    (``AttentionType.matches_by_ffn``, as DIFF V2). A model the arm cannot build is a
    ``ConfigError`` naming the arm."""
    from diffattn import presets
    from diffattn.train import ConfigError

    try:
        config = load(overrides)
        if presets.ffn_matched_layers(config.model_config()):
            config = load([*overrides, "model.match_params=true"])
        config.model_config()  # validates the model fields for this arm
    except ConfigError as error:
        raise ConfigError(error.key, f"arm {arm.name!r}: {str(error).partition(': ')[2]}") from None
    return config


def spell(value: Any) -> str:
    """A value as an arm spells it: ``true``/``false``, ``none``, numbers and text as such."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def parse_arm(text: str) -> Arm:
    """The :class:`Arm` ``text`` spells (``TYPE`` or ``TYPE:option=value,...``);
    ``ValueError`` naming the arm and what is wrong."""
    from diffattn.attention.types import attention_type, attention_type_names

    spec = str(text).strip()
    type_name, colon, rest = spec.partition(":")
    type_name = type_name.strip()
    if not type_name:
        raise ValueError(f"arm {text!r}: name an attention type before ':'")
    if type_name not in attention_type_names():
        raise ValueError(
            f"arm {text!r}: unknown attention type {type_name!r}; "
            f"choose one of {', '.join(attention_type_names())}"
        )
    declaration = attention_type(type_name)
    items = [item.strip() for item in rest.split(",")] if colon else []
    if colon and not any(items):
        raise ValueError(f"arm {text!r}: give option=value after ':' or drop the ':'")
    declared = {option.name: option for option in declaration.options}
    valid = [*declared, *declaration.config_fields]
    options: list[tuple[str, Any]] = []
    fields: list[tuple[str, Any]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"arm {text!r}: expected option=value, got {item!r}")
        if key in dict(options) or key in dict(fields):
            raise ValueError(f"arm {text!r}: option {key!r} is given twice")
        if key not in valid:
            choices = f"its options are {', '.join(valid)}" if valid else "it takes no options"
            raise ValueError(f"arm {text!r}: {key!r} is no option of {type_name}; {choices}")
        try:
            if key in declared:
                value = declared[key].parse(raw.strip())
                why = declared[key].problem(value)
                if why is not None:
                    raise ValueError(f"option {key!r}: {why}")
                options.append((key, value))
            else:
                fields.append((key, parse_field(key, raw.strip())))
        except ValueError as error:
            raise ValueError(f"arm {text!r}: {error}") from None
    _check_fields(text, fields)
    return _arm(declaration, options, fields)


def _arm(declaration, options: list[tuple[str, Any]], fields: list[tuple[str, Any]]) -> Arm:
    """The arm of ``declaration`` with ``options`` and ``fields``, each in the order the
    declaration lists them, so that one arm has one name however it was spelled."""
    option_order = [option.name for option in declaration.options]
    options = sorted(options, key=lambda item: option_order.index(item[0]))
    fields = sorted(fields, key=lambda item: declaration.config_fields.index(item[0]))
    name = declaration.name
    if options or fields:
        name += ":" + ",".join(f"{k}={spell(v)}" for k, v in (*options, *fields))
    return Arm(name, declaration.name, tuple(options), tuple(fields))


def arm_of_model(config) -> Arm:
    """The arm a single-type ``ModelConfig`` is: its type, its stored options and the type's
    ``config_fields`` that differ from ``ModelConfig``'s defaults (a finished run read back)."""
    from diffattn.config import ModelConfig

    declaration = config.single_type("an arm of diffattn compare or scaling")
    defaults = ModelConfig()
    fields = [
        (key, getattr(config, key))
        for key in declaration.config_fields
        if getattr(config, key) != getattr(defaults, key)
    ]
    options = list((config.attention_options.get(declaration.name) or {}).items())
    return _arm(declaration, options, fields)


def parse_field(name: str, text: str) -> Any:
    """The value ``text`` spells for the ``ModelConfig`` field ``name``, as the field's type
    (``bool``, ``int``, ``float``, ``str``, a ``Literal`` or a union of them); ``ValueError``
    naming the field and the type."""
    from diffattn.config import ModelConfig

    hint = typing.get_type_hints(ModelConfig)[name]
    value = _parse_as(text, hint)
    if value is _NOT:
        raise ValueError(f"option {name!r}: expected {_describe(hint)}, got {text!r}")
    return value


def _check_fields(text: str, fields: list[tuple[str, Any]]) -> None:
    """The checks ``ModelConfig`` makes of the fields' own values (λ_init in (0, 1), ...)."""
    from diffattn.config import ModelConfig

    try:
        ModelConfig(**dict(fields))
    except ValueError as error:
        field, _, why = str(error).removeprefix("ModelConfig.").partition(": ")
        raise ValueError(f"arm {text!r}: option {field!r}: {why}") from None


_NOT = object()


def _parse_as(text: str, hint: Any) -> Any:
    """``text`` as the type ``hint``, or :data:`_NOT`; in a union the numbers come first, so
    ``0.8`` of ``str | float`` is the number."""
    from diffattn.attention.types import TypeOption

    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = sorted(get_args(hint), key=lambda m: m in (str, type(None)))
        for member in members:
            value = _parse_as(text, member)
            if value is not _NOT:
                return value
        return _NOT
    if origin is Literal:
        return text if text in get_args(hint) else _NOT
    if hint is type(None):
        return None if text.lower() in ("none", "null") else _NOT
    if hint in (bool, int, float, str):
        try:
            return TypeOption("value", None, "", kind=hint).parse(text)
        except ValueError:
            return _NOT
    return _NOT


def _describe(hint: Any) -> str:
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(member) for member in get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(map(str, get_args(hint)))
    if hint is type(None):
        return "none"
    return {bool: "true or false", int: "an integer", float: "a number", str: "text"}.get(
        hint, str(hint)
    )


def split_arms(items: Iterable[str]) -> list[str]:
    """The arm spellings in ``items``, each item one arm or a comma-separated list of them
    (``baseline,diff_v1,gda:ratio=3,head_budget=outputs``: a part holding ``=`` but no ``:``
    continues the arm before it)."""
    arms: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if "=" in part and ":" not in part and arms and ":" in arms[-1]:
                arms[-1] += "," + part
            elif part:
                arms.append(part)
    return arms


def parse_arms(items: Iterable[str], flag: str = "--attention") -> tuple[Arm, ...]:
    """Every arm of ``items`` (:func:`split_arms`), each once; ``ValueError`` starting with
    ``flag`` names a bad or repeated arm."""
    arms: list[Arm] = []
    for spelling in split_arms(items):
        try:
            arm = parse_arm(spelling)
        except ValueError as error:
            raise ValueError(f"{flag}: {error}") from None
        if any(arm == other or arm.name == other.name for other in arms):
            raise ValueError(f"{flag}: arm {arm.name!r} appears twice; give each arm once")
        arms.append(arm)
    if not arms:
        raise ValueError(f"{flag}: name at least one attention type")
    return tuple(arms)


def arm_of(name: str) -> Arm | None:
    """The arm an arm name in results spells, or ``None`` when it no longer parses (a type
    not registered in this process)."""
    try:
        return parse_arm(name)
    except ValueError:
        return None


def title_of(name: str) -> str:
    """The report's name for the arm ``name`` (:attr:`Arm.title`), or ``name`` itself."""
    arm = arm_of(name)
    return name if arm is None else arm.title


PALETTE = (
    "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
    "tab:green", "tab:blue", "tab:orange", "tab:gray",
)  # fmt: skip
"""Colours for arms without their declaration's: matplotlib's tab10, in this order."""


def colours(names: Iterable[str]) -> dict[str, str]:
    """A colour for each arm: its declaration's ``colour`` for one arm of each type (the
    unchanged arm where there is one); for the others (ablations, types without a colour, names
    that are no arm) the next :data:`PALETTE` colour no arm uses yet."""
    arms = {name: arm_of(name) for name in names}
    owner: dict[str, str] = {}
    for plain in (True, False):
        for name, arm in arms.items():
            if arm is not None and (not arm.changes) == plain:
                owner.setdefault(arm.type, name)
    out = {
        name: arm.declaration.colour
        for name, arm in arms.items()
        if arm is not None and owner[arm.type] == name and arm.declaration.colour
    }
    free = [c for c in PALETTE if c not in out.values()]
    for index, name in enumerate(n for n in arms if n not in out):
        out[name] = free[index % len(free)] if free else PALETTE[index % len(PALETTE)]
    return {name: out[name] for name in arms}


__all__ = [
    "PALETTE",
    "REFERENCE",
    "Arm",
    "arm_of",
    "arm_of_model",
    "colours",
    "matched_config",
    "parse_arm",
    "parse_arms",
    "spell",
    "split_arms",
    "title_of",
]
