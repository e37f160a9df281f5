"""DIFF V2 (blog "Differential Transformer V2", section "Code").

2h query heads of width d, interleaved so that pair (2i, 2i+1) lies in one GQA group and so
reads the same K and V; k and v keep the baseline's h_kv heads. One ordinary softmax-attention
call, then ``out_i = o_{2i} − sigmoid(x W_λ)_i · o_{2i+1}`` with a token-wise, head-wise λ.
No per-head norm; W_O reads h·d channels exactly as in the baseline, so the KV cache has the
baseline's size.

Ablation switches (blog, "Design Ablations"): ``v2_paired_heads=False`` subtracts head i+h from
head i (different GQA groups), ``v2_use_lambda=False`` drops λ, ``v2_lambda_sigmoid=False`` uses
the projected λ without the sigmoid.
"""

from __future__ import annotations

import torch
from torch import nn

from diffattn.attention.common import ProjectedAttention, with_maps
from diffattn.attention.kernels import differential_attention_v2
from diffattn.config import ModelConfig


class DiffAttentionV2(ProjectedAttention):
    """DIFF V2 attention with ``n_heads`` output heads and ``2·n_heads`` query heads."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index, q_heads=2 * config.n_heads)
        self.lambda_proj = (
            nn.Linear(config.d_model, self.n_heads, bias=False) if config.v2_use_lambda else None
        )

    def token_lambda(self, x: torch.Tensor) -> torch.Tensor | None:
        """λ = sigmoid(x W_λ), shape ``(B, h, N, 1)``; raw projection or ``None`` in ablations."""
        if self.lambda_proj is None:
            return None
        lam = self.lambda_proj(x).transpose(1, 2).unsqueeze(-1)
        return torch.sigmoid(lam) if self.config.v2_lambda_sigmoid else lam

    def attend(self, x, q, k, v, mask, need_weights):
        """One softmax attention over the 2h query heads, then ``o_2i − λ_i·o_2i+1``."""
        out, maps = with_maps(
            self.layer_index,
            need_weights,
            differential_attention_v2,
            q,
            k,
            v,
            self.token_lambda(x),
            mask,
            self.scale,
            self.backend,
            paired=self.config.v2_paired_heads,
            layer=self.layer_index,
        )
        return out, maps
