"""diffattn.compare.allocator: the comparison's processes keep freed memory for reuse."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from diffattn.compare import devices
from diffattn.compare.allocator import keep_freed_memory

FAULTS = textwrap.dedent(
    """
    import resource, sys, torch
    from diffattn.compare.allocator import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    def step():  # a training step: 4 tensors of 16 MiB (logits and theirs) live, then freed
        xs = [torch.ones(4 * 2**20) for _ in range(4)]
        del xs
    step()  # warm up: the first step faults its pages in either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_freed_tensors_are_reused_instead_of_faulted_in_again():
    default, kept = _faults("default"), _faults("keep")
    # glibc hands the 64 MiB freed at the end of each step back (over its default trimming
    # threshold of twice the mmap threshold), so every step faults 4 × 4096 pages in again;
    # kept memory is reused
    assert default > 10 * 4 * 4096 * 0.9, default
    assert kept < default / 10, (kept, default)


def test_every_pool_worker_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr("diffattn.compare.allocator.keep_freed_memory", lambda: calls.append(1))
    claimed = []
    monkeypatch.setattr(devices, "_claim_device", lambda d, c: claimed.append((d, c)))
    devices._start_worker(None, None)
    devices._start_worker(("cuda:0",), "slot")
    assert calls == [1, 1]
    assert claimed == [(("cuda:0",), "slot")]
    with devices.worker_pool(1) as pool:
        assert pool._initializer is devices._start_worker


def test_elsewhere_nothing_changes(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert keep_freed_memory() is False
