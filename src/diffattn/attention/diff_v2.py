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
from diffattn.attention.registry import ENTRY_DIFF_V2
from diffattn.attention.types import AttentionType, ServedWeight, register_attention_type
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


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class DiffV2(AttentionType):
    """DIFF V2 (blog, "Code"): ``2·n_heads`` query heads interleaved in their GQA groups,
    the baseline's KV heads, W_λ: d_model → n_heads; parameter matched by narrowing the
    SwiGLU (``presets.match_params``)."""

    name = "diff_v2"
    title = "DIFF V2"
    colour = "tab:orange"
    module = DiffAttentionV2
    config_fields = ("v2_paired_heads", "v2_use_lambda", "v2_lambda_sigmoid")
    differential = True
    paper_claims = True
    entry = ENTRY_DIFF_V2
    bench_by_default = True
    source = "Differential Transformer V2 (blog, Jan 2026), section Code"
    lambda_label = "mean sigmoid(x·W_λ)"
    lambda_key = "lambda_mean"
    vllm_reason = None
    tensor_parallel = True
    context_parallel_reason = None  # λ = sigmoid(x W_λ) is token-wise: local to each rank

    def query_heads(self, config) -> int:
        return 2 * config.n_heads

    def token_lambda(self, module):
        """λ_i = sigmoid(x W_λ)_i per token and pair (the raw projection with
        ``v2_lambda_sigmoid=False``), from ``lambda_proj``; none in the no-λ ablation."""
        if module.lambda_proj is None:
            return None
        return module.lambda_proj, torch.sigmoid if module.config.v2_lambda_sigmoid else _same

    def extra_linear_outputs(self, config) -> int:
        return config.n_heads if config.v2_use_lambda else 0  # W_λ

    def extra_parameters(self, config) -> int:
        """The second half of W_Q and W_λ."""
        return config.d_model * config.n_heads * config.dim_per_head + config.d_model * (
            self.extra_linear_outputs(config)
        )

    def tp_problem(self, config, tp: int) -> str | None:
        if tp > 1 and not config.v2_paired_heads:
            return (
                "the unpaired DIFF V2 ablation (v2_paired_heads=false) pairs heads i and i+h "
                "of different KV groups, which tensor parallelism cannot keep on one rank"
            )
        return None

    def tp_plan(self, config, colwise, replicated):
        return {"lambda_proj": colwise()} if config.v2_use_lambda else {}  # λ_i by its pair

    def vllm_weights(self, config, layer_index: int) -> dict[str, ServedWeight]:
        if not config.v2_use_lambda:
            return {}
        return {"lambda_proj.weight": ServedWeight((config.n_heads, config.d_model), split_dim=0)}

    def vllm_output(self, config, layer_index: int, out, x, weights):
        """``o_2i − λ_i·o_2i+1`` on the call's output ``(T, 2H·d)`` → ``(T, H·d)``, with
        λ = sigmoid(x W_λ) of this rank's heads; the ablations: pairs (i, i+H), no λ
        (``o1 − o2``), the projection without sigmoid."""
        d, tokens = config.dim_per_head, out.shape[0]
        heads = out.view(tokens, -1, d)
        if config.v2_paired_heads:
            o1, o2 = heads[:, 0::2], heads[:, 1::2]
        else:
            o1, o2 = heads.chunk(2, dim=1)
        if "lambda_proj.weight" not in weights:
            return (o1 - o2).reshape(tokens, -1)
        lam = nn.functional.linear(x, weights["lambda_proj.weight"])
        if config.v2_lambda_sigmoid:
            lam = torch.sigmoid(lam)
        return (o1 - lam.unsqueeze(-1) * o2).reshape(tokens, -1)

    def describe(self, config) -> str:
        d = config.dim_per_head
        return (
            f"DIFF V2: {2 * config.n_heads} query heads of width {d} in "
            f"{config.n_heads} pairs, {config.num_kv_heads} KV heads"
        )


DIFF_V2 = register_attention_type(DiffV2())
