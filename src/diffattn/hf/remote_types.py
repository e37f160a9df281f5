"""The attention types a Hub export carries: the source of every type its model uses.

:mod:`diffattn.hf.remote_code` vendors diffattn's own modules. A model's attention types are
declarations (:class:`~diffattn.attention.types.AttentionType`) whose class and ``module``
class are defined somewhere: in diffattn (the built-in types, vendored with the package), or
in another package that registered them (``register_attention_type`` or the
``diffattn.attention_types`` entry points). For such an external type the export carries

* the files that define its declaration class and its module class
  (``inspect.getsourcefile(type(declaration))``, ``declaration.module``), with every module of
  their own top-level package that they import, anywhere in their body, absolutely or
  relatively, and the ``__init__`` files of their packages;
* the diffattn modules they import (a name imported from the package root, ``from diffattn
  import AttentionType``, brings the module that defines it);
* how to find the declaration again: the module-level name that holds it in its module, or
  else its class, instantiated without arguments.

The files are vendored under ``<private package>.external``, with their own package's name
and diffattn's renamed in import statements (:func:`~diffattn.hf.remote_code.renamed`), and
``modeling_diffattn.py`` imports each one and registers its declaration with the vendored
registry before a configuration is read (its ``TYPE_DECLARATIONS``).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "diffattn"
EXTERNAL = "external"
"""The subpackage of the vendored package that holds the external types' modules."""


@dataclass(frozen=True)
class TypeSources:
    """What a Hub export needs to carry for a model's attention types.

    Attributes:
        package_modules: diffattn modules to vendor beyond the Hugging Face classes' closure.
        external: ``{module name: source file}`` of the external types' modules.
        declarations: per external type, ``(module name, attribute or None, class name)``:
            where its declaration is found again after the module's import.
    """

    package_modules: tuple[str, ...] = ()
    external: dict[str, Path] = field(default_factory=dict)
    declarations: tuple[tuple[str, str | None, str], ...] = ()

    @property
    def external_packages(self) -> tuple[str, ...]:
        """The top-level names of the external modules (renamed when vendored)."""
        return tuple(sorted({name.split(".")[0] for name in self.external}))


def _source_file(name: str, what: str) -> Path:
    """The source file of the importable module ``name`` (``what`` names it in errors)."""
    try:
        path = inspect.getsourcefile(sys.modules[name])
    except (KeyError, TypeError):  # not imported, or built in
        path = None
    if path is None:
        spec = importlib.util.find_spec(name)
        path = None if spec is None else spec.origin
    if path is None or not str(path).endswith(".py") or not Path(path).is_file():
        raise ValueError(
            f"{what}: module {name!r} has no Python source file to carry into the Hub export"
        )
    return Path(path)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, top: str) -> tuple[set[str], set[str], set[str]]:
    """Modules ``name`` (file ``path``) imports: of its own top-level package ``top``, of
    diffattn, and names it imports from diffattn's package root."""
    package = name if _is_package(path) else name.rpartition(".")[0]
    own: set[str] = set()
    ours: set[str] = set()
    facade: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.Import):
            targets = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = importlib.util.resolve_name("." * node.level + base, package)
            targets = [(base, [alias.name for alias in node.names])]
        for module, names in targets:
            first = module.split(".")[0]
            if module == PACKAGE and names:
                facade.update(names)
            elif first == PACKAGE:
                ours.add(module)
            elif first == top:
                own.add(module)
                own.update(f"{module}.{n}" for n in names if _submodule_exists(module, n))
    return own, ours, facade


def _submodule_exists(package: str, name: str) -> bool:
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except (ImportError, ValueError):  # ``package`` is a module, not a package
        return False


def _where(declaration) -> tuple[str, str | None, str]:
    """``(module name, attribute or None, class name)`` that find ``declaration`` again."""
    cls = type(declaration)
    module = sys.modules.get(cls.__module__)
    attribute = next(
        (key for key, value in vars(module).items() if value is declaration and key.isidentifier()),
        None,
    )
    if attribute is None:
        try:
            cls()
        except TypeError as error:
            raise ValueError(
                f"attention type {declaration.name!r}: its declaration is neither a module-level "
                f"name of {cls.__module__} nor made by {cls.__qualname__}() ({error}); the Hub "
                "export cannot find it again"
            ) from None
    return cls.__module__, attribute, cls.__qualname__


def type_sources(declarations, root: Path) -> TypeSources:
    """The :class:`TypeSources` of the attention types ``declarations`` (those of a model);
    ``root`` is the directory holding the ``diffattn`` package."""
    package_modules: set[str] = set()
    todo: list[tuple[str, str]] = []  # (module, the type it serves, for errors)
    where = []
    for declaration in declarations:
        names = {type(declaration).__module__, declaration.module.__module__}
        for name in sorted(names):
            if name == "__main__":
                raise ValueError(
                    f"attention type {declaration.name!r} is defined in __main__; define it in a "
                    "module file, which the Hub export can carry"
                )
            if name.split(".")[0] == PACKAGE:
                package_modules.add(name)
            else:
                todo.append((name, f"attention type {declaration.name!r}"))
        if type(declaration).__module__.split(".")[0] != PACKAGE:
            where.append(_where(declaration))
    external: dict[str, Path] = {}
    while todo:
        name, what = todo.pop()
        if name in external:
            continue
        path = external[name] = _source_file(name, what)
        parts = name.split(".")
        todo += [(".".join(parts[:i]), what) for i in range(1, len(parts))]  # its packages
        own, ours, facade = _imports(name, path, parts[0])
        todo += [(module, what) for module in sorted(own)]
        package_modules.update(ours)
        package_modules.update(facade_modules(facade, root))
    return TypeSources(tuple(sorted(package_modules)), dict(sorted(external.items())), tuple(where))


def facade_exports(root: Path) -> dict[str, str]:
    """``{name: module}`` of the names diffattn's package root imports from its submodules
    (``from diffattn.config import ModelConfig``), read from its ``__init__.py``."""
    tree = ast.parse((root / PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    exports = {}
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith(PACKAGE + ".")
        ):
            exports.update({alias.asname or alias.name: node.module for alias in node.names})
    return exports


def facade_modules(names, root: Path) -> set[str]:
    """The modules that define ``names`` imported from diffattn's package root (a name that
    is a submodule, ``presets``, is that module)."""
    exports = facade_exports(root)
    found = set()
    for name in names:
        if name in exports:
            found.add(exports[name])
        elif (root / PACKAGE / f"{name}.py").is_file() or (root / PACKAGE / name).is_dir():
            found.add(f"{PACKAGE}.{name}")
    return found


def external_file_name(name: str, path: Path) -> str:
    """Where the external module ``name`` lies in the vendored package (relative path)."""
    parts = [EXTERNAL, *name.split(".")]
    if _is_package(path):
        return "/".join([*parts, "__init__.py"])
    return "/".join(parts) + ".py"
