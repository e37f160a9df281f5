"""DIFF V1's values in caches built for equal K and V head counts.

DIFF V1 (paper §2.1, Eq.1) keeps ``n_kv_heads`` key half-heads of width d but ``n_kv_heads / 2``
value heads of width 2d. Hugging Face's caches (``DynamicCache``, ``StaticCache``, the paged
cache of continuous batching) hold K and V with the same head count and width, so each width-2d
value head is stored as two width-d heads (an exact reshape: its first and second d channels)
and reassembled on read. For the baseline and DIFF V2 K and V already match and nothing changes.
"""

from __future__ import annotations

import torch


def value_parts(keys: torch.Tensor, values: torch.Tensor) -> int:
    """How many width-d cache heads one value head occupies: ``K heads / V heads`` (2 for DIFF
    V1, 1 otherwise), for ``(B, H, N, w)`` tensors."""
    return keys.shape[1] // values.shape[1]


def split_value_heads(values: torch.Tensor, parts: int) -> torch.Tensor:
    """``(B, Hv, N, parts·d)`` → ``(B, Hv·parts, N, d)``: value head ``j`` becomes cache heads
    ``parts·j … parts·j + parts − 1``, each holding ``d`` of its channels in order."""
    if parts == 1:
        return values
    b, hv, n, w = values.shape
    values = values.reshape(b, hv, n, parts, w // parts).transpose(2, 3)
    return values.reshape(b, hv * parts, n, w // parts)


def merge_value_heads(values: torch.Tensor, parts: int) -> torch.Tensor:
    """The inverse of :func:`split_value_heads`:
    ``(B, H, N, d)`` → ``(B, H / parts, N, parts·d)``."""
    if parts == 1:
        return values
    b, h, n, w = values.shape
    values = values.reshape(b, h // parts, parts, n, w).transpose(2, 3)
    return values.reshape(b, h // parts, n, parts * w)


__all__ = ["merge_value_heads", "split_value_heads", "value_parts"]
