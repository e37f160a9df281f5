"""Hub remote code: ``modeling_diffattn.py``, generated from this package's own modules.

A model directory written with it loads with ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` on a machine that has transformers and no diffattn. The file cannot
drift from the package because it is not written by hand and not checked in: it is generated
each time a directory is exported (``diffattn convert MODEL OUT --to hub``), from the modules
of the installed package and of the model's attention types:

1. **Which modules.** Those the Hugging Face classes import (``diffattn.hf.configuration``,
   ``diffattn.hf.modeling`` and every attention backend, whose registry finds them by listing
   their package) and the built-in attention types' modules (which the type registry imports
   by name), followed through every ``import`` statement, module level or inside a function
   (:func:`module_closure`), plus the data files of their packages (the CPU kernel's C++
   source). The package root's ``__init__`` is not followed: the vendored root
   (:data:`ROOT_INIT`) gives the same names, imported when first used. A type the model uses
   that another package defines comes along with the modules of its package it imports
   (:mod:`diffattn.hf.remote_types`), under ``<private package>.external``.
2. **Renamed, nothing else changed.** Each module is rewritten through its syntax tree:
   ``diffattn`` becomes a private package name, ``_diffattn_<hash of the sources>`` (and an
   external type's package ``<private>.external.<name>``), in import statements and in strings
   that name one of its submodules (``importlib.import_module`` arguments; the bare string
   ``"diffattn"`` is the model type and stays), and in the name of the entry-point group of
   attention types, so the vendored registry holds exactly the types it carries. The private
   name lets an export of another diffattn version, or diffattn itself, live in the same
   process.
3. **Embedded.** The renamed tree is a deterministic zip, base64 in the generated file. On
   first import the file unpacks it beside itself (HF's module cache; a temporary directory if
   that is read-only), registers the external types it carries (its ``TYPE_DECLARATIONS``)
   and imports its classes from it; Hugging Face's import check reads only the generated
   file, whose own imports are the standard library, torch and transformers.

The classes the file exposes, ``DiffAttnConfig`` and ``DiffAttnForCausalLM``, are subclasses
defined in the file itself, so ``save_pretrained`` of a loaded model copies the file along and
its output loads the same way. The vendored copy registers nothing with the Auto classes, and
records on its package (:data:`SOURCE_ATTRIBUTE`) the file it was unpacked from
(:mod:`diffattn.hf.remote_runtime` says why).
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import zipfile
from pathlib import Path

from diffattn.attention.types import BUILT_IN_MODULES, ENTRY_POINT_GROUP

PACKAGE = "diffattn"
EXTERNAL = "external"
"""The vendored package's subpackage holding the attention types of other packages."""
ROOTS = ("diffattn.hf.configuration", "diffattn.hf.modeling")
ROOT_PACKAGES = ("diffattn.attention.backends",)
MODELING_FILE = "modeling_diffattn.py"
SOURCE_ATTRIBUTE = "MODELING_SOURCE"
"""The vendored package's attribute: the path of the ``modeling_diffattn.py`` it came from."""
AUTO_MAP = {
    "AutoConfig": "modeling_diffattn.DiffAttnConfig",
    "AutoModelForCausalLM": "modeling_diffattn.DiffAttnForCausalLM",
}


def source_root() -> Path:
    """The directory holding the ``diffattn`` package (this file is ``diffattn/hf/...``)."""
    return Path(__file__).resolve().parents[2]


def _module_file(root: Path, name: str) -> Path | None:
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_modules(name: str, tree: ast.AST, root: Path) -> set[str]:
    """The package modules ``tree`` (module ``name``) imports anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != PACKAGE:
                continue
            found.add(node.module)
            for alias in node.names:  # ``from diffattn.attention import backends``
                if _module_file(root, f"{node.module}.{alias.name}") is not None:
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise ValueError(f"{name}: relative imports are not vendored; use absolute ones")
    return found


def module_closure(root: Path | None = None, roots: tuple[str, ...] = ()) -> dict[str, Path]:
    """``{module name: source file}`` of every package module the HF classes, the built-in
    attention types (which the registry imports by name) and the modules ``roots`` can
    import."""
    root = root or source_root()
    todo = [*ROOTS, *BUILT_IN_MODULES, *roots]
    for package in ROOT_PACKAGES:
        directory = _module_file(root, package).parent
        todo += [f"{package}.{p.stem}" for p in sorted(directory.glob("*.py"))]
        todo = [name for name in todo if not name.endswith(".__init__")]
    found: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = _module_file(root, name)
        if path is None:
            raise ValueError(f"{name}: imported by the Hugging Face classes but not found")
        found[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages
        if name == PACKAGE:  # vendored as ROOT_INIT, whose names are imported lazily
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        todo += sorted(_imported_modules(name, tree, root))
    return dict(sorted(found.items()))


def renamed(source: str, modules: set[str], names: dict[str, str], bind: bool = False) -> str:
    """``source`` with each top-level package of ``names`` replaced by its new name in import
    statements and in string constants naming one of ``modules`` (column offsets are UTF-8
    bytes). ``bind``: an ``import NAME`` of such a package keeps binding ``NAME`` (``import
    NEW as NAME``); a dotted one without ``as`` is refused, since it binds the package."""
    tree = ast.parse(source)
    edits: list[tuple[int, int, str, str]] = []  # (line, byte column, old, new)
    lines = [line.encode("utf-8") for line in source.splitlines(keepends=True)]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top in names:
                column = _after_keyword(lines[node.lineno - 1], node.col_offset)
                edits.append((node.lineno, column, top, names[top]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top not in names:
                    continue
                edits.append((alias.lineno, alias.col_offset, top, names[top]))
                if bind and alias.asname is None:
                    if "." in alias.name:
                        raise ValueError(
                            f"line {alias.lineno}: `import {alias.name}` cannot be carried into "
                            f"a Hub export; write `from {alias.name.rpartition('.')[0]} import "
                            f"{alias.name.rpartition('.')[2]}` or `import {alias.name} as NAME`"
                        )
                    edits.append((alias.lineno, alias.end_col_offset, "", f" as {top}"))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in modules
            and "." in node.value  # "diffattn" alone is the model type, not a module
            and node.lineno == node.end_lineno
        ):
            top = node.value.split(".")[0]  # after the opening quote:
            edits.append((node.lineno, node.col_offset + 1, top, names[top]))
    for lineno, col, old, new in sorted(set(edits), reverse=True):
        line = lines[lineno - 1]
        if line[col : col + len(old)] != old.encode():  # pragma: no cover
            raise ValueError(f"line {lineno}: expected {old!r} at column {col}")
        lines[lineno - 1] = line[:col] + new.encode() + line[col + len(old) :]
    return b"".join(lines).decode("utf-8")


def _after_keyword(line: bytes, col: int) -> int:
    """The column of the module name in ``from <module> import`` starting at ``col``."""
    rest = line[col + len(b"from") :]
    return col + len(b"from") + (len(rest) - len(rest.lstrip()))


ROOT_INIT = '''"""diffattn {version}, vendored as Hugging Face remote code (modeling_diffattn.py).

The names of diffattn's package root, each imported from its module when first used."""

import importlib

_EXPORTS = {exports}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {{__name__!r}} has no attribute {{name!r}}")
    return getattr(importlib.import_module(module.replace("{package}", __name__, 1)), name)
'''
"""The vendored package root: not diffattn's ``__init__`` (whose imports are not followed),
but the same names, imported lazily from the vendored modules that define them (an external
attention type's ``from diffattn import AttentionType`` works in the vendored copy too)."""


def _package_files(root: Path, closure: dict[str, Path]) -> dict[str, bytes]:
    """The vendored package's files by relative path: the modules of ``closure``, the data
    files of their packages (the CPU kernel's C++ source) and :data:`ROOT_INIT`."""
    from diffattn.hf.remote_types import facade_exports
    from diffattn.version import __version__

    files: dict[str, bytes] = {}
    for path in closure.values():
        relative = path.relative_to(root / PACKAGE).as_posix()
        files[relative] = path.read_bytes()
        for data in sorted(path.parent.glob("csrc/*")) if path.name == "__init__.py" else ():
            files[data.relative_to(root / PACKAGE).as_posix()] = data.read_bytes()
    exports = {k: v for k, v in sorted(facade_exports(root).items()) if v in closure}
    lines = "".join(f"    {name!r}: {module!r},\n" for name, module in exports.items())
    init = ROOT_INIT.format(version=__version__, exports="{\n" + lines + "}", package=PACKAGE)
    files["__init__.py"] = init.encode()
    return files


def vendored_archive(declarations=()) -> tuple[str, bytes, tuple[str, ...]]:
    """``(private package name, zip bytes, type declarations)`` of the renamed modules and
    their data files, with the sources of the attention types ``declarations`` (those of a
    model) that come from other packages (:mod:`diffattn.hf.remote_types`); the third item
    is the generated file's ``TYPE_DECLARATIONS`` for them."""
    from diffattn.hf.remote_types import external_file_name, type_sources

    root = source_root()
    types = type_sources(declarations, root)
    closure = module_closure(root, types.package_modules)
    files = _package_files(root, closure)
    external = {external_file_name(n, p): p.read_bytes() for n, p in types.external.items()}
    if external:
        files[f"{EXTERNAL}/__init__.py"] = b'"""Attention types of other packages."""\n'
    files.update(external)
    digest = hashlib.sha256()
    for relative in sorted(files):
        digest.update(relative.encode() + b"\0" + files[relative] + b"\0")
    private = f"_diffattn_{digest.hexdigest()[:12]}"
    names = {PACKAGE: private}
    names.update({top: f"{private}.{EXTERNAL}.{top}" for top in types.external_packages})
    modules = {*closure, *types.external, ENTRY_POINT_GROUP}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for relative in sorted(files):
            data = files[relative]
            if relative.endswith(".py") and relative != "__init__.py":
                bind = relative.startswith(EXTERNAL + "/")
                try:
                    data = renamed(data.decode("utf-8"), modules, names, bind).encode("utf-8")
                except ValueError as error:
                    raise ValueError(f"{relative}: {error}") from None
            info = zipfile.ZipInfo(f"{private}/{relative}", date_time=(2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    where = tuple(
        (f"{EXTERNAL}.{module}", attribute, cls) for module, attribute, cls in types.declarations
    )
    return private, buffer.getvalue(), where


_TEMPLATE = '''"""Remote code for a diffattn model (DIFF Transformer V1, V2, or their baseline).

Generated by ``diffattn convert MODEL OUT --to hub`` from diffattn {version}: the package's own
modules, renamed to ``{private}`` and embedded below. Do not edit; export again instead.
Loads with ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``, with or
without diffattn installed.
"""

import base64
import importlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import zipfile

PRIVATE_PACKAGE = "{private}"
TYPE_DECLARATIONS = {declarations}
"""The attention types of other packages that the model uses: (vendored module, the name of
its declaration there or None, the declaration's class, built without arguments if None)."""
ARCHIVE = (
{archive}
)


def _unpacked_at(parent):
    target = os.path.join(parent, PRIVATE_PACKAGE)
    if os.path.isfile(os.path.join(target, "__init__.py")):
        return target
    os.makedirs(parent, exist_ok=True)
    holder = tempfile.mkdtemp(prefix="." + PRIVATE_PACKAGE + ".tmp-", dir=parent)
    try:
        zipfile.ZipFile(io.BytesIO(base64.b64decode("".join(ARCHIVE)))).extractall(holder)
        try:
            os.replace(os.path.join(holder, PRIVATE_PACKAGE), target)
        except OSError:  # another process unpacked it first
            if not os.path.isfile(os.path.join(target, "__init__.py")):
                raise
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return target


def _vendored_package():
    if PRIVATE_PACKAGE in sys.modules:
        return sys.modules[PRIVATE_PACKAGE]
    try:
        target = _unpacked_at(os.path.dirname(os.path.abspath(__file__)))
    except OSError:  # a read-only module cache
        target = _unpacked_at(os.path.join(tempfile.gettempdir(), "diffattn-remote-code"))
    spec = importlib.util.spec_from_file_location(
        PRIVATE_PACKAGE,
        os.path.join(target, "__init__.py"),
        submodule_search_locations=[target],
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_PACKAGE] = package
    spec.loader.exec_module(package)
    package.{source_attribute} = os.path.abspath(__file__)  # what its saves write
    return package


def _register_types():
    types = importlib.import_module(PRIVATE_PACKAGE + ".attention.types")
    for module_name, attribute, class_name in TYPE_DECLARATIONS:
        module = importlib.import_module(PRIVATE_PACKAGE + "." + module_name)
        declaration = getattr(module, attribute) if attribute else getattr(module, class_name)()
        if declaration.name not in types.attention_type_names():
            types.register_attention_type(declaration)


_vendored_package()
_register_types()
_configuration = importlib.import_module(PRIVATE_PACKAGE + ".hf.configuration")
_modeling = importlib.import_module(PRIVATE_PACKAGE + ".hf.modeling")


class DiffAttnConfig(_configuration.DiffAttnConfig):
    """diffattn's ``DiffAttnConfig`` (see its docstring), defined here for the Auto classes."""

    def __init__(self, **kwargs):
        """diffattn's constructor, with every argument. Defined here because transformers
        gives a config subclass without one of its own a constructor that only sets fields."""
        super().__init__(**kwargs)


class DiffAttnForCausalLM(_modeling.DiffAttnForCausalLM):
    """diffattn's ``DiffAttnForCausalLM`` (see its docstring), defined here for the Auto
    classes: ``save_pretrained`` copies this file along with the weights."""

    config_class = DiffAttnConfig
'''


def modeling_file(declarations=()) -> str:
    """The text of ``modeling_diffattn.py`` for the installed package and a model whose
    attention types are ``declarations`` (the sources of those from other packages come
    along: :mod:`diffattn.hf.remote_types`)."""
    from diffattn.version import __version__

    private, archive, where = vendored_archive(declarations)
    text = base64.b64encode(archive).decode("ascii")
    chunks = "\n".join(f'    "{text[i : i + 96]}"' for i in range(0, len(text), 96))
    return _TEMPLATE.format(
        version=__version__,
        private=private,
        declarations=repr(where),
        archive=chunks,
        source_attribute=SOURCE_ATTRIBUTE,
    )
