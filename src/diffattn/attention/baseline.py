"""The matched baseline: LLaMA-style grouped-query softmax attention (no biases, RoPE)."""

from __future__ import annotations

from diffattn.attention.common import ProjectedAttention, with_maps
from diffattn.attention.kernels import softmax_attention
from diffattn.attention.types import AttentionType, register_attention_type


class BaselineAttention(ProjectedAttention):
    """``softmax(QKᵀ/√d) V`` over ``n_heads`` query and ``n_kv_heads`` key/value heads (the
    projections of :class:`ProjectedAttention` as they are)."""

    def attend(self, x, q, k, v, mask, need_weights):
        """``softmax(QKᵀ/√d) V`` on the module's backend."""
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
        return out, maps


class Baseline(AttentionType):
    """The matched Transformer: LLaMA's grouped-query softmax attention, every default of
    :class:`AttentionType` as it is."""

    name = "baseline"
    title = "Transformer"
    colour = "tab:gray"
    module = BaselineAttention
    source = "LLaMA (Touvron et al., 2023): RoPE, grouped-query attention, no biases"
    vllm_reason = None
    hf_format = "hf-llama"
    tensor_parallel = True
    bench_by_default = True
    context_parallel_reason = None  # rows over the gathered K/V (attention.context_parallel)


BASELINE = register_attention_type(Baseline())
