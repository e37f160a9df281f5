"""No code outside an attention type's own module branches on a type's name.

The scan reads every module of ``src/diffattn`` and finds comparisons (``==``, ``!=``, ``in``,
``not in``) and ``match`` cases whose string constants name a registered attention type. The
types' own modules (each declaration's ``module`` and the module that declares it) may; any
other module must ask the declaration (``config.type_of_layer(i)``,
``diffattn.attention.types.attention_type``). None is left anywhere else.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from diffattn.attention.types import attention_type, attention_type_names

SOURCE = Path(__file__).resolve().parents[1] / "src" / "diffattn"


def _type_modules() -> set[Path]:
    """The files that declare a type or define its module."""
    files = set()
    for name in attention_type_names():
        declaration = attention_type(name)
        for obj in (type(declaration), declaration.module):
            path = inspect.getsourcefile(obj)
            if path is not None:
                files.add(Path(path).resolve())
    return files


def _names_in(node: ast.AST, names: set[str]) -> list[str]:
    found = []
    for child in ast.walk(node):
        if isinstance(child, ast.Constant) and child.value in names:
            found.append(child.value)
    return found


def type_name_branches(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """``(line, type name)`` for each comparison or ``match`` case on a type's name."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hits += [(node.lineno, name) for name in _names_in(node, names)]
        elif isinstance(node, ast.match_case):
            hits += [(node.pattern.lineno, name) for name in _names_in(node.pattern, names)]
    return hits


def _branches() -> dict[str, list[tuple[int, str]]]:
    names = set(attention_type_names())
    own = _type_modules()
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        if path.resolve() in own:
            continue
        hits = type_name_branches(ast.parse(path.read_text(encoding="utf-8")), names)
        if hits:
            found[str(path.relative_to(SOURCE))] = hits
    return found


def test_no_module_outside_the_types_branches_on_a_type_name():
    found = _branches()
    assert not found, (
        "branches on an attention type's name outside its module (ask the declaration, "
        "config.type_of_layer(i), instead):\n"
        + "\n".join(
            f"  {path}:{line} {name!r}" for path, hits in found.items() for line, name in hits
        )
    )


def test_the_scan_finds_each_kind_of_branch():
    names = {"diff_v1", "gda"}
    code = (
        "if config.attention == 'diff_v1': pass\n"
        "x = kind in ('gda', 'other')\n"
        "y = 'diff_v1' != name\n"
        "match kind:\n"
        "    case 'gda':\n"
        "        pass\n"
        "z = {'diff_v1': 1}\n"  # a mapping names a type without branching on it
    )
    lines = [line for line, _ in type_name_branches(ast.parse(code), names)]
    assert lines == [1, 2, 3, 5]
