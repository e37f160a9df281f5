"""The compiled CPU kernel of DIFF V1 Eq.1 (``csrc/diff_v1_cpu.cpp``): the fast path of the
``fused`` backend on the CPU.

**Algorithm.** One task per (batch row, KV head, tile of ``T`` query positions); the ``rep =
H / H_kv`` query heads of the KV group are the tile's rows (``R = T·rep`` rows), so K and V are
never repeated. A tile whose last query may read keys ``[0, e)`` keeps two ``R × e`` score
buffers, sized to stay in the core's cache::

    S_a = Q_a K_a[:e]ᵀ/√d                    (a = 1, 2; BLAS sgemm; tiles of ≤ 8 rows, such as
                                               decode steps, stream K and V once instead)
    P_a = exp(S_a − m_a) / Σ,  lse_a = m_a + log Σ    (one vectorised pass per row)
    O   = (P1 − λ·P2) V[:e]                  (one sgemm: V read once for both maps)

Backward recomputes ``P_a = exp(S_a − lse_a)`` from the saved ``lse`` (no max or sum pass) and,
with ``G = dO``::

    dP = G V[:e]ᵀ,   r_a = rowsum(dP ∘ P_a),   dλ = −Σ r2
    dV[:e] += (P1 − λ·P2)ᵀ G
    dS1 = P1 ∘ (dP − r1),   dS2 = −λ·P2 ∘ (dP − r2)
    dQ_a = dS_a K_a[:e]/√d,   dK_a[:e] += dS_aᵀ Q_a/√d

**Cost** per differential head, with ``M = Σ_tiles R·e ≈ N²/2 + N·T/2`` score entries (causal):
forward ``8·M·d`` FLOPs (two QKᵀ at width d, one PV at width 2d) and ``2·M`` exponentials;
backward ``20·M·d`` FLOPs and ``2·M`` exponentials: the FLOPs of a baseline head pair under
FlashAttention-2's recompute, never the ``16·M·d`` forward of Q/K zero-padded to 2d. Memory
traffic: Q, O and dO once per tile; K and V once per tile of their head (``(N/T)·e`` rows: the
price of tiling over queries only); the score buffers (2 forward, 4 backward, ``R × S`` fp32
each) stay in cache; saved for backward: the inputs and two ``lse`` rows, ``O(N)``.

**Parallelism and determinism.** Tiles are split into one list per intra-op thread, longest
first to the least-loaded list (causal tiles grow with their row), and each list runs
single-threaded BLAS. Key-side gradients accumulate per list and are summed in list order, so a
run is bitwise reproducible for a given thread count.

**Masking**: the rule of :class:`~diffattn.attention.mask.AttentionMask` (causal with a query
offset, key padding with the diagonal kept). Full custom masks (``allowed``) are not taken:
the ``fused`` backend runs those on its blocked PyTorch path.

**Build.** Compiled on first use with ``torch.utils.cpp_extension`` (a C++17 compiler is
needed; the build is cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, and rebuilt when the source or flags change), for the CPU
capability PyTorch reports (AVX2 flags on AVX2 and AVX-512 machines, portable code elsewhere).
``DIFFATTN_CPU_KERNEL=0`` switches it off. When it cannot be built, :func:`unavailable` says why
and the ``fused`` backend falls back to its PyTorch path (logged once).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "diff_v1_cpu.cpp"
ENV_SWITCH = "DIFFATTN_CPU_KERNEL"
TILE_ROWS = 64
"""Target rows per tile (query positions × group size): with ``S`` keys the backward's four
buffers hold ``4·TILE_ROWS·S`` fp32 values (2 MiB at S = 2048). 32 and 128 rows timed within
the noise of 64 at S = 2048; 64 was fastest at S = 8192."""

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "error": None}


def _flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp"]
    if capability in ("AVX2", "AVX512"):
        return [*flags, "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"]
    return [*flags, "-DCPU_CAPABILITY=DEFAULT"]


def _build_name() -> str:
    capability = torch.backends.cpu.get_cpu_capability().lower().replace(" ", "_")
    return f"diffattn_diff_v1_cpu_{capability}"


def unavailable() -> str | None:
    """Why the compiled kernel cannot run here (switched off, no compiler, build error), or
    ``None`` once it is built and registered. The first call builds it."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
        return f"switched off by {ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    if _state["loaded"]:  # every call after the first: no lock on the hot path
        return None
    with _lock:
        if not _state["loaded"] and _state["error"] is None:
            try:
                from torch.utils import cpp_extension

                _wait_for_other_builds()
                logging.getLogger("diffattn.kernels").info(
                    "building the compiled DIFF V1 CPU kernel (first use; cached under "
                    "TORCH_EXTENSIONS_DIR)"
                )

                cpp_extension.load(
                    name=_build_name(),
                    sources=[str(SOURCE)],
                    extra_cflags=_flags(),
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
                _state["loaded"] = True
            except Exception as error:  # no compiler, no ninja, a build or link error
                _state["error"] = f"could not build {SOURCE.name}: {error}".strip()
    return None if _state["loaded"] else str(_state["error"])


STALE_LOCK_SECONDS = 600.0
"""A build directory's lock older than this was left by an interrupted build (a build takes
about 25 s, minutes on a loaded machine)."""


def _wait_for_other_builds() -> None:
    """Wait while another process builds the kernel; raise if its lock is stale.

    ``torch.utils.cpp_extension`` waits without limit for the lock file of its build
    directory, so a build killed midway would hang every later first call; since ``auto``
    runs DIFF V1 on this kernel by default, a stale lock must become a reason to fall back
    (with the path to delete), not a hang."""
    from torch.utils import cpp_extension

    lock = Path(cpp_extension._get_build_directory(_build_name(), False)) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            raise RuntimeError(
                f"the build lock {lock} is {age / 60:.0f} minutes old (an interrupted build); "
                "delete it to build the kernel"
            )
        time.sleep(0.5)


def tile_positions(rep: int) -> int:
    """Query positions per tile for a GQA group of ``rep`` query heads."""
    return max(1, TILE_ROWS // max(1, rep))


def forward(
    q1s, q2s, k1, k2, v, lam: float, scale: float, rep: int, offset: int, key_padding, documents
):
    """``(out, lse1, lse2)`` for grouped, contiguous fp32 queries ``(B, H_kv, N·rep, d)``,
    fp32 k ``(B, H_kv, S, d)`` and v ``(B, H_kv, S, dv)`` (any batch and head strides, rows of
    contiguous features); key_padding ``(B, S)`` uint8 or ``None``; documents ``(B, S)`` int64
    (packed rows: a query reads its own document only) or ``None``. Call :func:`unavailable`
    first."""
    return torch.ops.diffattn_cpu.diff_v1_forward(
        q1s, q2s, k1, k2, v, lam, scale, rep, offset, key_padding, documents, tile_positions(rep)
    )


def backward(
    tensors: tuple, lam: float, scale: float, rep: int, offset: int, key_padding, documents
):
    """``[dq1s, dq2s, dk1, dk2, dv, dλ]`` for ``tensors = (dO rows, q1s, q2s, k1, k2, v, lse1,
    lse2)`` in the layouts of :func:`forward`; dλ is a 0-d fp64 tensor."""
    op = torch.ops.diffattn_cpu.diff_v1_backward
    return op(*tensors, lam, scale, rep, offset, key_padding, documents, tile_positions(rep))
