"""The settings of ``diffattn bench``, ``diffattn backends`` and the probe-memory command
(:mod:`diffattn.settings`): each option is declared once, in a settings dataclass, from which
the parser is built; the parsed defaults are the dataclass's; each bound keeps its message word
for word, in the order the command has always checked them."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json

import pytest

from diffattn.bench import backends, probe_memory
from diffattn.bench.options import BenchSettings, add_arguments, settings_of
from diffattn.bench.throughput import run


def _parsed(add, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def _defaults(cls) -> dict:
    values = {}
    for f in dataclasses.fields(cls):
        values[f.name] = list(f.default) if isinstance(f.default, tuple) else f.default
    return values


def test_bench_parsed_defaults_are_the_settings_defaults():
    args = _parsed(add_arguments, [])
    assert vars(args) == _defaults(BenchSettings)
    assert settings_of(args) == BenchSettings()


def test_backends_parsed_defaults_are_the_settings_defaults():
    assert vars(_parsed(backends.add_arguments, [])) == _defaults(backends.BackendsSettings)


def test_probe_memory_parsed_defaults_are_the_settings_defaults():
    parsed = _parsed(probe_memory.ProbeMemorySettings.add_arguments, [])
    assert vars(parsed) == _defaults(probe_memory.ProbeMemorySettings)


def test_the_timed_shape_defaults_to_the_backends_options():
    defaults = backends.BackendsSettings()
    shape = backends.Shape()
    assert (shape.seq_len, shape.heads, shape.batch, shape.head_dim) == (
        defaults.seq_len,
        defaults.heads,
        defaults.batch,
        defaults.head_dim,
    )
    assert shape.kv_heads == defaults.heads  # --kv-heads defaults to --heads


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seq_len": 1}, "--seq-len must be an integer >= 2 (the loss needs a next token), got 1"),
        ({"warmup": -1}, "--warmup must be an integer >= 0, got -1"),
        ({"mem_seq_len": 1}, "--mem-seq-len must be an integer >= 2 (as --seq-len), got 1"),
        ({"kv_heads": 0}, "--kv-heads must be an integer >= 1, got 0"),
        # two bounds fail: the first in the order the command checks (not the field order)
        ({"d_model": 100, "layers": 0}, "--layers must be an integer >= 1, got 0"),
        ({"head_dim": 3, "prompt_len": 0}, "--prompt-len must be an integer >= 1, got 0"),
    ],
)
def test_bench_bounds_keep_their_messages(changes, message):
    with pytest.raises(ValueError) as error:
        dataclasses.replace(BenchSettings(), **changes).check()
    assert str(error.value) == message


def test_bench_runs_from_its_settings():
    settings = BenchSettings(
        seq_len=8, d_model=128, layers=1, vocab=32, steps=1, warmup=0, mode="fwd"
    )
    settings = dataclasses.replace(settings, no_hf=True, json=True)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert run(settings) == 0
    records = json.loads(stdout.getvalue())
    assert {r["attention"] for r in records} == {"baseline", "diff_v1", "diff_v2"}


def test_backends_bounds_keep_their_messages(capsys):
    args = _parsed(backends.add_arguments, ["--repeats", "0", "--head-dim", "0"])
    assert backends.run(args) == 2
    assert capsys.readouterr().err == "diffattn backends: error: --repeats is too small: 0\n"
