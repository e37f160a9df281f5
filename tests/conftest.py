"""Shared fixtures: deterministic, single-threaded-friendly CPU runs, and tiny models."""

from __future__ import annotations

import pytest
import torch

from helpers import ATTENTIONS, tiny_diffattn, tiny_hf


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
    pytest.importorskip("transformers")
    return tiny_hf("llama")


def pytest_runtest_setup(item):
    """Tests marked ``gpu`` need CUDA: skipped on machines without it."""
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
