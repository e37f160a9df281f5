"""The matched baseline: LLaMA-style grouped-query softmax attention (no biases, RoPE)."""

from __future__ import annotations

import torch
from torch import nn

from diffattn.attention.common import (
    AttentionMaps,
    merge_heads,
    project_qkv,
    with_maps,
)
from diffattn.attention.kernels import AttentionMask, softmax_attention
from diffattn.config import ModelConfig


class BaselineAttention(nn.Module):
    """``softmax(QKᵀ/√d) V`` over ``n_heads`` query and ``n_kv_heads`` key/value heads."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        d, h, h_kv = config.dim_per_head, config.n_heads, config.num_kv_heads
        self.head_dim, self.n_heads, self.n_kv_heads = d, h, h_kv
        self.scale = d**-0.5
        self.backend = config.backend  # a run-time choice: DiffTransformerLM.set_backend
        self.q_proj = nn.Linear(config.d_model, h * d, bias=False)
        self.k_proj = nn.Linear(config.d_model, h_kv * d, bias=False)
        self.v_proj = nn.Linear(config.d_model, h_kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.d_model, bias=False)

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
