"""``diffattn compare``: each option declared once, in the command's settings class, and every
setting passed on to the function the command calls."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from diffattn.commands import compare as compare_command
from diffattn.compare import ATTENTIONS, CompareOptions
from diffattn.compare.evaluate import EvalSettings


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


class _Called(Exception):
    """Stops a command at the function it calls, with what it was given."""


def _compare_options(monkeypatch, argv: list[str]) -> CompareOptions:
    import diffattn.compare

    def run_compare(options):
        raise _Called(options)

    monkeypatch.setattr(diffattn.compare, "run_compare", run_compare)
    with pytest.raises(_Called) as called:
        compare_command.run(_parse(compare_command, argv))
    return called.value.args[0]


def test_compare_defaults_are_those_of_compare_options(monkeypatch):
    """Until ``CompareOptions`` loses its own defaults, both declarations agree."""
    assert _compare_options(monkeypatch, []) == CompareOptions()


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


def test_compare_settings_defaults():
    settings = compare_command.CompareSettings()
    assert settings.attention == ATTENTIONS
    assert settings.needle_samples == EvalSettings().needle_samples
    assert settings.eval_settings() == EvalSettings()
    args = _parse(compare_command, [])
    assert args.needle_samples is None and args.overrides == []
    assert compare_command.CompareSettings.from_args(args) == dataclasses.replace(
        settings, attention=list(ATTENTIONS), overrides=[]
    )
