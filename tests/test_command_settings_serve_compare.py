"""``diffattn serve`` and ``diffattn compare``: each option declared once, in the command's
settings class, and every setting passed on to the function the command calls."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from diffattn.commands import compare as compare_command
from diffattn.commands import serve as serve_command
from diffattn.compare import ATTENTIONS, CompareOptions
from diffattn.compare.evaluate import EvalSettings
from diffattn.serve import options as serve_options


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


class _Called(Exception):
    """Stops a command at the function it calls, with what it was given."""


def _serve_call(monkeypatch, argv: list[str]) -> inspect.BoundArguments:
    signature = inspect.signature(serve_options.parse_options)

    def parse_options(*args, **kwargs):
        raise _Called(signature.bind(*args, **kwargs))

    monkeypatch.setattr(serve_options, "parse_options", parse_options)
    with pytest.raises(_Called) as called:
        serve_command.run(_parse(serve_command, argv))
    return called.value.args[0]


def test_serve_has_a_setting_per_continuous_batching_size():
    names = [f.name for f in dataclasses.fields(serve_command.ServeSettings)]
    sizes = [name for name in names if name.startswith("cb_")]
    assert sizes == [f"cb_{key}" for key in serve_options.CB_SIZE_OPTIONS]


def test_serve_passes_every_setting_to_parse_options(monkeypatch):
    names = {f.name for f in dataclasses.fields(serve_command.ServeSettings)}
    sizes = {f"cb_{key}" for key in serve_options.CB_SIZE_OPTIONS}
    taken = set(inspect.signature(serve_options.parse_options).parameters)
    assert names - sizes == taken - {"cb_sizes"}

    argv = ["m", "--name", "n", "--port", "9000", "--continuous-batching"]
    call = _serve_call(monkeypatch, [*argv, "--cb-num-blocks", "64", "--log-level", "info"])
    given = call.arguments
    assert given["model"] == "m" and given["name"] == "n" and given["port"] == "9000"
    assert given["continuous_batching"] is True and given["log_level"] == "info"
    keys = serve_options.CB_SIZE_OPTIONS
    assert given["cb_sizes"] == {key: "64" if key == "num_blocks" else None for key in keys}


def test_serve_defaults_are_those_of_parse_options(monkeypatch):
    """Until ``parse_options`` loses its own defaults, both declarations agree (``--port``
    is text on the command line, and no size is set)."""
    given = _serve_call(monkeypatch, ["m"]).arguments
    for name, parameter in inspect.signature(serve_options.parse_options).parameters.items():
        if parameter.default is inspect.Parameter.empty:
            continue
        if name == "port":
            assert int(given[name]) == parameter.default
        elif name == "cb_sizes":
            assert given[name] == dict.fromkeys(serve_options.CB_SIZE_OPTIONS)
        else:
            assert given[name] == parameter.default, name


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
