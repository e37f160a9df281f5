"""Peak FLOP rates and model FLOPs utilisation (MFU) for ``diffattn bench``.

``MFU = model FLOPs per token × tokens/s ÷ peak FLOP/s``, with the model FLOPs of
:mod:`diffattn.flops` (DIFF V1 counted with QK once, whatever the kernel computes, so MFU
measures useful work) and the dense peak of the device for the dtype the matmuls run in.

The table holds the vendors' dense (no sparsity) peaks of a few data-centre GPUs; fp32 is the
plain fp32 rate, since PyTorch does not use TF32 for matmuls unless asked
(``torch.backends.cuda.matmul.allow_tf32``). Any other device, the CPU included, needs
``--peak-tflops``; without it MFU is left out (``null`` in JSON).
"""

from __future__ import annotations

import torch

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # name fragment (lower case, as in torch.cuda.get_device_name): dtype -> dense TFLOP/s
    "h200": {"bf16": 989.4, "fp32": 66.9},
    "h100 pcie": {"bf16": 756.0, "fp32": 51.2},
    "h100": {"bf16": 989.4, "fp32": 66.9},  # SXM; checked after the PCIe entry
    "a100": {"bf16": 312.0, "fp32": 19.5},
}


def device_name(device: str) -> str:
    """A readable name of the device: the CUDA device's name, or ``cpu``."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return device


def peak_tflops(name: str, dtype: str, override: float | None = None) -> float | None:
    """Dense peak TFLOP/s of device ``name`` in ``dtype`` (``override`` if given), or ``None``."""
    if override is not None:
        return float(override)
    lowered = name.lower()
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in lowered:
            return peaks.get(dtype)
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or ``None`` without a peak."""
    if peak is None:
        return None
    return flops_per_token * tokens_per_s / (peak * 1e12)
