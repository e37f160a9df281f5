"""The ``triton`` DIFF V1 backend: its kernel cases (``triton_v1_cases.py``) run in a child
process under ``TRITON_INTERPRET=1`` (set before triton is imported there; CPU, small shapes),
and on CUDA where there is a GPU; the shared-memory pruning of its launch configurations; the
registry entry and its availability rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffattn.attention import kernels, registry
from diffattn.attention.triton_diff_v1 import configs

CASES = Path(__file__).with_name("triton_v1_cases.py")
H100_SHARED_MEMORY = 232448  # 227 KB: what Triton reports for an H100 / H200


def _run_cases(interpret: bool, *selection: str, autotune: bool = True, dq: str = "kernel") -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["DIFFATTN_TRITON_DQ"] = dq
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if not autotune:
        env["DIFFATTN_TRITON_AUTOTUNE"] = "0"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    result = subprocess.run(
        [*command, *selection], env=env, cwd=CASES.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@pytest.mark.extra("triton")
@pytest.mark.parametrize(
    "selection",
    [
        "matches_reference and not 129",
        "matches_reference and 129",
        "every_head_width",
        "strided or synchronisation or compiled or opcheck or bad_lambda or wrong_shape",
        "packed_documents",
        "a_model_trains",
    ],
)
def test_triton_kernels_under_the_interpreter(selection):
    _run_cases(True, "-k", selection)


@pytest.mark.extra("triton")
def test_dq_by_atomics_under_the_interpreter():
    _run_cases(True, "-k", "every_head_width and 64 or offset or 129-left-2", dq="atomic")


@pytest.mark.extra("triton")
def test_an_unknown_dq_variant_is_one_clear_error(monkeypatch):
    from diffattn.attention.triton_diff_v1 import kernels as triton_kernels

    monkeypatch.setenv("DIFFATTN_TRITON_DQ", "atomics")
    with pytest.raises(ValueError, match="DIFFATTN_TRITON_DQ must be 'kernel' or 'atomic'"):
        triton_kernels.dq_by_atomics()


@pytest.mark.extra("triton")
@pytest.mark.slow
def test_triton_kernels_at_the_papers_widths_over_many_tiles_under_the_interpreter():
    _run_cases(True, "-k", "many_tiles")


@pytest.mark.extra("triton")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_on_cuda():
    """Every case on the GPU, each kernel on the first config that fits its shared memory
    (timing every candidate for each of the cases' many shapes would take minutes), then
    the head widths and dtypes again with the autotuner choosing."""
    _run_cases(False, autotune=False)
    _run_cases(False, "-k", "every_head_width")
    _run_cases(False, "-k", "every_head_width or offset or many_tiles", dq="atomic")


def _fits(kernel, d, dtype_size, limit, candidates=configs.CANDIDATES):
    return configs.fitting_configs(kernel, candidates, d, 2 * d, dtype_size, limit)


@pytest.mark.parametrize("kernel", [configs.FORWARD, configs.BACKWARD_KV, configs.BACKWARD_Q])
def test_pruning_keeps_only_configs_that_fit(kernel):
    for limit in (H100_SHARED_MEMORY, 100 * 1024):
        kept = _fits(kernel, 128, 2, limit)
        assert kept and all(
            configs.shared_memory_bytes(kernel, c, 128, 256, 2) <= limit for c in kept
        )
        dropped = set(configs.CANDIDATES) - set(kept)
        assert all(configs.shared_memory_bytes(kernel, c, 128, 256, 2) > limit for c in dropped)
    # d = 128 in bf16 cannot take the largest tiles on either device; d = 32 takes them all
    assert configs.CANDIDATES[0] not in _fits(kernel, 128, 2, H100_SHARED_MEMORY)
    assert _fits(kernel, 32, 2, H100_SHARED_MEMORY) == list(configs.CANDIDATES)
    # a smaller device keeps fewer configs, fp32 fewer than bf16
    assert len(_fits(kernel, 128, 2, 100 * 1024)) < len(_fits(kernel, 128, 2, H100_SHARED_MEMORY))
    assert len(_fits(kernel, 128, 4, H100_SHARED_MEMORY)) < len(
        _fits(kernel, 128, 2, H100_SHARED_MEMORY)
    )


def test_the_measured_failure_is_pruned():
    """The launch that failed on an H200 (d = 128, bf16, blocks of 64, 3 stages: 272 KB of
    shared memory) is estimated over the limit; the same blocks with 2 stages fit."""
    failed = configs.LaunchConfig(64, 64, 4, 3)
    assert configs.shared_memory_bytes(configs.FORWARD, failed, 128, 256, 2) > H100_SHARED_MEMORY
    two_stages = configs.LaunchConfig(64, 64, 4, 2)
    assert (
        configs.shared_memory_bytes(configs.FORWARD, two_stages, 128, 256, 2) <= H100_SHARED_MEMORY
    )


def test_pruning_falls_back_to_the_smallest_tiles_then_fails_clearly():
    big = (configs.LaunchConfig(128, 128, 8, 4),)
    small_limit = configs.shared_memory_bytes(configs.FORWARD, configs.SMALLEST, 128, 256, 4)
    assert _fits(configs.FORWARD, 128, 4, small_limit, big) == [configs.SMALLEST]
    with pytest.raises(ValueError, match=r"shared memory.*head width 128"):
        _fits(configs.FORWARD, 128, 4, small_limit - 1, big)


@pytest.mark.extra("triton")
def test_the_autotuners_pruner_asks_the_device_and_prunes(monkeypatch):
    from diffattn.attention.triton_diff_v1 import kernels as triton_kernels

    asked = []

    def limit(device_index):
        asked.append(device_index)
        return 100 * 1024

    monkeypatch.setattr(triton_kernels, "_shared_memory_limit", limit)
    candidates = [triton_kernels._as_triton_config(c) for c in configs.CANDIDATES]
    prune = triton_kernels.shared_memory_pruner(configs.BACKWARD_KV)
    kept = prune(candidates, {"q1_ptr": torch.empty(1, dtype=torch.bfloat16)}, D=128, DV=256)
    expected = _fits(configs.BACKWARD_KV, 128, 2, 100 * 1024)
    assert [triton_kernels._as_launch_config(c) for c in kept] == expected
    assert asked == [0] and 0 < len(kept) < len(candidates)
    monkeypatch.setenv("DIFFATTN_TRITON_AUTOTUNE", "0")
    first = prune(candidates, {"q1_ptr": torch.empty(1, dtype=torch.bfloat16)}, D=128, DV=256)
    assert [triton_kernels._as_launch_config(c) for c in first] == expected[:1]


def test_every_width_and_dtype_has_a_config_on_a_100_kb_device():
    for d in (32, 64, 128):
        for size in (2, 4):
            for kernel in (configs.FORWARD, configs.BACKWARD_KV, configs.BACKWARD_Q):
                assert _fits(kernel, d, size, 100 * 1024)


@pytest.mark.extra("triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_timing_says_it_needs_cuda(capsys):
    from diffattn.attention.triton_diff_v1 import timing

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        timing.time_against_sdpa()
    timing.main()
    assert capsys.readouterr().out.startswith("no CUDA")


def test_registry_lists_triton_and_says_when_it_cannot_run():
    assert "triton" in registry.backend_names()
    backend = registry.get_backend("triton")
    assert backend.diff_v1 is not None and not backend.custom_masks
    cpu = torch.randn(1, 1, 2, 16)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="triton"):
            kernels.resolve_backend("triton", cpu)
