"""Shared fixtures: deterministic, single-threaded-friendly CPU runs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
