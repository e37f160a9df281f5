"""DIFF V1 on the Triton kernels as ``torch.library`` custom ops, so ``torch.compile`` keeps a
call inside its graph: ``diffattn::triton_diff_v1_forward`` and
``diffattn::triton_diff_v1_backward`` (its own op), joined by ``register_autograd``, each with
a fake (meta) implementation. The ops take CUDA tensors, and CPU tensors under
``TRITON_INTERPRET=1``. λ, the key segments (padding and packed documents) and a tensor query
offset are read on the device: no call synchronises the host with the GPU.
"""

from typing import Optional

import torch

from diffattn.attention.triton_diff_v1 import kernels


@torch.library.custom_op("diffattn::triton_diff_v1_forward", mutates_args=())
def triton_diff_v1_forward(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    key_segments: Optional[torch.Tensor],  # noqa: UP045 (torch.library reads the annotation)
    query_offset: Optional[torch.Tensor],  # noqa: UP045
    offset: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq.1's ``O``, the second map's output ``O2`` and both maps' base-2 logsumexps."""
    return kernels.forward(
        q1,
        q2,
        k1,
        k2,
        v,
        lam.contiguous(),
        key_segments,
        query_offset,
        offset,
        scale,
    )


@triton_diff_v1_forward.register_fake
def _forward_fake(q1, q2, k1, k2, v, lam, key_segments, query_offset, offset, scale):
    bsz, h, n, _ = q1.shape
    out = q1.new_empty(bsz, h, n, v.shape[-1])
    lse = q1.new_empty(bsz, h, n, dtype=torch.float32)
    return out, torch.empty_like(out), lse, torch.empty_like(lse)


@torch.library.custom_op("diffattn::triton_diff_v1_backward", mutates_args=())
def triton_diff_v1_backward(
    grad_out: torch.Tensor,
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    key_segments: Optional[torch.Tensor],  # noqa: UP045
    query_offset: Optional[torch.Tensor],  # noqa: UP045
    offset: int,
    scale: float,
    out: torch.Tensor,
    o2: torch.Tensor,
    lse1: torch.Tensor,
    lse2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q1, q2, k1, k2, v and λ (FlashAttention-2's split: dK/dV, then dQ)."""
    tensors = (q1, q2, k1, k2, v, lam)
    grads = kernels.backward(
        grad_out,
        *tensors[:5],
        lam.contiguous(),
        key_segments,
        query_offset,
        offset,
        scale,
        out,
        o2,
        lse1,
        lse2,
    )
    return tuple(g.reshape(x.shape) for g, x in zip(grads, tensors, strict=True))


@triton_diff_v1_backward.register_fake
def _backward_fake(grad_out, q1, q2, k1, k2, v, lam, *_):
    return tuple(torch.empty_like(x) for x in (q1, q2, k1, k2, v, lam))


def _setup_context(ctx, inputs, output):
    q1, q2, k1, k2, v, lam, key_segments, query_offset, offset, scale = inputs
    out, o2, lse1, lse2 = output
    ctx.save_for_backward(q1, q2, k1, k2, v, lam, key_segments, query_offset, out, o2, lse1, lse2)
    ctx.offset, ctx.scale = offset, scale
    ctx.mark_non_differentiable(o2, lse1, lse2)


def _backward(ctx, grad_out, _grad_o2, _grad_lse1, _grad_lse2):
    q1, q2, k1, k2, v, lam, key_segments, query_offset, out, o2, lse1, lse2 = ctx.saved_tensors
    grads = triton_diff_v1_backward(
        grad_out, q1, q2, k1, k2, v, lam, key_segments, query_offset, ctx.offset, ctx.scale,
        out, o2, lse1, lse2,
    )  # fmt: skip
    return (*grads, None, None, None, None)


triton_diff_v1_forward.register_autograd(_backward, setup_context=_setup_context)


def diff_v1_attention(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    key_padding: torch.Tensor | None,
    query_offset: int | torch.Tensor,
    scale: float,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """DIFF V1 Eq.1, ``(softmax(Q1K1ᵀ·s) − λ·softmax(Q2K2ᵀ·s))·V``, on the Triton kernels.

    q1, q2 ``(B, H, N, d)``; k1, k2 ``(B, Hkv, S, d)``; v ``(B, Hkv, S, 2d)``; λ one element
    (any shape, e.g. 0-d); ``key_padding`` ``(B, S)`` bool or ``None``; ``query_offset`` an
    int or a 0-d integer tensor (read on the device); ``documents`` ``(B, S)`` integer document
    of each key position (packed rows) or ``None``. Differentiable in q1, q2, k1, k2, v, λ.
    """
    _check(q1, q2, k1, k2, v, lam)
    keys = (q1.shape[0], k1.shape[2])
    for name, value in (("key_padding", key_padding), ("documents", documents)):
        if value is not None and tuple(value.shape) != keys:
            raise ValueError(
                f"triton DIFF V1 takes {name} of shape (B, S) = {keys}, got {tuple(value.shape)}"
            )
    key_segments = segments(key_padding, documents)
    lam = lam.to(q1.device)
    if isinstance(query_offset, torch.Tensor):
        out, *_ = triton_diff_v1_forward(
            q1, q2, k1, k2, v, lam, key_segments, query_offset, 0, scale
        )
    else:
        out, *_ = triton_diff_v1_forward(
            q1, q2, k1, k2, v, lam, key_segments, None, int(query_offset), scale
        )
    return out


def segments(key_padding: torch.Tensor | None, documents: torch.Tensor | None):
    """The kernels' key segments ``(B, S)`` int32: 0 for padding, the 1-based index of the
    token's run of equal document ids (1 without documents) for a real token; a query reads
    the keys of its own segment (and itself). Runs, not raw ids: any integer ids fit, and an
    id that comes back later is another document, as the model reads it. ``None`` when there
    is neither padding nor documents."""
    if key_padding is None and documents is None:
        return None
    if documents is None:
        return key_padding.to(torch.int32)
    changes = documents[:, 1:] != documents[:, :-1]  # runs of equal ids, numbered from 1
    ids = torch.nn.functional.pad(changes.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))
    ids = ids + 1
    if key_padding is not None:
        ids = ids * key_padding.to(torch.int32)
    return ids


def _check(q1, q2, k1, k2, v, lam) -> None:
    if lam.numel() != 1:
        raise ValueError(f"triton DIFF V1 takes one λ per call, got λ of shape {tuple(lam.shape)}")
    if v.shape[-1] != 2 * q1.shape[-1] or q2.shape != q1.shape or k2.shape != k1.shape:
        raise ValueError(
            "triton DIFF V1 takes q1, q2 (B, H, N, d), k1, k2 (B, Hkv, S, d) and v "
            f"(B, Hkv, S, 2d); got {tuple(q1.shape)}, {tuple(q2.shape)}, {tuple(k1.shape)}, "
            f"{tuple(k2.shape)}, {tuple(v.shape)}"
        )
    if q1.shape[1] % k1.shape[1] != 0:
        raise ValueError(
            f"triton DIFF V1: {q1.shape[1]} query heads are not a multiple of {k1.shape[1]} "
            "KV heads"
        )
    if q1.dtype not in kernels.DOT_TYPES:
        raise ValueError(f"triton DIFF V1 takes fp32, fp16 or bf16, got {q1.dtype}")
