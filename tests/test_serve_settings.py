"""``diffattn serve``: each setting declared once, in ``ServeSettings``; the command's options
come from it and ``parse_options`` takes it (or the model and settings by name) with no default
of its own, returning the checked ``ServeOptions``."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from diffattn.commands import serve as serve_command
from diffattn.serve import options as serve_options
from diffattn.serve.options import (
    CB_SIZE_OPTIONS,
    LOOPBACK,
    ServeOptions,
    ServeSettings,
    parse_options,
)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    return parser.parse_args(argv)


class _Called(Exception):
    """Stops the command at ``parse_options``, with what it was given."""


def _given(monkeypatch, argv: list[str]) -> inspect.BoundArguments:
    signature = inspect.signature(serve_options.parse_options)

    def parse_options(*args, **kwargs):
        raise _Called(signature.bind(*args, **kwargs))

    monkeypatch.setattr(serve_options, "parse_options", parse_options)
    with pytest.raises(_Called) as called:
        serve_command.run(_args(argv))
    return called.value.args[0]


def test_the_command_declares_no_setting_of_its_own():
    assert serve_command.ServeSettings is ServeSettings
    assert not any(
        isinstance(value, type) and dataclasses.is_dataclass(value) and value is not ServeSettings
        for value in vars(serve_command).values()
    )


def test_there_is_a_setting_per_continuous_batching_size():
    names = [f.name for f in dataclasses.fields(ServeSettings)]
    assert [name for name in names if name.startswith("cb_")] == [
        f"cb_{key}" for key in CB_SIZE_OPTIONS
    ]
    settings = ServeSettings(model="m", cb_num_blocks="64")
    assert settings.cb_sizes() == {
        key: "64" if key == "num_blocks" else None for key in CB_SIZE_OPTIONS
    }


def test_parse_options_and_serve_options_have_no_defaults_of_their_own():
    parameters = inspect.signature(parse_options).parameters
    assert list(parameters) == ["settings", "cb_sizes", "changes"]
    assert parameters["cb_sizes"].default is None
    for field in dataclasses.fields(ServeOptions):
        assert field.default is dataclasses.MISSING, field.name
        assert field.default_factory is dataclasses.MISSING, field.name


def test_the_command_passes_its_settings_to_parse_options(monkeypatch):
    argv = ["m", "--name", "n", "--port", "9000", "--continuous-batching"]
    argv += ["--cb-num-blocks", "64", "--log-level", "info", "--chat-template", "{{ x }}"]
    call = _given(monkeypatch, argv)
    assert call.arguments == {
        "settings": ServeSettings(
            model="m",
            name="n",
            port="9000",
            continuous_batching=True,
            cb_num_blocks="64",
            log_level="info",
            chat_template="{{ x }}",
        )
    }


def test_the_command_line_defaults_are_the_settings_defaults(monkeypatch):
    assert _given(monkeypatch, ["m"]).arguments == {"settings": ServeSettings(model="m")}
    args = _args(["m"])
    for field in dataclasses.fields(ServeSettings):
        if field.name != "model":
            assert getattr(args, field.name) == field.default, field.name


def test_the_defaults_checked():
    options = parse_options("m", device="cpu")
    assert options == parse_options(ServeSettings(model="m", device="cpu"))
    assert options == ServeOptions(
        model="m",
        name="m",
        base=None,
        host=LOOPBACK,
        port=8000,
        device="cpu",
        dtype="auto",
        backend=None,
        continuous_batching=False,
        cb_sizes={},
        compile=False,
        chat_template=None,
        log_level="warning",
        engine="transformers",
        engine_args=(),
    )


def test_settings_by_name_change_the_given_settings():
    settings = ServeSettings(model="m", device="cpu", name="n")
    assert parse_options(settings, port=9001).port == 9001
    assert parse_options(settings, port="9001").name == "n"
    assert parse_options("m", device="cpu", port=9001) == parse_options(
        ServeSettings(model="m", device="cpu", port="9001")
    )
    by_size = parse_options("m", device="cpu", continuous_batching=True, cb_sizes={"num_blocks": 9})
    by_name = parse_options("m", device="cpu", continuous_batching=True, cb_num_blocks="9")
    assert by_size == by_name and by_size.cb_sizes == {"num_blocks": 9}
    assert parse_options("m", device="cpu", cb_sizes={"num_blocks": None}).cb_sizes == {}


def test_a_misspelt_setting_or_size_is_refused():
    with pytest.raises(
        TypeError, match="parse_options\\(\\) got an unexpected keyword argument 'prot'"
    ):
        parse_options("m", prot=9000)
    with pytest.raises(ValueError, match="unknown continuous-batching size 'blocks'"):
        parse_options("m", cb_sizes={"blocks": "9"})
    with pytest.raises(TypeError, match="takes ServeSettings"):
        parse_options(object())  # type: ignore[arg-type]
