"""Triton kernels of DIFF V1 (Eq.1): ``(softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d)) V``, forward and
backward, with each map's QKᵀ at width d and each K/V tile loaded once for both maps.

Imported only when the ``triton`` backend runs (it imports ``triton``); set
``TRITON_INTERPRET=1`` before importing it to run the kernels on the CPU with numpy.

**Forward** (one program per block of ``BLOCK_M`` query rows of one query head): for each
tile of ``BLOCK_N`` keys up to the causal limit, the K1, K2 and V tiles are loaded once;
``S_a = Q_a K_aᵀ/√d`` (width d) and two online softmaxes (running max ``m_a`` and sum
``l_a``) update ``acc_a += P̃_a V``. The end writes ``O = acc1/l1 − λ·acc2/l2``, the second
map's output ``O2`` and the logsumexps ``L_a``. FLOPs per differential head with
``M ≈ N²/2`` allowed pairs: ``4·M·d`` (QKᵀ) + ``8·M·d`` (one PV per map: the two maps are
normalised separately online, so one product with ``P1 − λP2`` would need a second pass
over K); HBM traffic: Q1, Q2 once, K1, K2, V once per query block, O, O2, L1, L2 once.

**Backward** (FlashAttention-2's split): ``r_a = rowsum(dO ∘ O_a)`` on the host
(``O1 = O + λ·O2``), ``dλ = −Σ r2``; one program per key block of one KV head loops over the
query heads of its GQA group and their query blocks, recomputing ``P_a = exp(S_a − L_a)``,
and accumulates ``dV += (P1 − λP2)ᵀ dO`` (one product for both maps), ``dP = dO Vᵀ``
(shared), ``dS1 = P1 ∘ (dP − r1)``, ``dS2 = −λ·P2 ∘ (dP − r2)``, ``dK_a += dS_aᵀ Q_a/√d``;
a second kernel, one program per query block, recomputes the same and accumulates
``dQ_a = dS_a K_a/√d``. No atomics, no N×N tensor.

Masking is :mod:`diffattn.attention.mask`'s rule: key ``j`` is read by query ``i`` iff
``j ≤ i + offset`` and (``j`` is real or ``j = i + offset``); full custom masks are not taken.
Dots accumulate in fp32 (inputs fp32 use IEEE fp32 dots, fp16/bf16 inputs their own type).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

DOT_TYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _allowed(offs_m, offs_n, n_q, n_k, offset, kp_ptr, HAS_PADDING: tl.constexpr):
    q_pos = offs_m + offset
    ok = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < n_k) & (offs_m[:, None] < n_q)
    if HAS_PADDING:
        real = tl.load(kp_ptr + offs_n, mask=offs_n < n_k, other=0) != 0
        real_q = tl.load(kp_ptr + q_pos, mask=offs_m < n_q, other=0) != 0
        pair = real[None, :] & real_q[:, None]
        ok = ok & (pair | (offs_n[None, :] == q_pos[:, None]))
    return ok


@triton.jit
def _tile(ptr, head, offs_r, n_rows, offs_c, WIDTH: tl.constexpr, DOT: tl.constexpr):
    # Rows offs_r of head `head` of a contiguous (heads, n_rows, WIDTH) tensor, zero-padded.
    mask = (offs_r[:, None] < n_rows) & (offs_c[None, :] < WIDTH)
    offsets = (head * n_rows + offs_r[:, None]) * WIDTH + offs_c[None, :]
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(DOT)


@triton.jit
def _diff_v1_fwd(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, kp_ptr, o_ptr, o2_ptr, l1_ptr, l2_ptr,
    lam, scale, n_q, n_k, offset,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_PADDING: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    kv = b * (H // REP) + (pid_bh % H) // REP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    q1 = _tile(q1_ptr, pid_bh, offs_m, n_q, offs_d, D, DOT)
    q2 = _tile(q2_ptr, pid_bh, offs_m, n_q, offs_d, D, DOT)
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    kp = kp_ptr + b * n_k
    hi = tl.minimum(n_k, (pid_m + 1) * BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k1 = _tile(k1_ptr, kv, offs_n, n_k, offs_d, D, DOT)
        k2 = _tile(k2_ptr, kv, offs_n, n_k, offs_d, D, DOT)
        v = _tile(v_ptr, kv, offs_n, n_k, offs_v, DV, DOT)
        ok = _allowed(offs_m, offs_n, n_q, n_k, offset, kp, HAS_PADDING)
        s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) * scale
        s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION) * scale
        s1 = tl.where(ok, s1, float("-inf"))
        s2 = tl.where(ok, s2, float("-inf"))
        new1 = tl.maximum(m1, tl.max(s1, 1))
        new2 = tl.maximum(m2, tl.max(s2, 1))
        safe1 = tl.where(new1 == float("-inf"), 0.0, new1)
        safe2 = tl.where(new2 == float("-inf"), 0.0, new2)
        p1 = tl.exp(s1 - safe1[:, None])
        p2 = tl.exp(s2 - safe2[:, None])
        alpha1 = tl.exp(m1 - safe1)
        alpha2 = tl.exp(m2 - safe2)
        l1 = l1 * alpha1 + tl.sum(p1, 1)
        l2 = l2 * alpha2 + tl.sum(p2, 1)
        acc1 = acc1 * alpha1[:, None] + tl.dot(p1.to(v.dtype), v, input_precision=PRECISION)
        acc2 = acc2 * alpha2[:, None] + tl.dot(p2.to(v.dtype), v, input_precision=PRECISION)
        m1, m2 = new1, new2
    l1 = tl.where(l1 == 0.0, 1.0, l1)
    l2 = tl.where(l2 == 0.0, 1.0, l2)
    o2 = acc2 / l2[:, None]
    out = acc1 / l1[:, None] - lam * o2
    o_mask = (offs_m[:, None] < n_q) & (offs_v[None, :] < DV)
    o_off = (pid_bh * n_q + offs_m[:, None]) * DV + offs_v[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=o_mask)
    tl.store(o2_ptr + o_off, o2.to(o2_ptr.dtype.element_ty), mask=o_mask)
    row = pid_bh * n_q + offs_m
    tl.store(l1_ptr + row, m1 + tl.log(l1), mask=offs_m < n_q)
    tl.store(l2_ptr + row, m2 + tl.log(l2), mask=offs_m < n_q)


@triton.jit
def _probs_and_dp(
    q1, q2, k1, k2, v, do, row, offs_m, offs_n, n_q, n_k, offset, kp, scale,
    l1_ptr, l2_ptr, r1_ptr, r2_ptr,
    HAS_PADDING: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # The recomputed maps of one (query block, key block) tile, dS1 and dS2 / (−λ).
    ok = _allowed(offs_m, offs_n, n_q, n_k, offset, kp, HAS_PADDING)
    row_ok = offs_m < n_q
    lse1 = tl.load(l1_ptr + row, mask=row_ok, other=0.0)
    lse2 = tl.load(l2_ptr + row, mask=row_ok, other=0.0)
    r1 = tl.load(r1_ptr + row, mask=row_ok, other=0.0)
    r2 = tl.load(r2_ptr + row, mask=row_ok, other=0.0)
    s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) * scale
    s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION) * scale
    p1 = tl.where(ok, tl.exp(s1 - lse1[:, None]), 0.0)
    p2 = tl.where(ok, tl.exp(s2 - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds1 = p1 * (dp - r1[:, None])
    ds2 = p2 * (dp - r2[:, None])
    return p1, p2, ds1, ds2


@triton.jit
def _diff_v1_bwd_kv(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, kp_ptr, do_ptr, l1_ptr, l2_ptr, r1_ptr, r2_ptr,
    dk1_ptr, dk2_ptr, dv_ptr,
    lam, scale, n_q, n_k, offset,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_PADDING: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    kv = tl.program_id(1)  # b * H_kv + kv head
    b = kv // (H // REP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    k_mask = (offs_n[:, None] < n_k) & (offs_d[None, :] < D)
    k_off = (kv * n_k + offs_n[:, None]) * D + offs_d[None, :]
    v_mask = (offs_n[:, None] < n_k) & (offs_v[None, :] < DV)
    v_off = (kv * n_k + offs_n[:, None]) * DV + offs_v[None, :]
    k1 = _tile(k1_ptr, kv, offs_n, n_k, offs_d, D, DOT)
    k2 = _tile(k2_ptr, kv, offs_n, n_k, offs_d, D, DOT)
    v = _tile(v_ptr, kv, offs_n, n_k, offs_v, DV, DOT)
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    kp = kp_ptr + b * n_k
    first_row = tl.maximum(pid_n * BLOCK_N - offset, 0)
    lo = (first_row // BLOCK_M) * BLOCK_M
    for g in range(REP):
        bh = (kv // (H // REP)) * H + (kv % (H // REP)) * REP + g
        for start_m in range(lo, n_q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q1 = _tile(q1_ptr, bh, offs_m, n_q, offs_d, D, DOT)
            q2 = _tile(q2_ptr, bh, offs_m, n_q, offs_d, D, DOT)
            do = _tile(do_ptr, bh, offs_m, n_q, offs_v, DV, DOT)
            p1, p2, ds1, ds2 = _probs_and_dp(
                q1, q2, k1, k2, v, do, bh * n_q + offs_m, offs_m, offs_n, n_q, n_k, offset, kp,
                scale, l1_ptr, l2_ptr, r1_ptr, r2_ptr, HAS_PADDING, PRECISION,
            )  # fmt: skip
            p = (p1 - lam * p2).to(do.dtype)
            dv += tl.dot(tl.trans(p), do, input_precision=PRECISION)
            dk1 += tl.dot(tl.trans(ds1.to(q1.dtype)), q1, input_precision=PRECISION)
            dk2 += tl.dot(tl.trans(ds2.to(q2.dtype)), q2, input_precision=PRECISION)
    tl.store(dk1_ptr + k_off, (dk1 * scale).to(dk1_ptr.dtype.element_ty), mask=k_mask)
    tl.store(dk2_ptr + k_off, (dk2 * (-lam * scale)).to(dk2_ptr.dtype.element_ty), mask=k_mask)
    tl.store(dv_ptr + v_off, dv.to(dv_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _diff_v1_bwd_q(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, kp_ptr, do_ptr, l1_ptr, l2_ptr, r1_ptr, r2_ptr,
    dq1_ptr, dq2_ptr,
    lam, scale, n_q, n_k, offset,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_PADDING: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    kv = b * (H // REP) + (pid_bh % H) // REP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < D)
    q_off = (pid_bh * n_q + offs_m[:, None]) * D + offs_d[None, :]
    q1 = _tile(q1_ptr, pid_bh, offs_m, n_q, offs_d, D, DOT)
    q2 = _tile(q2_ptr, pid_bh, offs_m, n_q, offs_d, D, DOT)
    do = _tile(do_ptr, pid_bh, offs_m, n_q, offs_v, DV, DOT)
    dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kp = kp_ptr + b * n_k
    hi = tl.minimum(n_k, (pid_m + 1) * BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k1 = _tile(k1_ptr, kv, offs_n, n_k, offs_d, D, DOT)
        k2 = _tile(k2_ptr, kv, offs_n, n_k, offs_d, D, DOT)
        v = _tile(v_ptr, kv, offs_n, n_k, offs_v, DV, DOT)
        _, _, ds1, ds2 = _probs_and_dp(
            q1, q2, k1, k2, v, do, pid_bh * n_q + offs_m, offs_m, offs_n, n_q, n_k, offset, kp,
            scale, l1_ptr, l2_ptr, r1_ptr, r2_ptr, HAS_PADDING, PRECISION,
        )  # fmt: skip
        dq1 += tl.dot(ds1.to(k1.dtype), k1, input_precision=PRECISION)
        dq2 += tl.dot(ds2.to(k2.dtype), k2, input_precision=PRECISION)
    tl.store(dq1_ptr + q_off, (dq1 * scale).to(dq1_ptr.dtype.element_ty), mask=q_mask)
    tl.store(dq2_ptr + q_off, (dq2 * (-lam * scale)).to(dq2_ptr.dtype.element_ty), mask=q_mask)


def _launch_shape(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, block: int) -> dict:
    d, dv = q1.shape[-1], v.shape[-1]
    # The interpreter (numpy) has no bf16 matmul: its tiles are upcast to fp32 after loading.
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    dot = tl.float32 if interpreted or q1.dtype == torch.float32 else DOT_TYPES[q1.dtype]
    return dict(
        H=q1.shape[1],
        REP=q1.shape[1] // k1.shape[1],
        D=d,
        DV=dv,
        BLOCK_M=block,
        BLOCK_N=block,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        PRECISION="ieee" if dot == tl.float32 else "tf32",
        DOT=dot,
    )


def _padding(key_padding: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if key_padding is None:
        return like.new_ones(1, dtype=torch.int8), False
    return key_padding.to(device=like.device, dtype=torch.int8).contiguous(), True


class TritonDiffV1(torch.autograd.Function):
    """Eq.1 on the kernels of this module. Arguments after the tensors: the key padding
    ``(B, S)`` bool or ``None``, the integer query offset, the scale and the block size."""

    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, lam, key_padding, offset: int, scale: float, block: int):
        q1, q2, k1, k2, v = (x.contiguous() for x in (q1, q2, k1, k2, v))
        bsz, h, n, _ = q1.shape
        s = k1.shape[2]
        lam_value = float(lam)
        kp, has_padding = _padding(key_padding, q1)
        out = q1.new_empty(bsz, h, n, v.shape[-1])
        o2 = torch.empty_like(out)
        lse1 = q1.new_empty(bsz, h, n, dtype=torch.float32)
        lse2 = torch.empty_like(lse1)
        shape = _launch_shape(q1, k1, v, block)
        grid = (triton.cdiv(n, block), bsz * h)
        _diff_v1_fwd[grid](
            q1, q2, k1, k2, v, kp, out, o2, lse1, lse2, lam_value, scale, n, s, offset,
            HAS_PADDING=has_padding, **shape,
        )  # fmt: skip
        ctx.save_for_backward(q1, q2, k1, k2, v, kp, out, o2, lse1, lse2)
        ctx.lam_value, ctx.lam_dtype, ctx.has_padding = lam_value, lam.dtype, has_padding
        ctx.offset, ctx.scale, ctx.block = offset, scale, block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q1, q2, k1, k2, v, kp, out, o2, lse1, lse2 = ctx.saved_tensors
        lam, scale, block, offset = ctx.lam_value, ctx.scale, ctx.block, ctx.offset
        do = grad_out.contiguous().to(out.dtype)
        bsz, h, n, _ = q1.shape
        n_kv, s = k1.shape[1], k1.shape[2]
        r2 = (do.float() * o2.float()).sum(-1)
        r1 = (do.float() * out.float()).sum(-1) + lam * r2  # O1 = O + λ·O2
        dq1, dq2 = torch.empty_like(q1), torch.empty_like(q2)
        dk1, dk2, dv = torch.empty_like(k1), torch.empty_like(k2), torch.empty_like(v)
        shape = _launch_shape(q1, k1, v, block)
        common = (kp, do, lse1, lse2, r1, r2)
        _diff_v1_bwd_kv[(triton.cdiv(s, block), bsz * n_kv)](
            q1, q2, k1, k2, v, *common, dk1, dk2, dv, lam, scale, n, s, offset,
            HAS_PADDING=ctx.has_padding, **shape,
        )  # fmt: skip
        _diff_v1_bwd_q[(triton.cdiv(n, block), bsz * h)](
            q1, q2, k1, k2, v, *common, dq1, dq2, lam, scale, n, s, offset,
            HAS_PADDING=ctx.has_padding, **shape,
        )  # fmt: skip
        dlam = (-r2.sum()).to(ctx.lam_dtype)
        return dq1, dq2, dk1, dk2, dv, dlam, None, None, None, None
