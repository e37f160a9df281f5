"""Each setting of a command or experiment is declared once (``diffattn/settings.py``).

1. No option is written by hand: every ``add_argument`` call in ``src/diffattn`` is the one in
   ``settings.py``, except :data:`STRUCTURAL`, which are no settings (a version flag, a
   pass-through of another program's arguments, the stand-in of a verb whose extra is missing).
2. No default is declared a second time beside its settings class: a function or dataclass of
   the module that declares a :class:`~diffattn.settings.Settings` class takes no parameter
   (or holds no field) of the same name with a default written as the same value. Such a
   function takes the settings object, every value without a default, or a default named
   once (``HessianSettings.iters``, a module constant).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "diffattn"

STRUCTURAL = {
    ("cli.py", "--version"): "argparse's version action, no setting",
    ("cli.py", "name"): "`diffattn presets [NAME]`: a positional without a default",
    ("commands/lm_eval.py", "harness_args"): "the harness's own arguments, passed through",
    ("commands/extras.py", "arguments"): "a missing extra's stand-in takes any arguments",
    ("commands/generate.py", "*names"): "a mutually exclusive group that may be left out "
    "forwards settings.py's own calls",
}


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(SRC).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(SRC.rglob("*.py"))
    ]


def _first_argument(call: ast.Call) -> str:
    if not call.args:
        return "?"
    first = call.args[0]
    if isinstance(first, ast.Constant):
        return str(first.value)
    if isinstance(first, ast.Starred) and isinstance(first.value, ast.Name):
        return "*" + first.value.id
    return ast.unparse(first)


def test_no_option_is_written_by_hand():
    found = set()
    for name, tree in _modules():
        if name == "settings.py":
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
            ):
                found.add((name, _first_argument(node)))
    assert found - set(STRUCTURAL) == set(), "declare these options in a Settings class"
    assert set(STRUCTURAL) - found == set(), "no longer hand-written: delete from STRUCTURAL"


def _is_settings_class(node: ast.ClassDef) -> bool:
    """A class built on ``Settings`` or on another settings class (``...Settings``,
    ``...Options``)."""
    return any(ast.unparse(b).endswith(("Settings", "Options")) for b in node.bases)


def _settings_defaults(tree: ast.Module) -> dict[str, str]:
    """``field name -> default (source text)`` of the Settings classes of a module."""
    defaults: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not _is_settings_class(node):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            value = item.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "setting" and value.args:
                default = ast.unparse(value.args[0])
                if _literal(value.args[0]) and default not in ("None", "False", "()"):
                    defaults[item.target.id] = default
    return defaults


def _literal(node: ast.expr) -> bool:
    """A default written as a value (``48``, ``"fp32"``, ``(-1,)``); a named constant is one
    declaration wherever it is used."""
    try:
        ast.literal_eval(node)
    except ValueError:
        return False
    return True


def _declared_defaults(tree: ast.Module, inside: set[int]):
    """``(where, name, default)`` of every parameter default and plain dataclass field default
    outside the Settings classes (``inside``: ids of their nodes)."""
    for node in ast.walk(tree):
        if id(node) in inside:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = list(
                zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
            )
            pairs += [
                (a, d)
                for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                if d is not None
            ]
            for arg, default in pairs:
                yield f"{node.name}()", arg.arg, ast.unparse(default)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and item.value is not None
                    and not isinstance(item.value, ast.Call)
                ):
                    yield node.name, item.target.id, ast.unparse(item.value)


def _second_declarations() -> list[str]:
    found = []
    for name, tree in _modules():
        defaults = _settings_defaults(tree)
        if not defaults:
            continue
        inside = {
            id(n)
            for c in tree.body
            if isinstance(c, ast.ClassDef) and _is_settings_class(c)
            for n in ast.walk(c)
        }
        for where, field, default in _declared_defaults(tree, inside):
            if defaults.get(field) == default:
                found.append(f"{name}: {where} declares {field}={default} again")
    return found


def test_no_default_is_declared_twice():
    assert _second_declarations() == []
