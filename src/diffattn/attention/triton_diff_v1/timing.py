"""CUDA-event timings of the Triton DIFF V1 op against the baseline's attention on PyTorch's
own SDPA choice (cuDNN on Hopper), forward and forward + backward.

The two ops do the same attention FLOPs: the baseline has ``2h`` heads of width d, DIFF V1
``h`` differential heads with Q1, Q2, K1, K2 at width d and V at 2d (``h·2d = d_model``).
Each ratio is the baseline's time over DIFF V1's, so 1.0 is the baseline's speed.

``python -m diffattn.attention.triton_diff_v1.timing`` prints the table of issue-sized runs
(bf16, 16K tokens per call, d_model 2048, d = 64 and 128, N = 4096 and 16384).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from diffattn.attention.triton_diff_v1.kernels import DQ_SWITCH
from diffattn.attention.triton_diff_v1.op import diff_v1_attention


def _milliseconds(step: Callable[[], None], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def time_against_sdpa(
    n: int = 4096,
    d: int = 64,
    d_model: int = 2048,
    tokens: int = 16384,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 3,
    repeats: int = 10,
    dq: str = "kernel",
) -> dict[str, float]:
    """Milliseconds per call of the Triton DIFF V1 op and of the baseline's causal SDPA, both
    forward and forward + backward, and their ratios (baseline / DIFF V1).

    ``tokens // n`` sequences of ``n`` tokens; the baseline has ``d_model / d`` heads of
    width d, DIFF V1 half as many with V at width 2d. The first calls autotune the kernels
    (in ``warmup``). ``dq`` picks the backward's dQ variant (``kernel`` or ``atomic``, see
    :func:`diffattn.attention.triton_diff_v1.kernels.dq_by_atomics`). Needs CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("time_against_sdpa times CUDA kernels and needs a CUDA device")
    if d_model % (2 * d) or tokens % n:
        raise ValueError(
            f"d_model={d_model} must be a multiple of 2·d={2 * d} and tokens={tokens} of n={n}"
        )
    bsz, heads = tokens // n, d_model // (2 * d)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()

    q1, q2, k1, k2 = (leaf(bsz, heads, n, d) for _ in range(4))
    v = leaf(bsz, heads, n, 2 * d)
    lam = torch.tensor(0.5, device="cuda", requires_grad=True)
    q, k, vb = (leaf(bsz, 2 * heads, n, d) for _ in range(3))
    grad = torch.randn(bsz, heads, n, 2 * d, device="cuda", dtype=dtype)
    grad_baseline = torch.randn(bsz, 2 * heads, n, d, device="cuda", dtype=dtype)

    def diff(backward: bool) -> Callable[[], None]:
        def step() -> None:
            out = diff_v1_attention(q1, q2, k1, k2, v, lam, None, 0, d**-0.5)
            if backward:
                out.backward(grad)

        return step

    def baseline(backward: bool) -> Callable[[], None]:
        def step() -> None:
            out = F.scaled_dot_product_attention(q, k, vb, is_causal=True)
            if backward:
                out.backward(grad_baseline)

        return step

    previous = os.environ.get(DQ_SWITCH)
    os.environ[DQ_SWITCH] = dq
    try:
        times = {
            "diff_v1_fwd_ms": _milliseconds(diff(False), warmup, repeats),
            "baseline_fwd_ms": _milliseconds(baseline(False), warmup, repeats),
            "diff_v1_fwd_bwd_ms": _milliseconds(diff(True), warmup, repeats),
            "baseline_fwd_bwd_ms": _milliseconds(baseline(True), warmup, repeats),
        }
    finally:
        if previous is None:
            del os.environ[DQ_SWITCH]
        else:
            os.environ[DQ_SWITCH] = previous
    times["fwd_ratio"] = times["baseline_fwd_ms"] / times["diff_v1_fwd_ms"]
    times["fwd_bwd_ratio"] = times["baseline_fwd_bwd_ms"] / times["diff_v1_fwd_bwd_ms"]
    return times


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA: the Triton DIFF V1 op is timed on a CUDA device only")
        return
    device = torch.cuda.get_device_name()
    print(f"Triton DIFF V1 op / baseline SDPA, bf16, 16K tokens per call, d_model 2048 ({device})")
    print("d | N | dQ | fwd ms (DIFF V1, baseline) | fwd+bwd ms | ratio fwd | ratio fwd+bwd")
    for d in (64, 128):
        for n in (4096, 16384):
            for dq in ("kernel", "atomic"):
                t = time_against_sdpa(n=n, d=d, dq=dq)
                print(
                    f"{d} | {n} | {dq} | {t['diff_v1_fwd_ms']:.3f}, {t['baseline_fwd_ms']:.3f} | "
                    f"{t['diff_v1_fwd_bwd_ms']:.3f}, {t['baseline_fwd_bwd_ms']:.3f} | "
                    f"{t['fwd_ratio']:.3f} | {t['fwd_bwd_ratio']:.3f}"
                )


if __name__ == "__main__":
    main()
