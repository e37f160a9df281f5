"""Shared fixtures: deterministic, single-threaded-friendly CPU runs, and tiny models."""

from __future__ import annotations

import os

import pytest
import torch

from extras import skip_reason
from helpers import ATTENTIONS, tiny_diffattn, tiny_hf


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, each worker's torch gets its share of the cores (at least one
    thread) instead of all of them. With two workers on two cores, two threads each meant four
    OpenMP threads spinning on two cores: a tiny model's 200 training steps took 181 s instead
    of 11 s while the other worker ran (tests/test_model.py's overfitting test, measured on
    this project's 2-core machine). Tests that need more threads set them themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        share = max(1, (cores or 1) // workers)
        if torch.get_num_threads() > share:
            torch.set_num_threads(share)


_share_the_cores_between_workers()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One data cache for the training tests of a session (BPE and shards built once)."""
    return tmp_path_factory.mktemp("train-data-cache")


@pytest.fixture
def one_thread():
    """Single-threaded torch for a test: the machine is small and shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_baseline():
    """A tiny diffattn Transformer baseline (see ``helpers.tiny_diffattn``)."""
    return tiny_diffattn("baseline")


@pytest.fixture
def tiny_diff_v1():
    """A tiny DIFF V1 model (see ``helpers.tiny_diffattn``)."""
    return tiny_diffattn("diff_v1")


@pytest.fixture
def tiny_diff_v2():
    """A tiny DIFF V2 model (see ``helpers.tiny_diffattn``)."""
    return tiny_diffattn("diff_v2")


@pytest.fixture(params=ATTENTIONS)
def tiny_diffattn_model(request):
    """A tiny diffattn model of each attention type in turn."""
    return tiny_diffattn(request.param)


@pytest.fixture
def tiny_llama():
    """A tiny Hugging Face ``LlamaForCausalLM`` (skipped without transformers)."""
    reason = skip_reason("hf")
    if reason is not None:
        pytest.skip(reason)
    return tiny_hf("llama")


def pytest_runtest_setup(item):
    """Tests marked ``gpu`` need CUDA, tests marked ``extra(name, ...)`` those extras: both are
    skipped where they are absent, the skip naming what is missing (``tests/extras.py``)."""
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for mark in item.iter_markers("extra"):
        if not mark.args:
            raise pytest.UsageError(f"{item.nodeid}: extra() names no extra")
        for name in mark.args:
            reason = skip_reason(name)
            if reason is not None:
                pytest.skip(reason)


# ----------------------------------------------------------------------------------------
# skips for a missing extra, recorded for a later stage of .ci/run
SKIPPED_LOG = "DIFFATTN_SKIPPED_LOG"
"""With this variable set to a file, every test (or module) skipped for a missing extra or
package is appended to it, one pytest node id a line: ``.ci/run`` runs the README's test
command with it, then only those tests once the extras are installed."""


def _record_skip(nodeid: str, reason: str) -> None:
    path = os.environ.get(SKIPPED_LOG)
    if not path or not reason.startswith("needs ") or reason.startswith("needs CUDA"):
        return
    with open(path, "a", encoding="utf-8") as log:  # one short line: a single append
        log.write(f"{nodeid}\n")


def _skip_reason_of(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_runtest_logreport(report):
    if report.skipped and report.when in ("setup", "call"):
        _record_skip(report.nodeid, _skip_reason_of(report))


def pytest_collectreport(report):
    if report.skipped:  # a module skipped before its imports (extras.require_extra)
        _record_skip(report.nodeid, _skip_reason_of(report))
