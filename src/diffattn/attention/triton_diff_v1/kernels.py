"""The Triton kernels of DIFF V1 (Eq.1) and their launches: ``forward`` and ``backward``.

Imports ``triton``; set ``TRITON_INTERPRET=1`` before importing it to run the kernels on the
CPU with numpy (one small launch configuration, see :mod:`.configs`). The algorithm is
described in the package docstring (:mod:`diffattn.attention.triton_diff_v1`).

Loops whose bounds are runtime values are written twice behind the ``LOOP_AS_WHILE``
constexpr: a ``for`` loop (software-pipelined by Triton on a GPU) and, under the interpreter,
an equivalent ``while`` loop. Triton's interpreter up to 3.6 converts a runtime loop bound
with ``int()`` of a one-element array, which NumPy ≥ 2.4 refuses; its ``while`` condition
takes ``bool()``, which NumPy allows.

This module has no ``from __future__ import annotations``: the interpreter of Triton 3.0 and
3.1 recognises a ``tl.constexpr`` parameter only by its evaluated annotation.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from diffattn.attention.triton_diff_v1 import configs
from diffattn.attention.triton_diff_v1.configs import interpreting

DOT_TYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
AUTOTUNE_SWITCH = "DIFFATTN_TRITON_AUTOTUNE"
"""Set to ``0`` to launch the first config that fits instead of timing them all (quick
correctness runs on a GPU: each new key otherwise compiles and times every candidate)."""
DQ_SWITCH = "DIFFATTN_TRITON_DQ"
"""``kernel`` (default) or ``atomic``: how the backward computes dQ (:func:`dq_by_atomics`)."""
AUTOTUNE_KEY = ["D", "DV", "HAS_SEGMENTS", "q_class"]
"""Autotuning is redone per head width, key segments (padding or packed documents) and
query-count class (Triton adds the tensors' dtypes); ``q_class`` is the number of queries
rounded up to a power of two, at most 128, so decode steps (one query) and prefills tune apart
but growing caches do not retune."""


@functools.cache
def _shared_memory_limit(device_index: int) -> int:
    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(properties["max_shared_mem"])


def _as_launch_config(config: triton.Config) -> configs.LaunchConfig:
    blocks = config.kwargs
    return configs.LaunchConfig(
        blocks["BLOCK_M"], blocks["BLOCK_N"], config.num_warps, config.num_stages
    )


def _as_triton_config(config: configs.LaunchConfig) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n},
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def shared_memory_pruner(tiles: configs.KernelTiles):
    """The autotuner's ``early_config_prune`` for a kernel: keeps the configs that
    :func:`configs.fitting_configs` fits in the shared memory of the device of ``q1`` (only
    the first of them, so nothing is timed, when ``DIFFATTN_TRITON_AUTOTUNE=0``)."""

    def prune(triton_configs, named_args, **kwargs):
        tune = os.environ.get(AUTOTUNE_SWITCH, "1") != "0"
        first = named_args["q1_ptr"]
        limit = _shared_memory_limit(first.device.index or 0)
        fits = configs.fitting_configs(
            tiles,
            [_as_launch_config(c) for c in triton_configs],
            kwargs["D"],
            kwargs["DV"],
            first.element_size(),
            limit,
        )
        return [_as_triton_config(c) for c in (fits if tune else fits[:1])]

    return prune


class _FixedLaunch:
    """A kernel launched with one config, ``kernel[grid](...)`` as an autotuned one is."""

    def __init__(self, kernel, config: configs.LaunchConfig) -> None:
        self.kernel, self.config = kernel, config

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            blocks = {"BLOCK_M": self.config.block_m, "BLOCK_N": self.config.block_n}
            return self.kernel[grid](*args, **kwargs, **blocks)

        return launch


class _Autotuned:
    """``triton.autotune`` over ``candidates`` pruned by the device's shared memory, built at
    the first launch: Triton 3.2 and 3.3 need a GPU driver to build an autotuner, so a
    module-level one would make importing this module fail on a machine without a GPU."""

    def __init__(self, kernel, tiles: configs.KernelTiles, candidates, zeroed) -> None:
        self.kernel, self.tiles, self.candidates, self.zeroed = kernel, tiles, candidates, zeroed

    @functools.cached_property
    def tuner(self):
        return triton.autotune(
            configs=[_as_triton_config(c) for c in self.candidates],
            key=AUTOTUNE_KEY,
            prune_configs_by={"early_config_prune": shared_memory_pruner(self.tiles)},
            reset_to_zero=list(self.zeroed) or None,
        )(self.kernel)

    def __getitem__(self, grid):
        return self.tuner[grid]


def _autotuned(
    tiles: configs.KernelTiles,
    candidates: tuple[configs.LaunchConfig, ...],
    zeroed: tuple[str, ...] = (),
):
    """Autotuned launches on a device (:class:`_Autotuned`). Under the interpreter there is
    no device to time or ask: the one small config of :data:`configs.INTERPRETER` is
    launched directly. ``zeroed`` names the accumulated outputs that each timed run must
    start from zero."""
    if interpreting():
        return lambda kernel: _FixedLaunch(kernel, configs.INTERPRETER[tiles.name])
    return lambda kernel: _Autotuned(kernel, tiles, candidates, zeroed)


@triton.jit
def _allowed(offs_m, offs_n, n_q, n_k, offset, seg_ptr, HAS_SEGMENTS: tl.constexpr):
    # mask.py's rule: j ≤ i + offset, and (query and key j in one segment or j = i + offset).
    # Segments (B, S) int32: 0 for padding, one positive value per document (1 for every real
    # token of a row that packs one document), so "one segment" is "both real, same document".
    q_pos = offs_m + offset
    ok = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < n_k) & (offs_m[:, None] < n_q)
    if HAS_SEGMENTS:
        seg_k = tl.load(seg_ptr + offs_n, mask=offs_n < n_k, other=0)
        seg_q = tl.load(seg_ptr + q_pos, mask=offs_m < n_q, other=0)
        pair = (seg_k[None, :] == seg_q[:, None]) & (seg_q[:, None] != 0)
        ok = ok & (pair | (offs_n[None, :] == q_pos[:, None]))
    return ok


@triton.jit
def _tile(base, offs_r, n_rows, stride_r, offs_c, WIDTH: tl.constexpr, DOT: tl.constexpr):
    # Rows offs_r of one head (at `base`, rows `stride_r` apart, columns contiguous),
    # zero-padded past n_rows and WIDTH.
    mask = (offs_r[:, None] < n_rows) & (offs_c[None, :] < WIDTH)
    offsets = offs_r[:, None] * stride_r + offs_c[None, :]
    return tl.load(base + offsets, mask=mask, other=0.0).to(DOT)


@triton.jit
def _store_tile(ptr, head, offs_r, n_rows, offs_c, WIDTH: tl.constexpr, value):
    mask = (offs_r[:, None] < n_rows) & (offs_c[None, :] < WIDTH)
    offsets = (head * n_rows + offs_r[:, None]) * WIDTH + offs_c[None, :]
    tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _query_offset(offset, offset_ptr, OFFSET_IN_MEMORY: tl.constexpr):
    if OFFSET_IN_MEMORY:  # a 0-d tensor (static-cache decoding): read on the device
        return tl.load(offset_ptr).to(tl.int32)
    else:
        return offset


@triton.jit
def _kv_head(
    k1_ptr, k2_ptr, v_ptr, lam_ptr, offset_ptr, b, kv_head, skb, skh, svb, svh, scale, offset,
    OFFSET_IN_MEMORY: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # What every kernel reads first for KV head `kv_head` of batch row `b`: its K1/K2/V
    # bases, the query offset, λ, the base-2 score scale and the column offsets of the
    # K (and Q) and V tiles.
    k1_ptr += b * skb + kv_head * skh
    k2_ptr += b * skb + kv_head * skh
    v_ptr += b * svb + kv_head * svh
    offset = _query_offset(offset, offset_ptr, OFFSET_IN_MEMORY)
    lam = tl.load(lam_ptr).to(tl.float32)
    qk_scale = scale * 1.4426950408889634
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    return k1_ptr, k2_ptr, v_ptr, offset, lam, qk_scale, offs_d, offs_v


@triton.jit
def _query_block(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, lam_ptr, offset_ptr, sqb, sqh, sqn, skb, skh,
    svb, svh, scale, n_q, offset,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, OFFSET_IN_MEMORY: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    # What the forward and the dQ kernel start from, one program per (query block, query
    # head): the block and head, the head's K1/K2/V bases, the query offset, λ, the base-2
    # score scale, the row and column offsets and the block's Q1, Q2 tiles. Inputs may be
    # strided views (rows and heads apart); outputs are contiguous.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q1_ptr += b * sqb + h * sqh
    q2_ptr += b * sqb + h * sqh
    k1_ptr, k2_ptr, v_ptr, offset, lam, qk_scale, offs_d, offs_v = _kv_head(
        k1_ptr, k2_ptr, v_ptr, lam_ptr, offset_ptr, b, h // REP, skb, skh, svb, svh, scale,
        offset, OFFSET_IN_MEMORY, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q1 = _tile(q1_ptr, offs_m, n_q, sqn, offs_d, D, DOT)
    q2 = _tile(q2_ptr, offs_m, n_q, sqn, offs_d, D, DOT)
    return (
        pid_m, pid_bh, b, h, k1_ptr, k2_ptr, v_ptr, offset, lam, qk_scale, offs_m, offs_d,
        offs_v, q1, q2,
    )  # fmt: skip


@triton.jit
def _fwd_step(
    start_n, q1, q2, acc1, acc2, m1, m2, l1, l2, k1_ptr, k2_ptr, v_ptr, skn, svn, seg,
    offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    # One key tile of both online softmaxes (base 2: scores carry the factor log2 e).
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k1 = _tile(k1_ptr, offs_n, n_k, skn, offs_d, D, DOT)
    k2 = _tile(k2_ptr, offs_n, n_k, skn, offs_d, D, DOT)
    v = _tile(v_ptr, offs_n, n_k, svn, offs_v, DV, DOT)
    s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) * qk_scale
    s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION) * qk_scale
    if MASKED:
        ok = _allowed(offs_m, offs_n, n_q, n_k, offset, seg, HAS_SEGMENTS)
        s1 = tl.where(ok, s1, float("-inf"))
        s2 = tl.where(ok, s2, float("-inf"))
    new1 = tl.maximum(m1, tl.max(s1, 1))
    new2 = tl.maximum(m2, tl.max(s2, 1))
    safe1 = tl.where(new1 == float("-inf"), 0.0, new1)
    safe2 = tl.where(new2 == float("-inf"), 0.0, new2)
    p1 = tl.exp2(s1 - safe1[:, None])
    p2 = tl.exp2(s2 - safe2[:, None])
    alpha1 = tl.exp2(m1 - safe1)
    alpha2 = tl.exp2(m2 - safe2)
    l1 = l1 * alpha1 + tl.sum(p1, 1)
    l2 = l2 * alpha2 + tl.sum(p2, 1)
    acc1 = acc1 * alpha1[:, None] + tl.dot(p1.to(DOT), v, input_precision=PRECISION)
    acc2 = acc2 * alpha2[:, None] + tl.dot(p2.to(DOT), v, input_precision=PRECISION)
    return acc1, acc2, new1, new2, l1, l2


@triton.jit
def _fwd_loop(
    lo, hi, q1, q2, acc1, acc2, m1, m2, l1, l2, k1_ptr, k2_ptr, v_ptr, skn, svn, seg,
    offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
    LOOP_AS_WHILE: tl.constexpr,
):  # fmt: skip
    if LOOP_AS_WHILE:
        start_n = lo
        while start_n < hi:
            acc1, acc2, m1, m2, l1, l2 = _fwd_step(
                start_n, q1, q2, acc1, acc2, m1, m2, l1, l2, k1_ptr, k2_ptr, v_ptr, skn, svn, seg,
                offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
                D, DV, BLOCK_N, MASKED, HAS_SEGMENTS, PRECISION, DOT,
            )  # fmt: skip
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc1, acc2, m1, m2, l1, l2 = _fwd_step(
                start_n, q1, q2, acc1, acc2, m1, m2, l1, l2, k1_ptr, k2_ptr, v_ptr, skn, svn, seg,
                offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
                D, DV, BLOCK_N, MASKED, HAS_SEGMENTS, PRECISION, DOT,
            )  # fmt: skip
    return acc1, acc2, m1, m2, l1, l2


@triton.jit
def _key_bounds(pid_m, n_k, offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Keys [0, full) are allowed (causally) for every row of query block pid_m; keys
    # [full, hi) need the mask; none past hi is allowed.
    full = ((pid_m * BLOCK_M + offset + 1) // BLOCK_N) * BLOCK_N
    full = tl.minimum(full, (n_k // BLOCK_N) * BLOCK_N)
    hi = tl.minimum(n_k, (pid_m + 1) * BLOCK_M + offset)
    return full, hi


@_autotuned(configs.FORWARD, configs.CANDIDATES)
@triton.jit(do_not_specialize=["offset"])
def _diff_v1_fwd(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, lam_ptr, seg_ptr, offset_ptr,
    o_ptr, o2_ptr, l1_ptr, l2_ptr,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    scale, n_q, n_k, offset, q_class,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    OFFSET_IN_MEMORY: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
    LOOP_AS_WHILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    (
        pid_m, pid_bh, b, _h, k1_ptr, k2_ptr, v_ptr, offset, lam, qk_scale, offs_m, offs_d,
        offs_v, q1, q2,
    ) = _query_block(
        q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, lam_ptr, offset_ptr, sqb, sqh, sqn, skb, skh,
        svb, svh, scale, n_q, offset,
        H, REP, D, BLOCK_D, BLOCK_DV, OFFSET_IN_MEMORY, DOT, BLOCK_M,
    )  # fmt: skip
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    seg = seg_ptr + b * n_k
    full, hi = _key_bounds(pid_m, n_k, offset, BLOCK_M, BLOCK_N)
    acc1, acc2, m1, m2, l1, l2 = _fwd_loop(
        0, full, q1, q2, acc1, acc2, m1, m2, l1, l2, k1_ptr, k2_ptr, v_ptr, skn, svn, seg,
        offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
        D, DV, BLOCK_N, HAS_SEGMENTS, HAS_SEGMENTS, PRECISION, DOT, LOOP_AS_WHILE,
    )  # fmt: skip
    acc1, acc2, m1, m2, l1, l2 = _fwd_loop(
        full, hi, q1, q2, acc1, acc2, m1, m2, l1, l2, k1_ptr, k2_ptr, v_ptr, skn, svn, seg,
        offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
        D, DV, BLOCK_N, True, HAS_SEGMENTS, PRECISION, DOT, LOOP_AS_WHILE,
    )  # fmt: skip
    l1 = tl.where(l1 == 0.0, 1.0, l1)
    l2 = tl.where(l2 == 0.0, 1.0, l2)
    o2 = acc2 / l2[:, None]
    _store_tile(o_ptr, pid_bh, offs_m, n_q, offs_v, DV, acc1 / l1[:, None] - lam * o2)
    _store_tile(o2_ptr, pid_bh, offs_m, n_q, offs_v, DV, o2)
    row = pid_bh * n_q + offs_m
    tl.store(l1_ptr + row, m1 + tl.log2(l1), mask=offs_m < n_q)  # base-2 logsumexps
    tl.store(l2_ptr + row, m2 + tl.log2(l2), mask=offs_m < n_q)


@triton.jit
def _probs_and_dp(
    q1, q2, k1, k2, v, do, row, offs_m, offs_n, n_q, n_k, offset, seg, qk_scale,
    l1_ptr, l2_ptr, r1_ptr, r2_ptr,
    MASKED: tl.constexpr, HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # The recomputed maps of one (query block, key block) tile, dS1 and dS2 / (−λ), both
    # per unit of the scaled scores.
    row_ok = offs_m < n_q
    lse1 = tl.load(l1_ptr + row, mask=row_ok, other=0.0)
    lse2 = tl.load(l2_ptr + row, mask=row_ok, other=0.0)
    r1 = tl.load(r1_ptr + row, mask=row_ok, other=0.0)
    r2 = tl.load(r2_ptr + row, mask=row_ok, other=0.0)
    s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) * qk_scale
    s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION) * qk_scale
    p1 = tl.exp2(s1 - lse1[:, None])
    p2 = tl.exp2(s2 - lse2[:, None])
    if MASKED:
        ok = _allowed(offs_m, offs_n, n_q, n_k, offset, seg, HAS_SEGMENTS)
        p1 = tl.where(ok, p1, 0.0)
        p2 = tl.where(ok, p2, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds1 = p1 * (dp - r1[:, None])
    ds2 = p2 * (dp - r2[:, None])
    return p1, p2, ds1, ds2


@triton.jit
def _kv_step(
    start_m, bh, k1, k2, v, dk1, dk2, dv, lam, q1_ptr, q2_ptr, do_ptr, sqn, son,
    l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_n, offs_d, offs_v, n_q, n_k, offset, qk_scale,
    dq1_ptr, dq2_ptr, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q1 = _tile(q1_ptr, offs_m, n_q, sqn, offs_d, D, DOT)
    q2 = _tile(q2_ptr, offs_m, n_q, sqn, offs_d, D, DOT)
    do = _tile(do_ptr, offs_m, n_q, son, offs_v, DV, DOT)
    p1, p2, ds1, ds2 = _probs_and_dp(
        q1, q2, k1, k2, v, do, bh * n_q + offs_m, offs_m, offs_n, n_q, n_k, offset, seg,
        qk_scale, l1_ptr, l2_ptr, r1_ptr, r2_ptr, MASKED, HAS_SEGMENTS, PRECISION,
    )  # fmt: skip
    p = (p1 - lam * p2).to(DOT)
    dv += tl.dot(tl.trans(p), do, input_precision=PRECISION)
    dk1 += tl.dot(tl.trans(ds1.to(DOT)), q1, input_precision=PRECISION)
    dk2 += tl.dot(tl.trans(ds2.to(DOT)), q2, input_precision=PRECISION)
    if DQ_ATOMIC:  # this key block's share of dQ, added into fp32 buffers
        dq_mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < D)
        dq_off = (bh * n_q + offs_m[:, None]) * D + offs_d[None, :]
        dq1 = tl.dot(ds1.to(DOT), k1, input_precision=PRECISION) * scale
        dq2 = tl.dot(ds2.to(DOT), k2, input_precision=PRECISION) * (-lam * scale)
        tl.atomic_add(dq1_ptr + dq_off, dq1, mask=dq_mask)
        tl.atomic_add(dq2_ptr + dq_off, dq2, mask=dq_mask)
    return dk1, dk2, dv


@triton.jit
def _kv_loop(
    lo, hi, bh, k1, k2, v, dk1, dk2, dv, lam, q1_ptr, q2_ptr, do_ptr, sqn, son,
    l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_n, offs_d, offs_v, n_q, n_k, offset, qk_scale,
    dq1_ptr, dq2_ptr, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):  # fmt: skip
    if LOOP_AS_WHILE:
        start_m = lo
        while start_m < hi:
            dk1, dk2, dv = _kv_step(
                start_m, bh, k1, k2, v, dk1, dk2, dv, lam, q1_ptr, q2_ptr, do_ptr, sqn, son,
                l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_n, offs_d, offs_v, n_q, n_k, offset,
                qk_scale, dq1_ptr, dq2_ptr, scale,
                D, DV, BLOCK_M, MASKED, HAS_SEGMENTS, PRECISION, DOT, DQ_ATOMIC,
            )  # fmt: skip
            start_m += BLOCK_M
    else:
        for start_m in range(lo, hi, BLOCK_M):
            dk1, dk2, dv = _kv_step(
                start_m, bh, k1, k2, v, dk1, dk2, dv, lam, q1_ptr, q2_ptr, do_ptr, sqn, son,
                l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_n, offs_d, offs_v, n_q, n_k, offset,
                qk_scale, dq1_ptr, dq2_ptr, scale,
                D, DV, BLOCK_M, MASKED, HAS_SEGMENTS, PRECISION, DOT, DQ_ATOMIC,
            )  # fmt: skip
    return dk1, dk2, dv


@_autotuned(configs.BACKWARD_KV, configs.BACKWARD_KV_CANDIDATES, ("dq1_ptr", "dq2_ptr"))
@triton.jit(do_not_specialize=["offset"])
def _diff_v1_bwd_kv(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, lam_ptr, seg_ptr, offset_ptr,
    do_ptr, l1_ptr, l2_ptr, r1_ptr, r2_ptr, dk1_ptr, dk2_ptr, dv_ptr, dq1_ptr, dq2_ptr,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    scale, n_q, n_k, offset, q_class,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    OFFSET_IN_MEMORY: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
    LOOP_AS_WHILE: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    kv = tl.program_id(1)  # b * H_kv + kv head
    b = kv // (H // REP)
    kv_head = kv % (H // REP)
    k1_ptr, k2_ptr, v_ptr, offset, lam, qk_scale, offs_d, offs_v = _kv_head(
        k1_ptr, k2_ptr, v_ptr, lam_ptr, offset_ptr, b, kv_head, skb, skh, svb, svh, scale,
        offset, OFFSET_IN_MEMORY, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k1 = _tile(k1_ptr, offs_n, n_k, skn, offs_d, D, DOT)
    k2 = _tile(k2_ptr, offs_n, n_k, skn, offs_d, D, DOT)
    v = _tile(v_ptr, offs_n, n_k, svn, offs_v, DV, DOT)
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    seg = seg_ptr + b * n_k
    # Query blocks [lo, full) see part of this key block (masked); [full, n_q) all of it.
    lo = (tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M) * BLOCK_M
    full = tl.cdiv(tl.maximum((pid_n + 1) * BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M
    full = tl.maximum(full, lo)
    for g in range(REP):  # the query heads of this KV head's group
        h = kv_head * REP + g
        bh = b * H + h
        q1_head = q1_ptr + b * sqb + h * sqh
        q2_head = q2_ptr + b * sqb + h * sqh
        do_head = do_ptr + b * sob + h * soh
        dk1, dk2, dv = _kv_loop(
            lo, tl.minimum(full, n_q), bh, k1, k2, v, dk1, dk2, dv, lam, q1_head, q2_head,
            do_head, sqn, son, l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_n, offs_d, offs_v,
            n_q, n_k, offset, qk_scale, dq1_ptr, dq2_ptr, scale,
            D, DV, BLOCK_M, True, HAS_SEGMENTS, PRECISION, DOT, DQ_ATOMIC, LOOP_AS_WHILE,
        )  # fmt: skip
        dk1, dk2, dv = _kv_loop(
            full, n_q, bh, k1, k2, v, dk1, dk2, dv, lam, q1_head, q2_head,
            do_head, sqn, son, l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_n, offs_d, offs_v,
            n_q, n_k, offset, qk_scale, dq1_ptr, dq2_ptr, scale,
            D, DV, BLOCK_M, HAS_SEGMENTS, HAS_SEGMENTS, PRECISION, DOT, DQ_ATOMIC, LOOP_AS_WHILE,
        )  # fmt: skip
    _store_tile(dk1_ptr, kv, offs_n, n_k, offs_d, D, dk1 * scale)
    _store_tile(dk2_ptr, kv, offs_n, n_k, offs_d, D, dk2 * (-lam * scale))
    _store_tile(dv_ptr, kv, offs_n, n_k, offs_v, DV, dv)


@triton.jit
def _q_step(
    start_n, q1, q2, do, dq1, dq2, k1_ptr, k2_ptr, v_ptr, skn, svn, row,
    l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k1 = _tile(k1_ptr, offs_n, n_k, skn, offs_d, D, DOT)
    k2 = _tile(k2_ptr, offs_n, n_k, skn, offs_d, D, DOT)
    v = _tile(v_ptr, offs_n, n_k, svn, offs_v, DV, DOT)
    _, _, ds1, ds2 = _probs_and_dp(
        q1, q2, k1, k2, v, do, row, offs_m, offs_n, n_q, n_k, offset, seg, qk_scale,
        l1_ptr, l2_ptr, r1_ptr, r2_ptr, MASKED, HAS_SEGMENTS, PRECISION,
    )  # fmt: skip
    dq1 += tl.dot(ds1.to(DOT), k1, input_precision=PRECISION)
    dq2 += tl.dot(ds2.to(DOT), k2, input_precision=PRECISION)
    return dq1, dq2


@triton.jit
def _q_loop(
    lo, hi, q1, q2, do, dq1, dq2, k1_ptr, k2_ptr, v_ptr, skn, svn, row,
    l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
    LOOP_AS_WHILE: tl.constexpr,
):  # fmt: skip
    if LOOP_AS_WHILE:
        start_n = lo
        while start_n < hi:
            dq1, dq2 = _q_step(
                start_n, q1, q2, do, dq1, dq2, k1_ptr, k2_ptr, v_ptr, skn, svn, row,
                l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_m, offs_d, offs_v, n_q, n_k, offset,
                qk_scale, D, DV, BLOCK_N, MASKED, HAS_SEGMENTS, PRECISION, DOT,
            )  # fmt: skip
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            dq1, dq2 = _q_step(
                start_n, q1, q2, do, dq1, dq2, k1_ptr, k2_ptr, v_ptr, skn, svn, row,
                l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_m, offs_d, offs_v, n_q, n_k, offset,
                qk_scale, D, DV, BLOCK_N, MASKED, HAS_SEGMENTS, PRECISION, DOT,
            )  # fmt: skip
    return dq1, dq2


@_autotuned(configs.BACKWARD_Q, configs.CANDIDATES)
@triton.jit(do_not_specialize=["offset"])
def _diff_v1_bwd_q(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, lam_ptr, seg_ptr, offset_ptr,
    do_ptr, l1_ptr, l2_ptr, r1_ptr, r2_ptr, dq1_ptr, dq2_ptr,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    scale, n_q, n_k, offset, q_class,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    OFFSET_IN_MEMORY: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
    LOOP_AS_WHILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    (
        pid_m, pid_bh, b, h, k1_ptr, k2_ptr, v_ptr, offset, lam, qk_scale, offs_m, offs_d,
        offs_v, q1, q2,
    ) = _query_block(
        q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, lam_ptr, offset_ptr, sqb, sqh, sqn, skb, skh,
        svb, svh, scale, n_q, offset,
        H, REP, D, BLOCK_D, BLOCK_DV, OFFSET_IN_MEMORY, DOT, BLOCK_M,
    )  # fmt: skip
    do = _tile(do_ptr + b * sob + h * soh, offs_m, n_q, son, offs_v, DV, DOT)
    dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    seg = seg_ptr + b * n_k
    row = pid_bh * n_q + offs_m
    full, hi = _key_bounds(pid_m, n_k, offset, BLOCK_M, BLOCK_N)
    dq1, dq2 = _q_loop(
        0, full, q1, q2, do, dq1, dq2, k1_ptr, k2_ptr, v_ptr, skn, svn, row,
        l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
        D, DV, BLOCK_N, HAS_SEGMENTS, HAS_SEGMENTS, PRECISION, DOT, LOOP_AS_WHILE,
    )  # fmt: skip
    dq1, dq2 = _q_loop(
        full, hi, q1, q2, do, dq1, dq2, k1_ptr, k2_ptr, v_ptr, skn, svn, row,
        l1_ptr, l2_ptr, r1_ptr, r2_ptr, seg, offs_m, offs_d, offs_v, n_q, n_k, offset, qk_scale,
        D, DV, BLOCK_N, True, HAS_SEGMENTS, PRECISION, DOT, LOOP_AS_WHILE,
    )  # fmt: skip
    _store_tile(dq1_ptr, pid_bh, offs_m, n_q, offs_d, D, dq1 * scale)
    _store_tile(dq2_ptr, pid_bh, offs_m, n_q, offs_d, D, dq2 * (-lam * scale))


def _launch_constants(
    q1: torch.Tensor,
    k1: torch.Tensor,
    v: torch.Tensor,
    key_segments: torch.Tensor | None,
    query_offset: torch.Tensor | None,
) -> dict:
    d, dv = q1.shape[-1], v.shape[-1]
    # The interpreter (numpy) has no bf16 matmul: its tiles are upcast to fp32 after loading.
    dot = tl.float32 if interpreting() else DOT_TYPES[q1.dtype]
    return dict(
        H=q1.shape[1],
        REP=q1.shape[1] // k1.shape[1],
        D=d,
        DV=dv,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        HAS_SEGMENTS=key_segments is not None,
        OFFSET_IN_MEMORY=query_offset is not None,
        PRECISION="ieee" if dot == tl.float32 else "tf32",
        DOT=dot,
        LOOP_AS_WHILE=interpreting(),
    )


def _pointers(
    like: torch.Tensor, key_segments: torch.Tensor | None, query_offset: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # Tensors for the segment and offset pointers; a one-element placeholder when unused.
    seg = (
        like.new_ones(1, dtype=torch.int32)
        if key_segments is None
        else key_segments.to(device=like.device, dtype=torch.int32).contiguous()
    )
    offset = (
        like.new_zeros(1, dtype=torch.int64)
        if query_offset is None
        else query_offset.to(device=like.device, dtype=torch.int64).reshape(1)
    )
    return seg, offset


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The kernels take one set of strides for Q1 and Q2 (and for K1 and K2): views of one
    # projection, as the model makes them, share theirs; others are copied.
    a, b = _rows_contiguous(a), _rows_contiguous(b)
    if a.stride() != b.stride():
        a, b = a.contiguous(), b.contiguous()
    return a, b


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    # (batch, head, row) strides of each tensor; columns are contiguous
    return tuple(stride for x in tensors for stride in x.stride()[:3])


def dq_by_atomics() -> bool:
    """Whether the backward adds dQ from the dK/dV kernel with atomics (``DIFFATTN_TRITON_DQ
    =atomic``: no second pass over the maps, nondeterministic order of fp32 additions)
    instead of its own kernel (the default, deterministic)."""
    choice = os.environ.get(DQ_SWITCH, "kernel")
    if choice not in ("kernel", "atomic"):
        raise ValueError(f"{DQ_SWITCH} must be 'kernel' or 'atomic', got {choice!r}")
    return choice == "atomic"


def _query_class(n: int) -> int:
    return min(128, triton.next_power_of_2(n))


def forward(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    key_segments: torch.Tensor | None,
    query_offset: torch.Tensor | None,
    offset: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``O``, the second map's output ``O2`` and the base-2 logsumexps ``L1``, ``L2``
    (contiguous). Inputs may be strided views with contiguous columns. ``query_offset`` (a
    1-element tensor), when given, replaces ``offset`` and is read on the device, as is
    ``lam``."""
    q1, q2 = _same_layout(q1, q2)
    k1, k2 = _same_layout(k1, k2)
    v = _rows_contiguous(v)
    bsz, h, n, _ = q1.shape
    s = k1.shape[2]
    seg, offset_tensor = _pointers(q1, key_segments, query_offset)
    out = q1.new_empty(bsz, h, n, v.shape[-1])
    o2 = torch.empty_like(out)
    lse1 = q1.new_empty(bsz, h, n, dtype=torch.float32)
    lse2 = torch.empty_like(lse1)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]), bsz * h)

    _diff_v1_fwd[grid](
        q1, q2, k1, k2, v, lam, seg, offset_tensor, out, o2, lse1, lse2,
        *_strides(q1, k1, v, out), scale, n, s, offset, _query_class(n),
        **_launch_constants(q1, k1, v, key_segments, query_offset),
    )  # fmt: skip
    return out, o2, lse1, lse2


def backward(
    grad_out: torch.Tensor,
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    key_segments: torch.Tensor | None,
    query_offset: torch.Tensor | None,
    offset: int,
    scale: float,
    out: torch.Tensor,
    o2: torch.Tensor,
    lse1: torch.Tensor,
    lse2: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Gradients of q1, q2, k1, k2, v and λ from the forward's saved tensors; λ's is the
    device-side sum ``−Σ rowsum(dO ∘ O2)``."""
    q1, q2 = _same_layout(q1, q2)
    k1, k2 = _same_layout(k1, k2)
    v = _rows_contiguous(v)
    bsz, h, n, _ = q1.shape
    n_kv, s = k1.shape[1], k1.shape[2]
    do = _rows_contiguous(grad_out.to(out.dtype))
    # preprocess (FlashAttention-2's delta, one per map): r_a = rowsum(dO ∘ O_a), O1 = O + λ·O2
    r2 = (do.float() * o2.float()).sum(-1)
    r1 = (do.float() * out.float()).sum(-1) + lam.float() * r2
    seg, offset_tensor = _pointers(q1, key_segments, query_offset)
    dq1, dq2, dk1, dk2, dv = (
        x.new_empty(x.shape)
        for x in (q1, q2, k1, k2, v)  # contiguous, as the kernels write
    )
    atomic = dq_by_atomics()
    # fp32 dQ accumulators of the atomic variant (placeholders otherwise)
    dq1_sum, dq2_sum = (
        q1.new_zeros(x.shape if atomic else (1,), dtype=torch.float32) for x in (q1, q2)
    )
    constants = _launch_constants(q1, k1, v, key_segments, query_offset)
    inputs = (q1, q2, k1, k2, v, lam, seg, offset_tensor, do, lse1, lse2, r1, r2)
    sizes = (*_strides(q1, k1, v, do), scale, n, s, offset, _query_class(n))

    def kv_grid(meta):
        return (triton.cdiv(s, meta["BLOCK_N"]), bsz * n_kv)

    def q_grid(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]), bsz * h)

    _diff_v1_bwd_kv[kv_grid](
        *inputs, dk1, dk2, dv, dq1_sum, dq2_sum, *sizes, DQ_ATOMIC=atomic, **constants
    )
    if atomic:
        dq1.copy_(dq1_sum)
        dq2.copy_(dq2_sum)
    else:
        _diff_v1_bwd_q[q_grid](*inputs, dq1, dq2, *sizes, **constants)
    dlam = (-r2.sum()).to(lam.dtype).reshape(lam.shape)
    return dq1, dq2, dk1, dk2, dv, dlam
