"""``fused``: DIFF V1 (Eq.1) with each map's QKᵀ at width d and V read once, with a
hand-written backward; baseline and DIFF V2 calls run on ``sdpa``.

CPU calls with the causal/padding mask run on the compiled kernel of
:mod:`~diffattn.attention.cpu_kernel` (flash-style tiles in C++, at the speed of PyTorch's own
flash attention). Everything else (other devices, full custom masks, a machine where the kernel
cannot be built) runs on the blocked PyTorch formulation below, the same algorithm in torch ops.

**Algorithm.** Query rows are taken in blocks of ``R`` rows (all heads and batch rows at once).
A block whose last query may read keys ``[0, e)`` (causal masking: ``e = row_end + offset``)
computes, per differential head with Q1, Q2, K1, K2 of width d and V of width 2d::

    P1 = softmax(Q1 K1[:e]ᵀ/√d + mask),  P2 = softmax(Q2 K2[:e]ᵀ/√d + mask)
    P  = P1 − λ·P2                     (one R×e map)
    O  = P · V[:e]                     (one matmul: V read once for both maps)

so no tensor is larger than ``R × e`` per head, never N×N. GQA: the ``H / H_kv`` query heads
of a KV group are stacked along the rows of one matmul, so K and V are never repeated.

The backward recomputes ``P1`` and ``P2`` per block (nothing of size N×S is saved) and, with
``G = dO`` of the block, ``dP = G Vᵀ`` (shared by both maps, since ``∂O/∂P2 = −λ ∂O/∂P1``)::

    dV[:e] += Pᵀ G
    r_a    = rowsum(dP ∘ P_a)                        (a = 1, 2)
    dS1    = P1 ∘ (dP − r1),   dS2 = −λ·P2 ∘ (dP − r2)
    dQ_a   = dS_a K_a/√d,      dK_a[:e] += dS_aᵀ Q_a/√d
    dλ     = −Σ_rows r2                              (= −Σ dO·P2V)

**Cost** per differential head, with ``M = Σ_blocks R·e ≈ N²/2`` (causal; ``N·S`` with a
cache), counting a multiply-add as 2 FLOPs:

* forward: ``2·2·M·d`` (two QKᵀ at width d) + ``2·M·2d`` (one PV at width 2d) = ``8·M·d``;
  the two per-map PVs of the two-call form (App. A) would add another ``4·M·d``, and the
  zero-padded sdpa/flash form costs ``16·M·d``. A baseline head pair (two heads of width d)
  costs ``8·M·d`` too: DIFF V1 with this kernel does the baseline's attention FLOPs.
* backward: recomputed QKᵀ ``4·M·d``, ``dP`` ``4·M·d``, ``dV`` ``4·M·d``, dQ1, dQ2, dK1, dK2
  ``8·M·d``: ``20·M·d`` (baseline head pair with flash-style recompute: ``20·M·d``).
* exponentials: ``2·M`` forward and ``2·M`` backward, as for a baseline head pair.
* memory traffic: Q1, Q2, K1, K2, V, O read or written once per block row of the output
  (K and V are re-read by every block: ``(N/R)·S·4d`` elements, the blocking's price), plus
  the block maps, which live in cache-sized pieces: ``~6`` passes over ``R×e`` fp32 values
  forward, ``~12`` backward. Saved for backward: the inputs only (no logsumexp, no O).

Compute is fp32 whatever the input dtype (bf16 inputs are upcast per call, outputs cast
back), matching ``reference``. Masking follows :mod:`diffattn.attention.mask` exactly
(causal, key padding / var-len, query offset for a KV cache, full custom masks).

Calls traced by ``torch.compile`` (fixed-shape decoding with a tensor ``query_offset``) take
:func:`~diffattn.attention.backends.reference.differential_rows`, the same formula as one
block through autograd; eager calls with a tensor offset (a static cache) read it once.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import torch

from diffattn.attention import cpu_kernel
from diffattn.attention.backends.reference import differential_rows
from diffattn.attention.backends.sdpa import sdpa_attention
from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import Backend, compose_v2, log_once, register_backend

BLOCK_ELEMENTS = 1 << 20
"""Target size of one block map (rows × keys × heads × batch) in elements: 4 MiB in fp32,
small enough to stay in the last-level cache while elementwise passes run over it."""
MIN_BLOCK_ROWS = 16
USE_COMPILED = True
"""Run CPU calls on the compiled kernel when it builds; ``False`` forces the blocked path."""
PARALLEL_BLOCKS = True
"""Run blocks on worker threads (see :func:`_in_workers`); ``False`` runs them in order."""


def _group(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``(B, H, N, w)`` → ``(B, H_kv, N, rep, w)`` contiguous: block rows of the query heads
    of one KV group are adjacent, so a block is a plain view ``(B, H_kv, R·rep, w)``."""
    bsz, h, n, w = q.shape
    return q.view(bsz, n_kv, h // n_kv, n, w).transpose(2, 3).contiguous()


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_group`: ``(B, H_kv, N, rep, w)`` → ``(B, H, N, w)``."""
    bsz, n_kv, n, rep, w = x.shape
    return x.transpose(2, 3).reshape(bsz, n_kv * rep, n, w)


class _Blocks:
    """The query blocks of one call and the mask of each, as ``(rows, key_end, masked)``."""

    def __init__(self, mask: AttentionMask, bsz: int, h: int, n: int, s: int) -> None:
        self.mask, self.n, self.s = mask, n, s
        self.offset = int(mask.query_offset)
        self.plain_causal = mask.key_padding is None and not mask.custom
        rows = BLOCK_ELEMENTS // max(1, bsz * h * s)
        self.rows = max(MIN_BLOCK_ROWS, min(n, rows))
        self._band: torch.Tensor | None = None

    def __iter__(self):
        for start in range(0, self.n, self.rows):
            stop = min(start + self.rows, self.n)
            key_end = self.s if self.mask.allowed is not None else min(self.s, stop + self.offset)
            yield start, stop, key_end

    def apply(self, scores: torch.Tensor, start: int, stop: int, key_end: int) -> None:
        """Fill disallowed (query, key) pairs of a block's scores ``(B, H_kv, R, rep, e)``
        with −inf, in place; without padding only the diagonal band needs it."""
        rows = stop - start
        if not self.plain_causal:
            allowed = self.mask.dense(rows, self.s, scores.device, row_start=start)
            scores.masked_fill_(~allowed[..., :key_end].unsqueeze(3), float("-inf"))
            return
        first = start + self.offset  # every row of the block reads keys [0, first]
        if key_end - first <= 1:
            return
        if self._band is None or self._band.shape[0] < rows:
            self._band = torch.ones(rows, rows, dtype=torch.bool, device=scores.device).triu(1)
        band = self._band[:rows, None, : key_end - first]  # (R, 1, e - first)
        scores[..., first:key_end].masked_fill_(band, float("-inf"))


def _probs(q_block, k, blocks: _Blocks, start: int, stop: int, key_end: int) -> torch.Tensor:
    """softmax of one block's scores; ``q_block`` ``(B, H_kv, R·rep, d)`` is pre-scaled."""
    scores = torch.matmul(q_block, k[:, :, :key_end].transpose(-1, -2))
    bsz, n_kv, rows_rep, _ = scores.shape
    rows = stop - start
    blocks.apply(scores.view(bsz, n_kv, rows, rows_rep // rows, key_end), start, stop, key_end)
    return torch.softmax(scores, dim=-1)


def _rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a grouped tensor ``(B, H_kv, N, rep, w)`` as
    ``(B, H_kv, R·rep, w)``."""
    part = x[:, :, start:stop]
    return part.reshape(part.shape[0], part.shape[1], -1, part.shape[-1])


def _forward(q1s, q2s, k1, k2, v, lam: float, blocks: _Blocks) -> torch.Tensor:
    bsz, n_kv, n, rep, _ = q1s.shape
    out = v.new_empty(bsz, n_kv, n, rep, v.shape[-1])

    def run(part):
        for start, stop, key_end in part:
            p = _probs(_rows(q1s, start, stop), k1, blocks, start, stop, key_end)
            p2 = _probs(_rows(q2s, start, stop), k2, blocks, start, stop, key_end)
            p.sub_(p2, alpha=lam)
            del p2
            block = torch.matmul(p, v[:, :, :key_end])
            out[:, :, start:stop] = block.view(bsz, n_kv, stop - start, rep, -1)

    _in_workers(run, list(blocks))
    return out


def _in_workers(run, items: list) -> list:
    """``run(part)`` for interleaved parts of ``items``: one Python thread per intra-op
    thread, each running its blocks single-threaded (ops release the GIL), the coarse-grained
    parallelism of fused kernels. Returns the results in part order."""
    workers = min(torch.get_num_threads(), len(items))
    if workers <= 1 or not PARALLEL_BLOCKS:
        with torch.no_grad():
            return [run(items)]
    threads = torch.get_num_threads()

    def single(part):
        torch.set_num_threads(1)
        with torch.no_grad():  # grad mode is per thread; nothing here is differentiated
            return run(part)

    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(single, [items[i::workers] for i in range(workers)]))
    finally:
        torch.set_num_threads(threads)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``rowsum(a ∘ b)`` over the last dim, keeping it (einsum: no ``a ∘ b`` temporary)."""
    return torch.einsum("...k,...k->...", a, b).unsqueeze(-1)


def _backward(grad, q1s, q2s, k1, k2, v, lam: float, scale: float, blocks: _Blocks):
    bsz, n_kv, _, rep, d = q1s.shape
    dq1, dq2 = torch.empty_like(q1s), torch.empty_like(q2s)

    def run(part):
        dk1, dk2, dv = torch.zeros_like(k1), torch.zeros_like(k2), torch.zeros_like(v)
        dlam = grad.new_zeros(())
        for start, stop, key_end in part:
            q1_block, q2_block = _rows(q1s, start, stop), _rows(q2s, start, stop)
            g = _rows(grad, start, stop)
            k1e, k2e, ve = k1[:, :, :key_end], k2[:, :, :key_end], v[:, :, :key_end]
            p1 = _probs(q1_block, k1, blocks, start, stop, key_end)
            p2 = _probs(q2_block, k2, blocks, start, stop, key_end)
            dv[:, :, :key_end] += torch.sub(p1, p2, alpha=lam).transpose(-1, -2) @ g
            dp = g @ ve.transpose(-1, -2)
            r1, r2 = _row_dot(dp, p1), _row_dot(dp, p2)
            dlam -= r2.sum()
            ds1 = (dp - r1).mul_(p1)
            del p1
            ds2 = dp.sub_(r2).mul_(p2)  # dS2 / (−λ)
            del p2
            shape = (bsz, n_kv, stop - start, rep, d)
            dq1[:, :, start:stop] = (ds1 @ k1e).mul_(scale).view(shape)
            dq2[:, :, start:stop] = (ds2 @ k2e).mul_(-lam * scale).view(shape)
            dk1[:, :, :key_end] += ds1.transpose(-1, -2) @ q1_block
            dk2[:, :, :key_end].sub_(ds2.transpose(-1, -2) @ q2_block, alpha=lam)
        return dk1, dk2, dv, dlam

    parts = _in_workers(run, list(blocks))
    dk1, dk2, dv, dlam = (sum(values) for values in zip(*parts, strict=True))
    return dq1, dq2, dk1, dk2, dv, dlam


def _compiled_kernel_for(q: torch.Tensor, mask: AttentionMask) -> bool:
    """Whether a call runs on the compiled CPU kernel (:mod:`~diffattn.attention.cpu_kernel`):
    CPU tensors, the causal/padding mask rule and packed documents (not a full custom mask),
    and the kernel built."""
    if q.device.type != "cpu" or mask.allowed is not None or not USE_COMPILED:
        return False
    reason = cpu_kernel.unavailable()
    if reason is not None:
        log_once(
            "fused",
            "diff_v1",
            f"compiled CPU kernel unavailable ({reason}); running the blocked PyTorch path",
        )
        return False
    return True


def _keys_and_values(compiled: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 K1, K2, V for a path: the compiled kernel reads any batch and head strides (a
    cache's interleaved maps in place) as long as each row's features are contiguous; the
    blocked path takes contiguous tensors."""
    out = []
    for x in tensors:
        x = x.float()
        out.append(x if compiled and _rows_contiguous(x) else x.contiguous())
    return tuple(out)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Each position's features are one contiguous row, rows back to back (what the compiled
    kernel checks); a length-1 position axis may carry any stride, as ``contiguous()`` leaves
    it."""
    return x.stride(3) == 1 and (x.shape[2] == 1 or x.stride(2) == x.shape[3])


def _rows_of(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``(B, H, N, w)`` → the compiled kernel's ``(B, H_kv, N·rep, w)`` rows, contiguous."""
    grouped = _group(x, n_kv)
    return grouped.view(grouped.shape[0], n_kv, -1, grouped.shape[-1])


def _unrows(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_rows_of`."""
    bsz, n_kv, rows, w = x.shape
    return _ungroup(x.view(bsz, n_kv, n, rows // n, w))


def _compiled_forward(q1, q2, k1f, k2f, vf, lam_value: float, mask: AttentionMask, scale):
    """The compiled kernel's forward: ``(out in q1's dtype, lse1, lse2, (key padding as
    uint8 or None, documents as int64 or None))``."""
    n_kv, n, rep = k1f.shape[1], q1.shape[2], q1.shape[1] // k1f.shape[1]
    padding = None if mask.key_padding is None else mask.key_padding.to(torch.uint8)
    documents = None if mask.document_ids is None else mask.document_ids.to(torch.long)
    out, lse1, lse2 = cpu_kernel.forward(
        _rows_of(q1.float(), n_kv), _rows_of(q2.float(), n_kv),
        k1f, k2f, vf, lam_value, scale, rep, int(mask.query_offset), padding, documents,
    )  # fmt: skip
    return _unrows(out, n).to(q1.dtype), lse1, lse2, (padding, documents)


class _FusedDiffV1(torch.autograd.Function):
    """Eq.1 forward and its hand-written backward: the compiled CPU kernel when it can run,
    else the blocked PyTorch path (both recompute the maps in backward)."""

    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, lam, mask, scale):
        n_kv = k1.shape[1]
        bsz, h, n, _ = q1.shape
        lam_value = float(lam)
        ctx.scale, ctx.lam_value, ctx.lam_dtype, ctx.mask = scale, lam_value, lam.dtype, mask
        ctx.compiled = _compiled_kernel_for(q1, mask)
        k1f, k2f, vf = _keys_and_values(ctx.compiled, k1, k2, v)
        if ctx.compiled:
            out, lse1, lse2, ctx.padding = _compiled_forward(
                q1, q2, k1f, k2f, vf, lam_value, mask, scale
            )
            ctx.save_for_backward(q1, q2, k1, k2, v, lse1, lse2)
            return out
        blocks = _Blocks(mask, bsz, h, n, k1.shape[2])
        q1s, q2s = (_group(q.float() * scale, n_kv) for q in (q1, q2))
        out = _ungroup(_forward(q1s, q2s, k1f, k2f, vf, lam_value, blocks))
        ctx.save_for_backward(q1, q2, k1, k2, v)
        ctx.blocks = blocks
        return out.to(q1.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors  # read once: checkpointing's unpack hooks allow one read
        q1, q2, k1, k2, v = saved[:5]
        n_kv, scale, n = k1.shape[1], ctx.scale, q1.shape[2]
        k1f, k2f, vf = _keys_and_values(ctx.compiled, k1, k2, v)
        if ctx.compiled:
            rows = (_rows_of(t, n_kv) for t in (grad_out.float(), q1.float(), q2.float()))
            dq1, dq2, dk1, dk2, dv, dlam = cpu_kernel.backward(
                (*rows, k1f, k2f, vf, *saved[5:]), ctx.lam_value, scale,
                q1.shape[1] // n_kv, int(ctx.mask.query_offset), *ctx.padding,
            )  # fmt: skip
            dq1, dq2 = _unrows(dq1, n), _unrows(dq2, n)
        else:
            q1s, q2s = (_group(q.float() * scale, n_kv) for q in (q1, q2))
            grad = _group(grad_out.float(), n_kv)
            dq1, dq2, dk1, dk2, dv, dlam = _backward(
                grad, q1s, q2s, k1f, k2f, vf, ctx.lam_value, scale, ctx.blocks
            )
            dq1, dq2 = _ungroup(dq1), _ungroup(dq2)
        return (
            dq1.to(q1.dtype),
            dq2.to(q2.dtype),
            dk1.to(k1.dtype),
            dk2.to(k2.dtype),
            dv.to(v.dtype),
            dlam.to(ctx.lam_dtype),
            None,
            None,
        )


def fused_diff_v1(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    mask: AttentionMask,
    scale: float,
) -> torch.Tensor:
    """DIFF V1 Eq.1, ``(softmax(Q1K1ᵀ·scale) − λ softmax(Q2K2ᵀ·scale)) V``, on the compiled
    CPU kernel or the blocked path of this module (calls that need no gradient skip the
    autograd node). Shapes as :func:`diffattn.attention.kernels.differential_attention`."""
    if torch.compiler.is_compiling():
        return differential_rows(q1, q2, k1, k2, v, lam, mask, scale)
    inputs = (q1, q2, k1, k2, v, lam)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if not needs_grad and _compiled_kernel_for(q1, mask):  # inference, decode: no autograd
        keys = _keys_and_values(True, k1, k2, v)
        return _compiled_forward(q1, q2, *keys, float(lam), mask, scale)[0]
    if isinstance(mask.query_offset, torch.Tensor):  # a static cache, run eagerly
        mask = dataclasses.replace(mask, query_offset=int(mask.query_offset))
    return _FusedDiffV1.apply(q1, q2, k1, k2, v, lam, mask, scale)


def _ready(q: torch.Tensor) -> str | None:
    """Why ``auto`` should not pick ``fused`` here: its fast path is the compiled CPU kernel
    (built on first use; the blocked torch path is for explicit use and for custom masks)."""
    if q.device.type != "cpu":
        return f"its fast path is the compiled CPU kernel, got device={q.device}"
    if not USE_COMPILED:
        return "the compiled CPU kernel is switched off (fused.USE_COMPILED = False)"
    reason = cpu_kernel.unavailable()
    return None if reason is None else f"compiled CPU kernel unavailable ({reason})"


register_backend(
    Backend(
        "fused",
        sdpa_attention,
        diff_v1=fused_diff_v1,
        diff_v2=compose_v2(sdpa_attention),
        ready=_ready,
        description="DIFF V1 with QKᵀ at width d and V read once, no N×N tensor: a compiled "
        "C++ kernel on the CPU, blocked torch ops elsewhere (fp32 compute); baseline and "
        "DIFF V2 on sdpa",
    )
)
