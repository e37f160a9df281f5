"""docs/extending.md's Python blocks run, in order, in one namespace, and print what the page
says they print."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from diffattn.attention.types import unregister_attention_type

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def test_the_pages_code_runs_and_prints_what_it_says():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 4
    namespace: dict = {"__name__": "extending_doc"}
    try:
        for block in blocks:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block, str(PAGE), "exec"), namespace)
            # every "print(...)  # expected" comment matches what was printed, in order
            said = [c.strip() for c in re.findall(r"print\(.*\)\s+# (.*)", block)]
            printed = out.getvalue().splitlines()
            for expected in said:
                assert expected in printed, (expected, printed)
    finally:
        unregister_attention_type("tempered")


def test_the_packaged_type_is_the_pages_type():
    """tests/toy_attention_type holds the page's module and declaration (one file)."""
    source = (PAGE.parent.parent / "tests/toy_attention_type/toy_attention_type.py").read_text()
    for line in (
        "class TemperedAttention(BaselineAttention):",
        'name = "tempered"',
        "tensor_parallel = False",
        "def extra_parameters(self, config)",
    ):
        assert line in source
