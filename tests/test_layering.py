"""One import direction: each layer of diffattn imports only from the layers below it.

The layers (``docs/architecture.md``), lowest first:

1. core: the model and what it needs to run (config, attention kernels, cache, generation,
   checkpoint files);
2. libraries: data, training, Hugging Face integration, converters, Dex, the capture probe,
   model loading;
3. experiments: the main job, benchmarks, the evaluation suite, the Dex comparison;
4. commands: the command line.

Lazy imports inside functions count too. The package root ``diffattn`` is the public facade and
no module imports names from it (importing a submodule through it, ``from diffattn import dex``,
counts as importing that submodule).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "diffattn"

LAYERS: dict[str, int] = {
    # core
    "diffattn.config": 0,
    "diffattn.presets": 0,
    "diffattn.layers": 0,
    "diffattn.attention": 0,
    "diffattn.model": 0,
    "diffattn.cache": 0,
    "diffattn.generation": 0,
    "diffattn.checkpoint": 0,
    "diffattn.fileio": 0,
    "diffattn.version": 0,
    "diffattn.settings": 0,
    "diffattn.lazy_exports": 0,
    "diffattn.flops": 0,
    "diffattn.hardware": 0,
    # libraries
    "diffattn.data": 1,
    "diffattn.train": 1,
    "diffattn.hf": 1,
    "diffattn.convert": 1,
    "diffattn.dex": 1,
    "diffattn.probe": 1,
    "diffattn.loading": 1,
    "diffattn.recipes": 1,
    "diffattn.serve": 1,
    "diffattn.vllm_plugin": 1,
    # experiments
    "diffattn.compare": 2,
    "diffattn.bench": 2,
    "diffattn.eval": 2,
    "diffattn.scaling": 2,
    "diffattn.dex_compare": 2,
    # commands
    "diffattn.commands": 3,
    "diffattn.cli": 3,
    "diffattn.__main__": 3,
}
NAMES = ("core", "libraries", "experiments", "commands")


def layer_of(module: str) -> int | None:
    """The layer of ``module``: the entry of its longest listed prefix."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
    return None


def module_name(path: Path) -> str:
    relative = path.relative_to(SRC.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether ``name`` is a diffattn module or package (not a name defined in one)."""
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every diffattn import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("diffattn")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("diffattn"):
                continue
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.append((node.lineno, full if is_module(full) else node.module))
    return found


SOURCES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)


def test_every_module_has_a_layer():
    missing = [module_name(p) for p in SOURCES if layer_of(module_name(p)) is None]
    assert not missing, f"modules without a layer in LAYERS: {missing}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down(path: Path):
    source = module_name(path)
    own = layer_of(source)
    upward = []
    for line, target in imported_modules(path):
        if target == "diffattn":
            upward.append(f"line {line}: imports names from the package root 'diffattn'")
            continue
        theirs = layer_of(target)
        if theirs is not None and theirs > own:
            upward.append(
                f"line {line}: {source} ({NAMES[own]}) imports {target} ({NAMES[theirs]})"
            )
    assert not upward, "\n".join(upward)
