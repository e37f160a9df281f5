"""``diffattn bench`` with sizes that cannot fit: refused up front, before any allocation,
naming the size and the need; an allocator failure during the run is one line too."""

from __future__ import annotations

import argparse
import time

import pytest

from diffattn.bench import throughput
from diffattn.cli import main

HUGE = ["bench", "--d-model", "65536", "--seq-len", "1000000", "--no-hf"]
SMALL = ["bench", "--d-model", "128", "--seq-len", "8", "--layers", "1", "--vocab", "32"]


def _no_models(*args, **kwargs):
    raise AssertionError("a model was built although the size cannot fit")


def _args(argv):
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    return parser.parse_args(argv[1:])


def test_absurd_size_is_refused_before_allocating(monkeypatch, capsys):
    monkeypatch.setattr(throughput, "our_candidates", _no_models)
    monkeypatch.setattr(throughput, "hf_candidates", _no_models)
    assert main(HUGE) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "d_model 65536" in lines[0] and "seq_len 1000000" in lines[0]
    assert "needs at least" in lines[0] and "GiB" in lines[0] and "available" in lines[0]


def test_the_estimate_is_cheap_and_grows_with_the_size():
    args = _args(HUGE)
    start = time.perf_counter()
    need = throughput.estimate_memory(throughput.build_configs(args), args)
    assert time.perf_counter() - start < 5
    assert need["total"] > 1000 * throughput.GIB
    small = _args([*SMALL, "--no-hf"])
    small_need = throughput.estimate_memory(throughput.build_configs(small), small)
    assert 0 < small_need["total"] < 64 * 1024**2
    with_hf = _args(SMALL)
    assert (
        throughput.estimate_memory(throughput.build_configs(with_hf), with_hf)["weights"]
        > (small_need["weights"])
    )


def test_memory_check_compares_with_what_the_device_has(monkeypatch):
    assert throughput.available_memory("cpu") > 0
    args = _args(SMALL)
    configs = throughput.build_configs(args)
    monkeypatch.setattr(throughput, "available_memory", lambda device: 1024)
    assert "needs at least" in throughput.check_memory(configs, args)
    monkeypatch.setattr(throughput, "available_memory", lambda device: None)
    assert throughput.check_memory(configs, args) is None


def test_an_allocator_failure_during_the_run_is_one_line(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough "
            "memory: you tried to allocate 1099511627776 bytes."
        )

    monkeypatch.setattr(throughput, "our_candidates", fail)
    assert main([*SMALL, "--no-hf"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "out of memory at d_model 128" in lines[0], err


def test_other_runtime_errors_are_not_reported_as_memory(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(throughput, "our_candidates", fail)
    with pytest.raises(RuntimeError, match="something else"):
        main([*SMALL, "--no-hf"])
