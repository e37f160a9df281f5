"""Every test that needs an optional extra declares it, so it skips (naming the extra) where the
extra is absent instead of failing: the README's own environment (``.[dev]``) and any smaller
one stay green. Checked statically over every test module (``tests/extras.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from extras import (
    MODULE_EXTRAS,
    PACKAGE_EXTRAS,
    VLLM_BRINGS,
    declared_extras,
    missing,
    skip_reason,
)

TESTS = Path(__file__).resolve().parent
HELPER_MODULES = {p.stem for p in TESTS.glob("*.py")} | {"oracle"}


def _extra_of(module: str) -> str | None:
    for prefix, extra in PACKAGE_EXTRAS.items():
        if module == prefix or module.startswith(prefix + "."):
            return extra
    return MODULE_EXTRAS.get(module.split(".")[0])


def _marker_extras(node: ast.AST) -> set[str]:
    """Extras named by ``pytest.mark.extra(...)`` or ``require_extra(...)`` inside ``node``."""
    found = set()
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("extra", "require_extra"):
            found |= {a.value for a in call.args if isinstance(a, ast.Constant)}
    return found


def _imports(tree: ast.Module):
    """``(module, line, enclosing function or class chain, is_importorskip)`` per import."""

    def visit(node, chain):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, chain, False
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                yield child.module, child.lineno, chain, False
                for alias in child.names:  # from diffattn.eval import harness
                    yield f"{child.module}.{alias.name}", child.lineno, chain, False
            elif (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr == "importorskip"
                and child.args
                and isinstance(child.args[0], ast.Constant)
            ):
                yield child.args[0].value, child.lineno, chain, True
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield from visit(child, [*chain, child])
            else:
                yield from visit(child, chain)

    yield from visit(tree, [])


def _module_level_declared(tree: ast.Module) -> tuple[set[str], dict[str, int]]:
    """Extras the module declares for all its tests (``pytestmark``), and the line of the first
    module-level ``require_extra`` naming each (imports at the top must come after it)."""
    marked, skipped_before = set(), {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        ):
            marked |= _marker_extras(stmt.value)
        for call in ast.walk(stmt):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "require_extra":
                for a in call.args:
                    if isinstance(a, ast.Constant):
                        skipped_before.setdefault(a.value, stmt.lineno)
    return marked, skipped_before


def _top_level_extras(path: Path, seen: set[str]) -> set[str]:
    """The extras a helper module needs at import time (its top-level imports, transitively)."""
    if path.stem in seen or not path.is_file():
        return set()
    seen.add(path.stem)
    needs = set()
    for module, _, chain, _ in _imports(ast.parse(path.read_text())):
        if chain:
            continue
        extra = _extra_of(module)
        if extra:
            needs.add(extra)
        elif module.split(".")[0] in HELPER_MODULES:
            needs |= _top_level_extras(TESTS / f"{module.split('.')[0]}.py", seen)
    return needs


def undeclared(path: Path) -> list[str]:
    """What ``path`` imports from an extra without declaring it, one line each."""
    tree = ast.parse(path.read_text())
    marked, skipped_before = _module_level_declared(tree)
    needs_vllm = _requires_vllm(tree)
    problems, reported = [], set()
    for module, line, chain, is_importorskip in _imports(tree):
        root = module.split(".")[0]
        if needs_vllm and root in VLLM_BRINGS:
            continue  # a module that runs only beside vLLM has what vLLM depends on
        if root in HELPER_MODULES and root != path.stem:
            extras = _top_level_extras(TESTS / f"{root}.py", set())
        else:
            extras = {e for e in [_extra_of(module)] if e}
        for extra in sorted(extras):
            if (line, extra) in reported:
                continue
            reported.add((line, extra))
            where = f"{path.name}:{line} {module}"
            if is_importorskip:
                problems.append(
                    f"{where}: pytest.importorskip names the module, not the {extra!r} extra; "
                    f"use pytestmark = require_extra({extra!r}) or @pytest.mark.extra({extra!r})"
                )
                continue
            if not chain:
                if skipped_before.get(extra, line + 1) > line:
                    problems.append(
                        f"{where}: imported at the top without pytestmark = "
                        f"require_extra({extra!r}) above it"
                    )
                continue
            declared = set(marked)
            for node in chain:
                for decorator in getattr(node, "decorator_list", []):
                    declared |= _marker_extras(decorator)
            declared |= _require_calls(chain[-1])
            if extra not in declared:
                problems.append(
                    f"{where}: needs the {extra!r} extra; mark the test "
                    f"@pytest.mark.extra({extra!r}) (or the module: pytestmark = "
                    f"require_extra({extra!r}))"
                )
    return problems


def _requires_vllm(tree: ast.Module) -> bool:
    """Whether the module's ``pytestmark`` holds ``require_vllm()``."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        ):
            for call in ast.walk(stmt.value):
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "require_vllm":
                    return True
    return False


def _require_calls(node: ast.AST) -> set[str]:
    return {
        a.value
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "require_extra"
        for a in call.args
        if isinstance(a, ast.Constant)
    }


TEST_MODULES = sorted(p for p in TESTS.glob("test_*.py"))


@pytest.mark.parametrize("path", TEST_MODULES, ids=lambda p: p.name)
def test_module_declares_the_extras_it_imports(path):
    assert undeclared(path) == []


def test_every_module_extra_is_declared_in_pyproject():
    extras = declared_extras()
    assert set(MODULE_EXTRAS.values()) | set(PACKAGE_EXTRAS.values()) <= set(extras)


def test_the_checker_finds_an_undeclared_import(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import pytest\nimport lm_eval\n\n"
        "def test_a():\n    from transformers import AutoModel\n\n"
        "def test_b():\n    pytest.importorskip('peft')\n"
    )
    problems = undeclared(bad)
    assert len(problems) == 3, problems
    assert "require_extra('lm-eval')" in problems[0]
    assert "'hf' extra" in problems[1]
    assert "importorskip" in problems[2]


def test_the_checker_accepts_declared_imports(tmp_path):
    good = tmp_path / "test_good.py"
    good.write_text(
        "import pytest\nfrom extras import require_extra\n\n"
        "pytestmark = require_extra('lm-eval')\n\nimport lm_eval\n\n"
        "@pytest.mark.extra('hf')\ndef test_a():\n    from transformers import AutoModel\n"
    )
    assert undeclared(good) == []


def test_missing_extras_are_named_and_unknown_ones_refused():
    assert "pip install -e '.[hf]'" in (skip_reason("hf") or "pip install -e '.[hf]'")
    with pytest.raises(ValueError, match="unknown extra 'nope'"):
        missing("nope")


def test_dev_extra_resolves_through_its_self_reference(monkeypatch):
    import extras

    monkeypatch.setattr(
        extras, "version", lambda name: (_ for _ in ()).throw(extras.PackageNotFoundError(name))
    )
    extras.missing.cache_clear()
    try:
        absent = extras.missing("dev")
    finally:
        extras.missing.cache_clear()
    assert any(a.startswith("transformers>=") for a in absent)  # from diffattn[hf,train]
