"""Launch configurations of the Triton DIFF V1 kernels and their shared-memory budget.

Pure Python (no Triton import), so the pruning rule is unit-tested without a GPU. Each kernel
keeps one block of rows for the whole program (the *fixed* block: the query block of the
forward and dQ kernels, the key block of the dK/dV kernel) and streams the other (the
*looped* block) through ``num_stages`` shared-memory buffers. A config's use is estimated
from those tiles (``rows × (2d + 2d)`` elements: Q1/Q2 or K1/K2 at width d and V or dO at
width 2d; the forward's fixed block holds only Q1 and Q2), the ``BLOCK_M × BLOCK_N``
probability tiles staged for the second dot of each map, and a margin for layout
conversions; configs above the device's limit are dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def interpreting() -> bool:
    """Whether Triton runs its kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


SHARED_MEMORY_MARGIN = 1.15
"""Factor over the tile sum: calibrated on the one failure measured on an H200 (triton 3.6,
d = 128, bf16, blocks 64 × 64, 3 stages): 272 KB reported, 240 KB of tiles estimated."""


@dataclass(frozen=True)
class LaunchConfig:
    """One launch configuration: query rows ``block_m``, key rows ``block_n`` per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class KernelTiles:
    """Which tiles of a kernel live in shared memory.

    ``fixed`` is ``"m"`` when the query block stays for the whole program (forward, dQ) and
    ``"n"`` when the key block does (dK/dV); ``fixed_width_2d`` whether the fixed block has a
    2d-wide tile besides its two d-wide ones (V or dO: not in the forward, whose fixed tiles
    are Q1 and Q2); ``staged_maps`` counts the ``BLOCK_M × BLOCK_N`` tiles that feed a second
    dot (P1, P2 in the forward; P, dS1, dS2 in dK/dV; dS1, dS2 in dQ).
    """

    name: str
    fixed: str
    fixed_width_2d: bool
    staged_maps: int


FORWARD = KernelTiles("forward", fixed="m", fixed_width_2d=False, staged_maps=2)
BACKWARD_KV = KernelTiles("backward dK/dV", fixed="n", fixed_width_2d=True, staged_maps=3)
BACKWARD_Q = KernelTiles("backward dQ", fixed="m", fixed_width_2d=True, staged_maps=2)

CANDIDATES = (
    LaunchConfig(128, 64, 8, 3),
    LaunchConfig(128, 64, 8, 2),
    LaunchConfig(128, 32, 8, 2),
    LaunchConfig(64, 64, 4, 3),
    LaunchConfig(64, 64, 4, 2),
    LaunchConfig(64, 32, 4, 3),
    LaunchConfig(64, 32, 4, 2),
    LaunchConfig(32, 32, 4, 2),
    LaunchConfig(32, 32, 4, 1),
)
"""Tried by the autotuner on a GPU (after pruning), for every kernel."""
BACKWARD_KV_CANDIDATES = tuple(
    LaunchConfig(c.block_n, c.block_m, c.num_warps, c.num_stages) for c in CANDIDATES
)
"""The dK/dV kernel's fixed block is the key block: the same shapes with the roles swapped."""
SMALLEST = LaunchConfig(16, 16, 4, 1)
"""The fallback when no candidate fits: the smallest tiles ``tl.dot`` takes, one stage."""
INTERPRETER = {
    FORWARD.name: LaunchConfig(32, 16, 4, 1),
    BACKWARD_KV.name: LaunchConfig(16, 32, 4, 1),
    BACKWARD_Q.name: LaunchConfig(32, 16, 4, 1),
}
"""The one config each kernel runs under ``TRITON_INTERPRET=1``: small (numpy speed) and
unequal blocks, so the tests cover the causal bounds where query and key blocks differ."""


def shared_memory_bytes(
    kernel: KernelTiles, config: LaunchConfig, d: int, dv: int, element_size: int
) -> int:
    """Estimated shared memory of ``kernel`` launched with ``config`` at head width ``d``,
    value width ``dv`` and inputs of ``element_size`` bytes (see the module docstring)."""
    fixed, looped = (
        (config.block_m, config.block_n)
        if kernel.fixed == "m"
        else (config.block_n, config.block_m)
    )
    row_elements = 2 * d + dv
    fixed_elements = row_elements if kernel.fixed_width_2d else 2 * d
    tiles = fixed * fixed_elements + max(1, config.num_stages) * looped * row_elements
    tiles += kernel.staged_maps * config.block_m * config.block_n
    return int(tiles * element_size * SHARED_MEMORY_MARGIN)


def fitting_configs(
    kernel: KernelTiles,
    candidates: tuple[LaunchConfig, ...] | list[LaunchConfig],
    d: int,
    dv: int,
    element_size: int,
    limit: int,
) -> list[LaunchConfig]:
    """The candidates whose estimate fits in ``limit`` bytes; if none does, :data:`SMALLEST`
    alone; if even that does not fit, a ``ValueError`` naming the kernel, width and limit."""
    fits = [c for c in candidates if shared_memory_bytes(kernel, c, d, dv, element_size) <= limit]
    if fits:
        return fits
    need = shared_memory_bytes(kernel, SMALLEST, d, dv, element_size)
    if need <= limit:
        return [SMALLEST]
    raise ValueError(
        f"the Triton DIFF V1 {kernel.name} kernel needs about {need} bytes of shared memory "
        f"at head width {d} ({element_size}-byte elements) with its smallest tiles, but the "
        f"device has {limit}; use backend='sdpa'"
    )
