"""No import circles between the modules of diffattn.

Every module under ``src/diffattn`` (a package counts as its ``__init__``) is a node; an edge
``a -> b`` is an ``import`` or ``from ... import`` in ``a`` of the diffattn module ``b``, at the
top of the module or inside a function (a lazy import still ties the two modules together), or
an ``importlib.import_module`` / ``__import__`` of a string naming it (an f-string: the package
its fixed start names). ``from pkg import name`` points at the submodule ``pkg.name`` when
there is one, else at ``pkg``.
Importing a submodule runs its parent packages' ``__init__`` too, but that is the package
pattern, not a circle: the edge goes to the module named only.

Any strongly connected component of more than one module (Tarjan's algorithm) is a circle: the
test lists each with the import lines that close it. Break one by moving the shared piece to
the lower module or a new small one, or by passing a value in; ``importlib.import_module`` with
a string does not break one (the test sees it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "diffattn"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, source: str) -> str | None:
    """The absolute module of a ``from`` import in ``source`` (relative ones resolved)."""
    if node.level == 0:
        return node.module
    package = source if MODULES[source].name == "__init__.py" else source.rpartition(".")[0]
    parts = package.split(".")
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def _known(name: str) -> str | None:
    """``name`` when it is a diffattn module, else its longest prefix that is one."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(source: str) -> Iterable[tuple[int, str]]:
    """``(line, module)`` for each diffattn module that ``source`` imports, anywhere in it."""
    tree = ast.parse(MODULES[source].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name)
                if target is not None:
                    yield node.lineno, target
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, source)
            if not module or _known(module) is None:
                continue
            for alias in node.names:
                full = f"{module}.{alias.name}"
                yield node.lineno, full if full in MODULES else _known(module)
        elif isinstance(node, ast.Call) and _imports_by_name(node.func) and node.args:
            target = _named_module(node.args[0])
            if target is not None:
                yield node.lineno, target


def _imports_by_name(func: ast.expr) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def _named_module(argument: ast.expr) -> str | None:
    """The diffattn module a string names (an f-string: the package its fixed start names)."""
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        return _known(argument.value)
    if isinstance(argument, ast.JoinedStr) and argument.values:
        first = argument.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return _known(first.value.rpartition(".")[0])
    return None


def import_graph() -> dict[str, dict[str, list[int]]]:
    """``{module: {imported module: [lines]}}`` over every diffattn module."""
    graph: dict[str, dict[str, list[int]]] = {name: {} for name in MODULES}
    for source in MODULES:
        for line, target in imports(source):
            if target != source:
                graph[source].setdefault(target, []).append(line)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def describe(component: list[str], graph: dict[str, dict[str, list[int]]]) -> str:
    members = set(component)
    lines = [f"circle of {len(component)} modules: {', '.join(component)}"]
    for source in component:
        for target, at in sorted(graph[source].items()):
            if target in members:
                where = ", ".join(str(n) for n in sorted(set(at)))
                lines.append(f"  {source} imports {target} (line {where})")
    return "\n".join(lines)


def test_the_graph_sees_lazy_imports_and_submodules():
    """The graph's edges: a function-level import counts, ``from pkg import submodule`` is the
    submodule, ``from pkg import name`` is the package."""
    graph = import_graph()
    assert "diffattn.model" in graph["diffattn.cli"]  # inside _presets_command
    assert "diffattn.presets" in graph["diffattn.cli"]  # from diffattn import presets
    assert "diffattn.hf" in graph["diffattn.hf.autoregister"]  # from diffattn.hf import ...
    assert "diffattn" not in graph["diffattn.cli"]
    assert "diffattn.commands" in graph["diffattn.cli"]  # import_module(f"diffattn.commands.")


def test_strongly_connected_components_find_every_circle():
    graph = {
        "a": {"b": [1]},
        "b": {"c": [1]},
        "c": {"a": [1], "d": [2]},
        "d": {},
        "e": {"f": [1]},
        "f": {"e": [1]},
    }
    found = sorted(c for c in strongly_connected(graph) if len(c) > 1)
    assert found == [["a", "b", "c"], ["e", "f"]]


def test_no_import_circles():
    graph = import_graph()
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not circles, "\n".join(describe(c, graph) for c in sorted(circles))
