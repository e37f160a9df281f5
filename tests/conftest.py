"""Shared fixtures: deterministic, single-threaded-friendly CPU runs."""

from __future__ import annotations

import pytest
import torch


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
