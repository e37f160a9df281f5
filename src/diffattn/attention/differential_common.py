"""Pieces shared by the differential types built on DIFF V1's layout (``dint``, ``gated_diff``).

Both keep DIFF V1's heads (Ye et al., ICLR 2025, §2.1): query half-heads ``(2j, 2j+1)`` are
(Q1, Q2) of differential head j, key half-heads ``(2g, 2g+1)`` are (K1, K2) of KV group g, V
has ``n_kv_heads / 2`` heads of width 2d, and each head's output goes through Eq.3's per-head
RMSNorm over 2d. What they share beyond :mod:`diffattn.attention.diff_v1` is here: the
declarations' common part (:class:`PairedHeadsType`), the choice checks of their options and
the output of a map that multiplies V (``output_attentions``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from diffattn.attention.diff_v1 import DIFF_V1
from diffattn.attention.mask import expand_kv
from diffattn.attention.types import AttentionType, CacheLayout


def one_of(*choices: Any) -> Callable[[Any], str | None]:
    """A :attr:`~diffattn.attention.types.TypeOption.check`: the value is one of ``choices``."""

    def check(value: Any) -> str | None:
        if value in choices:
            return None
        return f"must be one of {', '.join(map(repr, choices))}, got {value!r}"

    return check


def paired_head_problems(type_name: str, config) -> list[tuple[str, str]]:
    """``(field, why)`` when ``config``'s heads do not pair as DIFF V1's do: an odd
    ``n_heads`` (query half-heads Q1, Q2) or an odd ``n_kv_heads`` (key half-heads K1, K2)."""
    if config.n_heads % 2 != 0:
        why = (
            f"{type_name} pairs query heads into differential heads (Q1, Q2), so n_heads must "
            f"be even, got {config.n_heads}"
        )
        return [("n_heads", why)]
    if config.num_kv_heads % 2 != 0:
        why = (
            f"{type_name} pairs key heads (K1, K2) and needs an even n_kv_heads, got "
            f"{config.num_kv_heads}"
        )
        return [("n_kv_heads", why)]
    return []


def output_from_map(applied: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``applied @ V`` per head: ``applied`` ``(B, H, N, S)`` (fp32), ``v`` ``(B, H_kv, S, w)``
    read by head j as group ``j // (H / H_kv)``; the result in ``v``'s dtype.

    With ``output_attentions`` a layer's output is computed from the map it returns, as
    :class:`~diffattn.attention.observe.MapRecorder` does for DIFF V1 and V2, so gradients reach
    that map."""
    return torch.matmul(applied, expand_kv(v, applied.shape[1]).float()).to(v.dtype)


class PairedHeadsType(AttentionType):
    """What a declaration on DIFF V1's heads shares with DIFF V1: even head counts, the KV
    cache and the tensor-parallel units (KV groups of two key half-heads and one 2d-wide value
    head), two query heads per output head, its maps' FLOPs and the λ_init depth schedule that
    the head norm's factor reads. DIFF V1's own declaration stays as it is."""

    differential = True
    heads_per_output_head = 2
    config_fields = DIFF_V1.config_fields  # λ_init, λ std, the head norm

    def check(self, config) -> list[tuple[str, str]]:
        return paired_head_problems(self.name, config)

    def cache_layout(self, config) -> CacheLayout:
        return DIFF_V1.cache_layout(config)  # K1/K2 of width d, V of width 2d

    def kv_units(self, config) -> int:
        return config.num_kv_heads // 2

    def kv_unit_name(self, config) -> str:
        return f"{self.title} KV groups (key-head pairs)"

    def matches_by_ffn(self, config) -> bool:
        return False  # a few vectors a layer: matched by construction, as DIFF V1

    def attention_flops_for_keys(self, config, keys: float, v1_form: str) -> float:
        """DIFF V1's two maps per differential head and their products with V of width 2d."""
        return DIFF_V1.attention_flops_for_keys(config, keys, v1_form)

    def lambda_init(self, config, layer_index: int) -> float:
        return config.lambda_init_for_layer(layer_index)
