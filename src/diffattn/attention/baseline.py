"""The matched baseline: LLaMA-style grouped-query softmax attention (no biases, RoPE)."""

from __future__ import annotations

import torch

from diffattn.attention.common import (
    AttentionMaps,
    ProjectedAttention,
    merge_heads,
    project_qkv,
    with_maps,
)
from diffattn.attention.kernels import AttentionMask, softmax_attention


class BaselineAttention(ProjectedAttention):
    """``softmax(QKᵀ/√d) V`` over ``n_heads`` query and ``n_kv_heads`` key/value heads (the
    projections of :class:`ProjectedAttention` as they are)."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
        need_weights: bool = False,
        cache=None,
    ) -> tuple[torch.Tensor, AttentionMaps | None]:
        q, k, v = project_qkv(self, x, rope, cache, self.head_dim)
        (out, _), maps = with_maps(
            self.layer_index,
            need_weights,
            softmax_attention,
            q,
            k,
            v,
            mask,
            self.scale,
            self.backend,
            layer=self.layer_index,
        )
        return self.o_proj(merge_heads(out)), maps
