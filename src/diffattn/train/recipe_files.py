"""Reading recipe files: YAML, ``base:`` chains merged (:func:`read_recipe`), ``--set key=value``
overrides (:func:`apply_overrides`), and one-line YAML errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffattn.train.fields import ConfigError

BASE_KEY = "base"


# ----------------------------------------------------------------------------------------
# loading
def yaml_error_text(error: Exception) -> str:
    """A YAML parse error on one line: ``line L, column C: problem (context at line ...)``."""
    mark = getattr(error, "problem_mark", None)
    problem = " ".join(str(getattr(error, "problem", None) or error).split())
    text = problem if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context = getattr(error, "context", None)
    if context:
        context_mark = getattr(error, "context_mark", None)
        where = (
            f" at line {context_mark.line + 1}, column {context_mark.column + 1}"
            if context_mark is not None
            else ""
        )
        text += f" ({' '.join(context.split())}{where})"
    return text


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe at ``path`` as one mapping, its ``base:`` chain merged in.

    ``base: FILE`` names another recipe, by a path relative to this recipe's directory (or an
    absolute one). The base is read the same way (bases chain), then this recipe's mapping is
    merged over it by :func:`merge_recipes`. The result holds no ``base`` key. A cycle, a
    missing base or a ``base`` that is not a file name raises one :class:`ConfigError`
    (key ``base``).
    """
    return _read_with_bases(Path(path), ())


def merge_recipes(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """``child`` over ``base``: where both hold a mapping under a key they merge key by key
    (recursively); anything else in ``child`` (a scalar, a list, a null entry) replaces the
    base's. A section (a top-level mapping of ``base``, such as ``model``) that ``child``
    leaves empty, null as YAML reads a section whose entries are all commented out, changes
    nothing: the base's section stays."""
    out = dict(base)
    for key, value in child.items():
        if value is None and isinstance(out.get(key), dict):
            continue
        out[key] = _merged(out.get(key), value)
    return out


def _merged(base: Any, value: Any) -> Any:
    """``value`` over ``base``: two mappings merge key by key (recursively), anything else in
    ``value`` replaces ``base``."""
    if not (isinstance(value, dict) and isinstance(base, dict)):
        return value
    return {**base, **{key: _merged(base.get(key), item) for key, item in value.items()}}


def _read_with_bases(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """:func:`read_recipe` for ``path`` reached through the recipes of ``chain``."""
    data = _read_recipe_file(path)
    if BASE_KEY not in data:
        return data
    name = data.pop(BASE_KEY)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(BASE_KEY, f"{path}: expected the file name of a recipe, got {name!r}")
    base = path.parent / name
    seen = [*chain, path]
    if any(base.resolve() == earlier.resolve() for earlier in seen):
        cycle = " -> ".join(str(p) for p in [*seen, base])
        raise ConfigError(BASE_KEY, f"the recipes' bases form a cycle: {cycle}")
    if not base.is_file():
        raise ConfigError(BASE_KEY, f"{path} names base: {name}, but {base} does not exist")
    return merge_recipes(_read_with_bases(base, tuple(seen)), data)


def _read_recipe_file(path: Path) -> dict[str, Any]:
    """The YAML mapping of one recipe file, as written (``base`` not resolved)."""
    import yaml

    if not path.is_file():
        raise ConfigError("config", f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError("config", f"{path}: cannot be read ({error})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError("config", f"{path}: not valid YAML, {yaml_error_text(error)}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path}: expected a mapping at the top level")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``data`` with each ``key.sub=value`` applied (value parsed as a YAML scalar)."""
    import copy

    import yaml

    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError("--set", f"expected key.sub=value, got {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as error:
            raise ConfigError(key, f"cannot parse {raw!r} ({yaml_error_text(error)})") from None
        parts = key.split(".")
        if parts[0] == BASE_KEY:
            raise ConfigError(
                BASE_KEY, "is read from the recipe file before overrides; --set cannot change it"
            )
        if len(parts) == 1 and isinstance(out.get(key), dict):
            value = _section_override(key, value, out[key])
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: depth + 1]), "is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _section_override(key: str, value: Any, section: dict[str, Any]) -> Any:
    """``--set SECTION=VALUE`` over the recipe's ``section``: a mapping merges into it as a
    recipe merges over its base; an empty one (null or ``{}``) is refused, since it would
    change nothing where the recipe's entries were meant to go."""
    if value is None or value == {}:
        raise ConfigError(
            key,
            f"is a section; --set {key}={'null' if value is None else '{}'} would change "
            f"nothing (an empty section keeps the recipe's entries); set an entry instead, "
            f"e.g. --set {key}.NAME=VALUE",
        )
    return _merged(section, value)
