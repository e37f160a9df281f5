"""``triton``: DIFF V1 (Eq.1) on the Triton kernels of :mod:`diffattn.attention.triton_diff_v1`
(CUDA; fp32, fp16, bf16), forward and backward; baseline and DIFF V2 calls run on ``sdpa``.

Usable on CUDA tensors when ``triton`` is installed (``pip install 'diffattn[triton]'``), and
on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first call),
which is how the tests check the kernels without a GPU. Causal masking, key padding / var-len
and query offsets (KV cache) are handled in the kernels; full custom masks go to ``sdpa``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from diffattn.attention.backends.reference import differential_rows
from diffattn.attention.backends.sdpa import sdpa_attention
from diffattn.attention.mask import AttentionMask
from diffattn.attention.registry import Backend, compose_v2, register_backend

BLOCK = 64
"""Query and key rows per tile on CUDA."""
INTERPRETER_BLOCK = 32
"""Tile rows under the interpreter (small shapes, numpy speed)."""


def interpreting() -> bool:
    """Whether Triton runs its kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    :func:`diffattn.attention.kernels.differential_attention`. Calls traced by
    ``torch.compile`` take :func:`differential_rows`."""
    if torch.compiler.is_compiling():
        return differential_rows(q1, q2, k1, k2, v, lam, mask, scale)
    from diffattn.attention.triton_diff_v1 import TritonDiffV1

    block = INTERPRETER_BLOCK if not q1.is_cuda else BLOCK
    offset = int(mask.query_offset)
    return TritonDiffV1.apply(q1, q2, k1, k2, v, lam, mask.key_padding, offset, scale, block)


register_backend(
    Backend(
        "triton",
        sdpa_attention,
        diff_v1=triton_diff_v1,
        diff_v2=compose_v2(sdpa_attention),
        unusable=_unusable,
        custom_masks=False,
        description="DIFF V1 Triton kernels (CUDA fp32/fp16/bf16), QKᵀ at width d, K/V tiles "
        "loaded once for both maps; baseline and DIFF V2 on sdpa",
    )
)
