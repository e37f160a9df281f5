"""The ``triton`` DIFF V1 backend: its kernel cases (``triton_v1_cases.py``) run in a child
process under ``TRITON_INTERPRET=1`` (set before triton is imported there; CPU, small shapes),
and on CUDA where there is a GPU; the registry entry and its availability rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffattn.attention import kernels, registry

CASES = Path(__file__).with_name("triton_v1_cases.py")


def _run_cases(interpret: bool, *selection: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    result = subprocess.run(
        [*command, *selection], env=env, cwd=CASES.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@pytest.mark.extra("triton")
@pytest.mark.parametrize("selection", ["not 129 and not half", "129", "half"])
def test_triton_kernels_under_the_interpreter(selection):
    _run_cases(True, "-k", selection)


@pytest.mark.extra("triton")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_on_cuda():
    _run_cases(False)


def test_registry_lists_triton_and_says_when_it_cannot_run():
    assert "triton" in registry.backend_names()
    backend = registry.get_backend("triton")
    assert backend.diff_v1 is not None and not backend.custom_masks
    cpu = torch.randn(1, 1, 2, 16)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="triton"):
            kernels.resolve_backend("triton", cpu)
