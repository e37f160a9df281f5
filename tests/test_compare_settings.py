"""``diffattn compare``: each option declared once, in :class:`CompareOptions` (what
:func:`run_compare` takes) and :class:`MeasurementOptions` (the part of its ``eval_settings`` the
command line sets), and the command passes the object it parsed on."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from diffattn.commands import compare as compare_command
from diffattn.compare import ATTENTIONS, CompareOptions, MeasurementOptions
from diffattn.compare.evaluate import EvalSettings

SRC = Path(__file__).resolve().parents[1] / "src" / "diffattn"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare_command.add_arguments(parser)
    return parser.parse_args(argv)


class _Called(Exception):
    """Stops the command at the function it calls, with what it was given."""


def _compare_options(monkeypatch, argv: list[str]) -> CompareOptions:
    import diffattn.compare

    def run_compare(options):
        raise _Called(options)

    monkeypatch.setattr(diffattn.compare, "run_compare", run_compare)
    with pytest.raises(_Called) as called:
        compare_command.run(_parse(argv))
    return called.value.args[0]


def test_the_command_line_defaults_are_compare_options_defaults(monkeypatch):
    assert _compare_options(monkeypatch, []) == CompareOptions()
    assert CompareOptions().eval_settings == EvalSettings()
    assert MeasurementOptions().eval_settings() == EvalSettings()


def test_compare_passes_every_setting_on(monkeypatch):
    argv = ["--out", "o", "--part", "lm", "--config", "c.yaml", "--steps", "5"]
    argv += ["--preset", "tiny", "--seeds", "2", "--jobs", "4", "--jobs-per-device", "2"]
    argv += ["--no-eval", "--needle-samples", "3", "--eval-tokens", "100", "--device", "cpu"]
    argv += ["--attention", "diff_v2", "baseline", "--set", "a=1", "--set", "b=2"]
    argv += ["--overwrite", "--quiet"]
    options = _compare_options(monkeypatch, argv)
    assert options == CompareOptions(
        out="o",
        config="c.yaml",
        overrides=["a=1", "b=2"],
        attentions=("diff_v2", "baseline"),
        seeds=2,
        steps=5,
        preset="tiny",
        device="cpu",
        overwrite=True,
        progress=False,
        jobs=4,
        jobs_per_device=2,
        evaluate=False,
        eval_settings=EvalSettings(needle_samples=3, max_tokens=100),
        part="lm",
    )


def test_every_option_is_a_setting_of_compare_options():
    """Each option's ``dest`` is a setting of :class:`CompareOptions` (or of
    :class:`MeasurementOptions`, for ``eval_settings``); every setting has its option."""
    parser = argparse.ArgumentParser()
    CompareOptions.add_arguments(parser)
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    own = [
        f.metadata["setting"].dest or f.name
        for f in dataclasses.fields(CompareOptions)
        if f.name != "eval_settings"
    ]
    measured = [f.name for f in dataclasses.fields(MeasurementOptions)]
    at = own.index("device")  # the measurement options stand where eval_settings is
    assert dests == own[:at] + measured + own[at:]
    spec = CompareOptions.__dataclass_fields__["eval_settings"].metadata["setting"]
    assert spec.nested is MeasurementOptions  # declared as nested(), not by an override


def test_options_built_by_hand_keep_their_sequences_as_tuples():
    options = CompareOptions(attentions=["diff_v1"], overrides=["steps=2"])
    assert options.attentions == ("diff_v1",) and options.overrides == ("steps=2",)
    assert CompareOptions().attentions == ATTENTIONS and CompareOptions().overrides == ()
    assert options == CompareOptions(attentions=("diff_v1",), overrides=("steps=2",))


def test_the_command_declares_no_option_of_its_own():
    """``commands/compare.py`` holds no settings class and no default: CompareOptions' are the
    only ones."""
    tree = ast.parse((SRC / "commands" / "compare.py").read_text(encoding="utf-8"))
    assert not [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            assert not node.args.defaults and not any(node.args.kw_defaults), node.name


def test_compare_options_defaults_are_written_once():
    """No literal default of CompareOptions is written again in the compare package or the
    command (a keyword argument or parameter of the same name and value)."""
    tree = ast.parse((SRC / "compare" / "__init__.py").read_text(encoding="utf-8"))
    (declared,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CompareOptions"
    ]
    defaults = {}
    for item in declared.body:
        call = item.value if isinstance(item, ast.AnnAssign) else None
        if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant):
            defaults[item.target.id] = call.args[0].value
    assert defaults["out"] == "runs/compare" and defaults["seeds"] == 3
    inside = {id(node) for node in ast.walk(declared)}
    found = []
    for path in [*sorted((SRC / "compare").glob("*.py")), SRC / "commands" / "compare.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if id(node) in inside or not isinstance(node, ast.arguments):
                continue
            positional = [*node.posonlyargs, *node.args]
            pairs = list(
                zip(positional[len(positional) - len(node.defaults) :], node.defaults, strict=True)
            )
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if d]
            found += [
                f"{path.name}: {arg.arg}={default.value!r}"
                for arg, default in pairs
                if isinstance(default, ast.Constant)
                and default.value is not None
                and defaults.get(arg.arg) == default.value
            ]
    assert found == []
