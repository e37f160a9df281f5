"""``diffattn serve``: each option declared once, in the command's settings class, and every
setting passed on to the function the command calls (``diffattn compare``:
``test_compare_settings.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from diffattn.commands import serve as serve_command
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
