"""The settings classes of ``diffattn train``, ``scaling``, ``long-context`` and ``convert``:
the parsed command line becomes the settings object, each option declared once (``scaling``'s
in :class:`~diffattn.scaling.ScalingOptions`: ``test_scaling_dex_settings.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from extras import require_extra

pytestmark = require_extra("train")

from diffattn.commands import convert, long_context, scaling
from diffattn.commands import train as train_command
from diffattn.train.cli import TrainSettings, add_set_option


def _parse(add_arguments, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_train_settings_from_the_command_line():
    args = _parse(train_command.add_arguments, "tiny", "--set", "a=1", "--set", "b=2")
    settings = TrainSettings.from_args(args)
    assert settings.config == "tiny"
    assert list(settings.overrides) == ["a=1", "b=2"]
    assert (settings.resume, settings.steps, settings.device) == (False, None, None)
    assert TrainSettings.from_args(_parse(train_command.add_arguments, "x", "--resume")).resume
    resumed = _parse(train_command.add_arguments, "x", "--resume", "3", "--device", "cpu")
    assert (resumed.resume, resumed.device) == (3, "cpu")


@pytest.mark.parametrize("word", ["0", "-1", "x"])
def test_resume_takes_a_positive_step(word, capsys):
    with pytest.raises(SystemExit):
        _parse(train_command.add_arguments, "x", "--resume", word)
    assert "expected a checkpoint's step (a positive integer)" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["configs/tiny.yaml", "tiny"])
def test_the_recipe_after_resume_is_one_error_showing_the_order(recipe, capsys):
    from diffattn.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--resume", recipe, "--out", "runs/x"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        "diffattn train: error: argument --resume: expected a checkpoint's step (a positive "
        f"integer), got {recipe!r}; put the recipe first: diffattn train {recipe} [OPTIONS] "
        "--resume [STEP] (or write --resume=STEP)"
    )


def test_the_defaults_of_every_command_are_those_of_its_settings():
    cases = [
        (TrainSettings, train_command.add_arguments, ["x"], {"config"}),
        (convert.ConvertSettings, convert.add_arguments, ["a", "b"], {"src", "out"}),
    ]
    for cls, add_arguments, argv, given in cases:
        args = vars(_parse(add_arguments, *argv))
        for field in dataclasses.fields(cls):
            if field.name not in given:
                default = field.default
                expected = list(default) if isinstance(default, tuple) else default
                assert args[field.name] == expected, (cls.__name__, field.name)


def test_long_context_actions_parse_into_their_settings():
    args = _parse(long_context.add_arguments, "upsample", "--tokenizer", "t", "--target-len", "8")
    up = long_context.UpsampleSettings.from_args(args)
    assert (up.tokenizer, up.target_len, list(up.data), up.long_share) == ("t", 8, ["stdlib"], 0.5)
    args = _parse(long_context.add_arguments, "widen", "m", "--max-seq-len", "64", "--out", "o")
    widen = long_context.WidenSettings.from_args(args)
    assert (widen.model, widen.max_seq_len, widen.rope_theta, widen.overwrite) == (
        "m",
        64,
        None,
        False,
    )


def test_set_option_alone_collects_overrides():
    args = _parse(lambda p: add_set_option(p, "help"), "--set", "a=1")
    assert args.overrides == ["a=1"]
    assert _parse(lambda p: add_set_option(p, "help")).overrides == []


@pytest.mark.parametrize("module", [train_command, scaling, convert])
def test_run_takes_the_settings_without_defaults_of_its_own(module):
    (parameter,) = inspect.signature(module.run_settings).parameters.values()
    assert parameter.default is inspect.Parameter.empty
