"""The compute dtype of a run: bf16 autocast for ``dtype: bf16`` (and ``auto`` on CUDA)."""

from __future__ import annotations

import contextlib

import torch


def compute_dtype(device: torch.device, dtype: str) -> torch.dtype:
    """The autocast dtype of a run: ``bf16``, or ``auto`` on CUDA, is bf16; else fp32."""
    bf16 = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    return torch.bfloat16 if bf16 else torch.float32


def autocast(device: torch.device, dtype: str):
    if compute_dtype(device, dtype) == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
