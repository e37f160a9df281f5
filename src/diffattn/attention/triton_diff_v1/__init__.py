"""Triton kernels of DIFF V1 (Eq.1): ``(softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d)) V``, forward and
backward, each map's QKᵀ at width d and each K/V tile loaded once for both maps.

Modules: :mod:`.configs` (launch configurations and their shared-memory pruning; pure Python),
:mod:`.kernels` (the Triton kernels and launches; imports ``triton``), :mod:`.op` (the
``torch.library`` custom ops that ``torch.compile`` keeps in its graphs) and :mod:`.timing`
(CUDA-event timings against the baseline's SDPA). Nothing is imported here, so
``TRITON_INTERPRET=1`` can be set before ``triton`` is first imported.

**Forward** (one program per block of ``BLOCK_M`` query rows of one query head): for each
tile of ``BLOCK_N`` keys up to the causal limit, the K1, K2 and V tiles are loaded once;
``S_a = Q_a K_aᵀ/√d`` (width d) and two online softmaxes in base 2 (running max ``m_a`` and
sum ``l_a``) update ``acc_a += P̃_a V``. The end writes ``O = acc1/l1 − λ·acc2/l2``, the second
map's output ``O2`` and the logsumexps ``L_a``. Key tiles below the block's diagonal skip the
mask (unless there is padding). FLOPs per differential head with ``M ≈ N²/2`` allowed pairs:
``4·M·d`` (QKᵀ) + ``8·M·d`` (one PV per map: the two maps are normalised separately online,
so one product with ``P1 − λP2`` would need a second pass over K).

**Backward** (FlashAttention-2's split). With ``dP1 = dO Vᵀ`` and ``dP2 = −λ dO Vᵀ``, the
softmax rule ``dS_a = P_a ∘ (dP_a − rowsum(dP_a ∘ P_a))`` gives ``dS1 = P1 ∘ (dP − r1)`` and
``dS2 = −λ·P2 ∘ (dP − r2)`` with ``dP = dO Vᵀ`` shared and ``r_a = rowsum(dO ∘ O_a)``
(preprocess; ``O1 = O + λ·O2``); ``dV = (P1 − λP2)ᵀ dO`` (one product for both maps) and
``dλ = −Σ (P2 V)·dO = −Σ r2``, summed on the device. One program per key block of one KV
head loops over the query heads of its GQA group and their query blocks, recomputing
``P_a = 2^(S_a − L_a)``, and accumulates dV, ``dK_a += dS_aᵀ Q_a/√d``; a second kernel, one
program per query block, recomputes the same and accumulates ``dQ_a = dS_a K_a/√d``. No
atomics, no N×N tensor.

Masking is :mod:`diffattn.attention.mask`'s rule: key ``j`` is read by query ``i`` iff
``j ≤ i + offset`` and (``j`` is real or ``j = i + offset``); full custom masks are not taken.
Dots accumulate in fp32 (fp32 inputs use IEEE fp32 dots, fp16/bf16 inputs their own type).
"""
