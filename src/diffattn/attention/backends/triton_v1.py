"""``triton``: DIFF V1 (Eq.1) on the Triton kernels of :mod:`diffattn.attention.triton_diff_v1`
(CUDA; fp32, fp16, bf16), forward and backward, as a ``torch.library`` custom op that
``torch.compile`` keeps in its graph; baseline and DIFF V2 calls run on ``sdpa``.

Usable on CUDA tensors when ``triton`` is installed (``pip install 'diffattn[triton]'``), and
on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first call),
which is how the tests check the kernels without a GPU. Causal masking, key padding / var-len
and query offsets (KV cache) are handled in the kernels; full custom masks go to ``sdpa``.
"""

from __future__ import annotations

import importlib.util

import torch

from diffattn.attention.backends.reference import differential_rows
from diffattn.attention.backends.sdpa import sdpa_attention
from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import Backend, compose_v2, register_backend
from diffattn.attention.triton_diff_v1.configs import interpreting


def _unusable(q: torch.Tensor) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package (pip install 'diffattn[triton]'); use backend='sdpa'"
    if not q.is_cuda and not interpreting():
        return (
            f"runs on CUDA (or on CPU under TRITON_INTERPRET=1), got device={q.device}; "
            "use backend='fused' or 'sdpa'"
        )
    return None


def triton_diff_v1(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    mask: AttentionMask,
    scale: float,
) -> torch.Tensor:
    """DIFF V1 Eq.1 on the Triton kernels; shapes as
    :func:`diffattn.attention.kernels.differential_attention`. A traced one-query call (a
    compiled decode step) takes :func:`differential_rows`, whose ``(B, H, 1, S)`` maps are
    plain tensor ops; every other call, traced or not, runs the custom op."""
    if torch.compiler.is_compiling() and q1.shape[2] == 1:
        return differential_rows(q1, q2, k1, k2, v, lam, mask, scale)
    from diffattn.attention.triton_diff_v1.op import diff_v1_attention

    return diff_v1_attention(
        q1, q2, k1, k2, v, lam, mask.key_padding, mask.query_offset, scale, mask.document_ids
    )


register_backend(
    Backend(
        "triton",
        sdpa_attention,
        diff_v1=triton_diff_v1,
        diff_v2=compose_v2(sdpa_attention),
        unusable=_unusable,
        custom_masks=False,
        document_masks=True,
        description="DIFF V1 Triton kernels (CUDA fp32/fp16/bf16), QKᵀ at width d, K/V tiles "
        "loaded once for both maps; baseline and DIFF V2 on sdpa",
    )
)
