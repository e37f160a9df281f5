"""No function over 80 lines and no file over 700 lines in src/diffattn, outside the kernels.

A function counts from its ``def`` line (decorators excluded) to its last line, docstring
included; a file counts every line. The kernels are exempt: the Triton kernels
(``attention/triton_diff_v1/kernels.py``), whose launch and loop bodies are kept whole for the
compiler, and the C++ sources (not Python).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "diffattn"
KERNELS = {"attention/triton_diff_v1/kernels.py"}
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 700


def _sources() -> list[tuple[str, str]]:
    return [
        (path.relative_to(SRC).as_posix(), path.read_text(encoding="utf-8"))
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).as_posix() not in KERNELS
    ]


def test_no_function_is_over_80_lines():
    long = []
    for name, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_no_file_is_over_700_lines():
    long = [
        f"{name} ({len(text.splitlines())} lines)"
        for name, text in _sources()
        if len(text.splitlines()) > MAX_FILE_LINES
    ]
    assert long == []


def test_the_exempt_kernels_exist():
    assert all((SRC / name).is_file() for name in KERNELS)
