"""``diffattn`` on the core install (``pip install diffattn``, no extras).

A subprocess hides every package the core install would not have: anything outside the standard
library, diffattn and the distributions its ``[project] dependencies`` pull in (torch,
safetensors and theirs), read from the installed metadata. There, ``diffattn --help``, every
``diffattn COMMAND --help``, ``diffattn backends`` and ``diffattn presets`` work; a verb whose
run needs an extra prints one line naming it and exits with 2.

Every verb defines all its options there, as the full install does (a verb whose arguments
failed to import would be listed with a stand-in whose ``--help`` names the extra: none may).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import sysconfig
from importlib.metadata import packages_distributions, requires

import pytest
from packaging.requirements import Requirement

from diffattn.commands.extras import declared_extras, extra_of, missing_extra
from extras import declared_extras as pyproject_extras
from test_cli_surface import SURFACE

pytestmark = pytest.mark.extra("train")  # SURFACE: the full install's options, to compare

PASSED_ON = {"diffattn lm-eval": "the harness prints its own help; without it, one line, 2"}
"""Commands whose ``--help`` is not diffattn's to print."""

NOT_INSTALLED = (
    "needs the {extra!r} extra ({module} is not installed): pip install 'diffattn[{extra}]'"
)

RUN = r"""
import contextlib, importlib.abc, io, json, sys

ALLOWED, INSTALLED = (set(names) for names in json.loads(sys.argv[1]))
STDLIB = tuple(json.loads(sys.argv[2]))


class HideOptional(importlib.abc.MetaPathFinder):
    "What the core install lacks is not found (find_spec None, the import ModuleNotFoundError)."

    def __init__(self, finders):
        self.finders = finders

    def find_spec(self, name, path=None, target=None):
        for finder in self.finders:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        top = name.partition(".")[0]
        origin = spec.origin or ""
        in_stdlib = origin.startswith(STDLIB) and "-packages" not in origin
        return spec if top in ALLOWED or in_stdlib or spec.origin == "built-in" else None

    def find_distributions(self, *args, **kwargs):
        for finder in self.finders:
            for found in getattr(finder, "find_distributions", lambda *a, **k: ())(*args, **kwargs):
                if found.metadata["Name"].replace("_", "-").lower() in INSTALLED:
                    yield found


sys.meta_path[:] = [HideOptional(list(sys.meta_path))]

from diffattn.cli import main

results, hidden = [], set()
loaded = set(sys.modules)
for argv in json.loads(sys.argv[3]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append([argv, code, out.getvalue(), err.getvalue()])
    # each command as in a fresh process (a failed import leaves its finished submodules behind)
    for name in set(sys.modules) - loaded:
        where = str(getattr(sys.modules.pop(name), "__file__", ""))
        if name.partition(".")[0] not in ALLOWED and "-packages" in where:
            hidden.add(name.partition(".")[0])
print(json.dumps({"results": results, "imported": sorted(hidden)}))
"""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_distributions() -> list[str]:
    """The distributions the core install has: diffattn and its dependencies without extras,
    followed through theirs (normalised names)."""
    seen: set[str] = set()
    todo = ["diffattn"]
    while todo:
        name = todo.pop()
        key = _normal(name)
        if key in seen:
            continue
        seen.add(key)
        for line in requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return sorted(seen)


def core_modules() -> list[str]:
    """Top-level modules the core install has: its distributions' and the standard library's."""
    installed = set(core_distributions())
    modules = {
        module
        for module, distributions in packages_distributions().items()
        if any(_normal(d) in installed for d in distributions)
    }
    return sorted(modules | set(sys.stdlib_module_names) | set(sys.builtin_module_names))


@pytest.fixture(scope="module")
def core():
    """``{" ".join(argv): (exit code, stdout, stderr)}`` of every command run on the core."""
    commands = [["--help"]]
    commands += [[*c.split()[1:], "--help"] for c in SURFACE if c != "diffattn"]
    commands += [["backends"], ["presets"], ["train", "x.yaml"]]
    commands += [["long-context", "upsample", "--tokenizer", "x", "--target-len", "8"]]
    stdlib = sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
    core = json.dumps([core_modules(), core_distributions()])
    run = [sys.executable, "-c", RUN, core, json.dumps(stdlib)]
    done = subprocess.run([*run, json.dumps(commands)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer["imported"] == [], "packages the core install lacks were imported anyway"
    return {" ".join(argv): (code, out, err) for argv, code, out, err in answer["results"]}


def test_the_core_install_lacks_every_extra_package():
    modules = set(core_modules())
    absent = {"numpy", "yaml", "transformers", "tokenizers", "tqdm", "matplotlib", "scipy"}
    assert not absent & modules
    assert {"torch", "safetensors", "json"} <= modules


def test_help_lists_every_verb(core):
    code, out, err = core["--help"]
    assert (code, err) == (0, "")
    verbs = sorted(c.split()[1] for c in SURFACE if len(c.split()) == 2)
    assert all(re.search(rf"^\s+{re.escape(v)}\s", out, re.M) for v in verbs), out


@pytest.mark.parametrize("command", [c for c in SURFACE if c != "diffattn"])
def test_every_command_has_help(core, command):
    """``--help`` exits 0 and lists every option the full install has, or, for a stand-in
    (only those known), says which extra to install."""
    code, out, err = core[f"{command.removeprefix('diffattn ')} --help"]
    if command in PASSED_ON:
        assert code == 2 and len(err.splitlines()) == 1 and "pip install" in err
        return
    assert (code, err) == (0, "")
    assert "Not available on this install" not in out, out
    options = set(re.findall(r"(?<![\w-])--?[\w][\w-]*", out))
    missing = [o for o in SURFACE[command]["options"] if o not in options]
    assert not missing, f"{command} --help on the core install lacks {missing}:\n{out}"


def test_backends_and_presets_run(core):
    for command, says in (("backends", "auto"), ("presets", "tiny")):
        code, out, err = core[command]
        assert code == 0, err
        assert says in out


@pytest.mark.parametrize(
    ("command", "verb", "extra", "module"),
    [
        ("train x.yaml", "train", "train", "numpy"),
        ("long-context upsample --tokenizer x --target-len 8", "long-context", "train", "numpy"),
    ],
)
def test_a_run_that_needs_an_extra_says_which_in_one_line(core, command, verb, extra, module):
    code, out, err = core[command]
    expected = NOT_INSTALLED.format(extra=extra, module=module)
    assert (code, out, err) == (2, "", f"diffattn {verb}: error: {expected}\n")


def test_the_extras_are_those_pyproject_declares():
    """The installed metadata the command line reads is ``pyproject.toml``'s extras (reinstall
    with ``pip install -e .`` after changing them)."""
    declared = {
        extra: tuple(n for n in (_normal(Requirement(r).name) for r in reqs) if n != "diffattn")
        for extra, reqs in pyproject_extras().items()
    }
    assert declared_extras() == declared


@pytest.mark.parametrize(
    ("module", "prefer", "extra"),
    [
        ("numpy", (), "train"),
        ("numpy.linalg", ("eval", "train"), "eval"),
        ("yaml", (), "train"),
        ("transformers", ("serve",), "serve"),
        ("transformers", (), "hf"),
        ("scipy", ("train",), "eval"),
        ("tiktoken_ext", (), "tiktoken"),
        ("lm_eval", (), "lm-eval"),
        ("flash_attn", (), "flash"),
        ("diffattn", (), None),
        ("no_such_package", (), None),
    ],
)
def test_a_missing_module_is_named_by_its_extra(module, prefer, extra):
    assert extra_of(module, prefer) == extra


def test_only_an_absent_optional_package_is_reported(monkeypatch):
    numpy = ModuleNotFoundError("No module named 'numpy.nothing'", name="numpy.nothing")
    assert missing_extra(numpy) is None  # numpy is installed: broken, not missing
    ours = ModuleNotFoundError("No module named 'diffattn.nothing'", name="diffattn.nothing")
    assert missing_extra(ours) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    expected = NOT_INSTALLED.format(extra="eval", module="numpy")
    assert missing_extra(numpy, ("eval",)) == expected
    assert missing_extra(ours) is None
