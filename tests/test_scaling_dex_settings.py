"""``diffattn scaling`` and ``diffattn dex train`` are built from the library's options
classes, :class:`~diffattn.scaling.ScalingOptions` and
:class:`~diffattn.dex.train.DexTrainOptions`: the parsed defaults are those classes' defaults,
the command passes the object on, and the library functions default to the same values."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from extras import require_extra

pytestmark = require_extra("train")

from diffattn.commands import dex as dex_command
from diffattn.commands import scaling as scaling_command
from diffattn.dex import train as dex_train
from diffattn.scaling import ScalingOptions, sweep


def _parse(add_arguments, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_scaling_parsed_defaults_are_the_options_defaults():
    parsed = ScalingOptions.from_args(_parse(scaling_command.add_arguments))
    assert parsed == ScalingOptions(overrides=[])  # --set (repeatable) collects a list
    assert scaling_command.add_arguments == ScalingOptions.add_arguments


def test_scaling_options_from_a_command_line():
    argv = ["--out", "o", "--axis", "tokens", "--tokens", "8", "16", "32", "--count", "total"]
    argv += ["--attention", "baseline", "diff_v2", "--set", "a=1", "--device", "cpu"]
    argv += ["--overwrite", "--quiet"]
    options = ScalingOptions.from_args(_parse(scaling_command.add_arguments, *argv))
    assert options == ScalingOptions(
        out="o",
        axis="tokens",
        tokens=(8, 16, 32),
        count="total",
        attentions=("baseline", "diff_v2"),
        overrides=["a=1"],
        device="cpu",
        overwrite=True,
        progress=False,
    )
    args = _parse(scaling_command.add_arguments, "--sizes", "tiny", "--from-results", "r.json")
    options = ScalingOptions.from_args(args)
    assert (options.sizes, options.from_results) == (("tiny",), ("r.json",))


class _Called(Exception):
    """Stops a command at the function it calls, with what it was given."""


def _stop(*args, **kwargs):
    raise _Called(args, kwargs)


def test_scaling_passes_the_options_on(monkeypatch):
    import diffattn.scaling

    monkeypatch.setattr(diffattn.scaling, "run_scaling", _stop)
    options = ScalingOptions(sizes=("a", "b", "c"), steps=2, progress=False)
    with pytest.raises(_Called) as called:
        scaling_command.run_settings(options)
    assert called.value.args == ((options,), {})


def test_scaling_fit_results_gets_every_setting(monkeypatch):
    import diffattn.scaling

    monkeypatch.setattr(diffattn.scaling, "fit_results", _stop)
    argv = ["--from-results", "a", "b", "--out", "o", "--axis", "tokens", "--count", "total"]
    argv += ["--attention", "baseline", "diff_v1", "--quiet"]
    with pytest.raises(_Called) as called:
        scaling_command.run(_parse(scaling_command.add_arguments, *argv))
    assert called.value.args == (
        (("a", "b"), "o"),
        {
            "axis": "tokens",
            "count": "total",
            "attentions": ("baseline", "diff_v1"),
            "progress": False,
        },
    )


def test_fit_results_defaults_are_the_options_defaults():
    parameters = inspect.signature(sweep.fit_results).parameters
    defaults = ScalingOptions()
    for name, field in (("axis", "axis"), ("count", "count"), ("attentions", "attentions")):
        assert parameters[name].default == getattr(defaults, field)
    assert parameters["progress"].default is defaults.progress is True


def test_dex_train_parsed_defaults_are_the_options_defaults():
    args = _parse(dex_command.add_arguments, "train", "m", "--out", "o")
    assert dex_train.DexTrainOptions.from_args(args) == dex_train.DexTrainOptions(
        model="m", out="o"
    )
    assert args.quiet is False and args.overrides == []


def test_dex_options_are_the_library_classes():
    settings, _ = dex_command.VERBS["train"]
    assert settings is dex_train.DexTrainOptions
    assert dex_command.ModelSettings is dex_train.DexModelSettings
    shared = [f.name for f in dataclasses.fields(dex_train.DexModelSettings)]
    assert shared == ["model", "overrides", "progress"]
    for name in ("select", "compare"):
        assert issubclass(dex_command.VERBS[name][0], dex_train.DexModelSettings)


def test_dex_library_functions_default_to_the_settings():
    progress = dex_train.DexModelSettings.progress
    assert progress is True
    assert inspect.signature(dex_train.prepare).parameters["progress"].default is progress
    assert inspect.signature(dex_train.select_run).parameters["progress"].default is progress


def test_dex_train_prints_the_result(monkeypatch, capsys, tmp_path):
    class Heads:
        def format_table(self) -> str:
            return "heads table"

    result = dex_train.DexTrainResult(
        out=tmp_path,
        adapter=tmp_path / "adapter",
        checkpoint=None,
        loss_before=2.5,
        loss_after=2.25,
        heads=Heads(),
        lambdas=[(1, [0.5, -0.25])],
        step=1,
        elapsed_s=0.5,
        trainable_parameters=1000,
        parameters=20000,
    )
    given = []
    monkeypatch.setattr(dex_train, "train_dex", lambda options: given.append(options) or result)
    args = _parse(dex_command.add_arguments, "train", "m", "--out", "o", "--quiet")
    assert dex_command.run(args) == 0
    assert given == [dex_train.DexTrainOptions(model="m", out="o", progress=False)]
    assert capsys.readouterr().out == (
        "heads table\n"
        "step  λ(t) per adapted layer\n"
        "   1  +0.5000 -0.2500\n"
        "held-out loss: before 2.5000, after 2.2500 (1 steps, 0.5 s, 1,000 of 20,000 "
        "parameters trained)\n"
        f"adapter: {tmp_path / 'adapter'}\ncheckpoint: None\n"
    )
