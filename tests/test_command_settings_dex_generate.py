"""``diffattn dex`` and ``diffattn generate``: each option declared once, in the settings class
of the command (of each ``dex`` sub-command), the parsed defaults being the class's, and every
setting passed on to the function the command calls."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from diffattn.commands import dex as dex_command
from diffattn.commands import generate as generate_command

pytestmark = pytest.mark.extra("train")  # dex's run imports diffattn.train

REQUIRED = {
    "select": (["m"], {"model": "m"}),
    "train": (["m", "--out", "o"], {"model": "m", "out": "o"}),
    "merge": (["a", "m", "--out", "o"], {"adapter": "a", "model": "m", "out": "o"}),
    "compare": (["m"], {"model": "m"}),
}
"""Each ``dex`` sub-command: its shortest command line and the settings that it gives."""


def _dex_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    dex_command.add_arguments(parser)
    return parser.parse_args(argv)


def _generate_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate_command.add_arguments(parser)
    return parser.parse_args(argv)


class _Called(Exception):
    """Stops a command at the function it calls, with what it was given."""


def _stop(*args, **kwargs):
    raise _Called(args, kwargs)


def _call(monkeypatch, module, name: str, run, args: argparse.Namespace):
    """``run(args)`` up to ``module.name``: the positional and keyword arguments it gets."""
    monkeypatch.setattr(module, name, _stop)
    with pytest.raises(_Called) as called:
        run(args)
    return called.value.args


@pytest.mark.parametrize("verb", list(dex_command.VERBS))
def test_dex_parsed_defaults_are_the_settings_defaults(verb):
    settings, _ = dex_command.VERBS[verb]
    argv, given = REQUIRED[verb]
    assert settings.from_args(_dex_args([verb, *argv])) == settings(**given)


def test_generate_parsed_defaults_are_the_settings_defaults():
    args = _generate_args(["m", "--prompt", "p"])
    settings = generate_command.GenerateSettings.from_args(args)
    assert settings == generate_command.GenerateSettings(model_dir="m", prompt="p")
    assert settings.compile is False and settings.auto_compile is False


def test_dex_shared_options_are_one_declaration():
    """MODEL, --set and --quiet of select, train and compare come from ModelSettings."""
    shared = [f.name for f in dataclasses.fields(dex_command.ModelSettings)]
    for verb in ("select", "train", "compare"):
        settings, _ = dex_command.VERBS[verb]
        assert issubclass(settings, dex_command.ModelSettings)
        assert [f.name for f in dataclasses.fields(settings)][: len(shared)] == shared


def test_dex_select_passes_every_setting(monkeypatch):
    from diffattn.dex import train as dex_train

    argv = ["select", "m", "--method", "importance", "--k", "2", "--order", "low"]
    argv += ["--batches", "3", "--out", "s.json", "--set", "a=1", "--set", "b=2", "--quiet"]
    args, kwargs = _call(monkeypatch, dex_train, "select_run", dex_command.run, _dex_args(argv))
    assert args == ("m", "importance", 2, "low", "s.json", ("a=1", "b=2"))
    assert type(args[2]) is int
    assert kwargs == {"batches": 3, "progress": False}
    args, _ = _call(
        monkeypatch,
        dex_train,
        "select_run",
        dex_command.run,
        _dex_args(["select", "m", "--k", "0.5"]),
    )
    assert args[2] == 0.5 and type(args[2]) is float


def test_dex_train_passes_every_setting(monkeypatch):
    from diffattn.dex import train as dex_train

    argv = ["train", "m", "--out", "o", "--heads", "all", "--steps", "7", "--lambda-init", "0.3"]
    argv += ["--anneal-steps", "3", "--resume", "--overwrite", "--set", "a=1", "--quiet"]
    (options,), _ = _call(monkeypatch, dex_train, "train_dex", dex_command.run, _dex_args(argv))
    assert options == dex_train.DexTrainOptions(
        model="m",
        out="o",
        heads="all",
        steps=7,
        lambda_init="0.3",
        anneal_steps=3,
        overrides=("a=1",),
        resume=True,
        progress=False,
        overwrite=True,
    )
    assert dex_command.VERBS["train"][0] is dex_train.DexTrainOptions


def test_dex_merge_passes_every_setting(monkeypatch):
    from diffattn.dex import train as dex_train

    args = _dex_args(["merge", "a", "m", "--out", "o", "--overwrite"])
    called = _call(monkeypatch, dex_train, "merge_run", dex_command.run, args)
    assert called == (("a", "m", "o"), {"overwrite": True})


@pytest.mark.parametrize(
    ("steps", "expected"), [([], dex_command.COMPARE_STEPS), (["--steps", "0"], 0)]
)
def test_dex_compare_steps_default_once(monkeypatch, steps, expected):
    import diffattn.dex_compare

    argv = ["compare", "m", "--out", "o", "--methods", "dex", "ft", "--overwrite", *steps]
    args, kwargs = _call(
        monkeypatch, diffattn.dex_compare, "compare_methods", dex_command.run, _dex_args(argv)
    )
    assert args == ("m", "o", expected)
    assert kwargs == {
        "overrides": [],
        "methods": ("dex", "ft"),
        "progress": True,
        "overwrite": True,
        "benchmarks": None,
    }
    help_text = dex_command.CompareSettings.__dataclass_fields__["steps"].metadata["setting"].help
    assert f"(default {dex_command.COMPARE_STEPS})" in help_text


def test_generate_compile_options_exclude_each_other_and_may_be_left_out(capsys):
    base = ["m", "--prompt", "p"]
    settings = generate_command.GenerateSettings.from_args
    assert settings(_generate_args([*base, "--compile"])).compile is True
    auto = settings(_generate_args([*base, "--auto-compile"]))
    assert auto.compile == "auto" and auto.auto_compile is True
    with pytest.raises(SystemExit):
        _generate_args([*base, "--compile", "--auto-compile"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_generate_runs_from_its_settings(monkeypatch):
    argv = ["m", "--prompt", "p", "--max-new-tokens", "5", "--temperature", "0", "--no-echo"]
    (settings,), _ = _call(
        monkeypatch, generate_command, "generate_text", generate_command.run, _generate_args(argv)
    )
    assert settings == generate_command.GenerateSettings(
        model_dir="m", prompt="p", max_new_tokens=5, temperature=0.0, no_echo=True
    )
