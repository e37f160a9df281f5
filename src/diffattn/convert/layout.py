"""Row permutations that move attention weights between head layouts, exactly.

Every function here reorders the *output rows* of a projection weight ``(rows, in_features)``
(or of any tensor whose first axis is ``n_heads · head_dim``); values are only moved, never
computed, so a conversion and its inverse give back identical tensors.

Head pairing (DIFF V1). diffattn pairs adjacent half-heads: query heads ``(2j, 2j+1)`` are
``(Q1, Q2)`` of differential head j, key heads ``(2g, 2g+1)`` are ``(K1, K2)`` of KV group g,
and value head g of width 2d is the two d-wide rows ``(2g, 2g+1)``. Hugging Face DiffLlama pairs
head ``h`` with head ``h + H/2`` instead (it chunks the head axis into two halves), for queries,
keys and the two halves of V alike. :func:`halves_to_pairs` turns the HF order into adjacent
pairs and :func:`pairs_to_halves` undoes it.

RoPE channel order. ``rope_style="interleaved"`` rotates channel pairs ``(2i, 2i+1)`` by
frequency i; rotate-half (Llama, HF) rotates ``(i, i + d/2)``. Moving channel ``2i`` to ``i``
and ``2i+1`` to ``i + d/2`` in every query and key head (:func:`interleaved_to_half`) turns one
into the other exactly, because ``q·k`` is unchanged when q and k are permuted alike.
"""

from __future__ import annotations

import torch


def _check(weight: torch.Tensor, n_heads: int, head_dim: int, even_heads: bool) -> None:
    if weight.shape[0] != n_heads * head_dim:
        raise ValueError(
            f"expected {n_heads} heads of width {head_dim} ({n_heads * head_dim} rows), "
            f"got a tensor of shape {tuple(weight.shape)}"
        )
    if even_heads and n_heads % 2:
        raise ValueError(f"head pairing needs an even number of heads, got {n_heads}")


def halves_to_pairs(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """HF DiffLlama order (head h pairs with h + H/2) → adjacent pairs (2j, 2j+1).

    Output head ``2j + s`` is input head ``j + s·H/2`` for ``s ∈ {0, 1}``.
    """
    _check(weight, n_heads, head_dim, even_heads=True)
    rest = weight.shape[1:]
    grid = weight.reshape(2, n_heads // 2, head_dim, *rest)
    return grid.transpose(0, 1).reshape(weight.shape).contiguous()


def pairs_to_halves(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Adjacent pairs (2j, 2j+1) → HF DiffLlama order; the inverse of :func:`halves_to_pairs`."""
    _check(weight, n_heads, head_dim, even_heads=True)
    rest = weight.shape[1:]
    grid = weight.reshape(n_heads // 2, 2, head_dim, *rest)
    return grid.transpose(0, 1).reshape(weight.shape).contiguous()


def interleaved_to_half(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Channels of each head from interleaved RoPE order to rotate-half order.

    Output channel ``i`` is input channel ``2i`` and output channel ``i + d/2`` is input
    channel ``2i + 1``, in every one of the ``n_heads`` heads.
    """
    _check(weight, n_heads, head_dim, even_heads=False)
    rest = weight.shape[1:]
    grid = weight.reshape(n_heads, head_dim // 2, 2, *rest)
    return grid.transpose(1, 2).reshape(weight.shape).contiguous()


def half_to_interleaved(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Rotate-half channel order → interleaved; the inverse of :func:`interleaved_to_half`."""
    _check(weight, n_heads, head_dim, even_heads=False)
    rest = weight.shape[1:]
    grid = weight.reshape(n_heads, 2, head_dim // 2, *rest)
    return grid.transpose(1, 2).reshape(weight.shape).contiguous()
