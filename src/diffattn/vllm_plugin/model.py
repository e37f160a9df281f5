"""``DiffAttnForCausalLM`` for vLLM: diffattn checkpoints (baseline, DIFF V1, DIFF V2) on vLLM's
paged KV cache, continuous batching, prefix caching and chunked prefill.

Built from vLLM's own layers: ``VocabParallelEmbedding``, ``QKVParallelLinear`` (q, k, v of
width d as the checkpoint stores them), its rotary embedding (rotate-half or interleaved as
``rope_style`` says), ``Attention`` over the paged cache, ``RMSNorm``, the SwiGLU's
``MergedColumnParallelLinear`` + ``SiluAndMul`` + ``RowParallelLinear``, ``ParallelLMHead`` and
``LogitsProcessor``. How each attention type becomes one stock attention call is
:mod:`diffattn.vllm_plugin.layout`; the arithmetic after the call (DIFF V1 Eq. 1 and 3, DIFF V2's
``o1 − λ·o2``) is the same as diffattn's forward, rounded at the same places.

The weights are read from the checkpoint's safetensors under the names diffattn writes
(``model.layers.{i}.attn.q_proj.weight``, ...); a missing or unexpected tensor is an error
naming it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from diffattn.config import ModelConfig
from diffattn.vllm_plugin.layout import (
    attention_layout,
    head_size_problem,
    v1_combine,
    v1_padded_queries,
    v2_combine,
)

LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def model_config_of(hf_config) -> ModelConfig:
    """The diffattn :class:`ModelConfig` of the checkpoint vLLM opened."""
    to_model_config = getattr(hf_config, "to_model_config", None)
    if to_model_config is None:
        raise ValueError(
            f"diffattn's vLLM model serves diffattn checkpoints (model_type 'diffattn'), got a "
            f"config of type {type(hf_config).__name__}"
        )
    return to_model_config()


def check_head_size(config: ModelConfig, layout, backend) -> None:
    """Refuse, before any request, a head width the chosen attention backend cannot run."""
    problem = head_size_problem(config, layout, backend)
    if problem is not None:
        raise ValueError(problem)


class DiffAttnAttention(nn.Module):
    """One attention layer of any type over vLLM's paged cache (layouts: ``layout.py``)."""

    def __init__(self, config: ModelConfig, layer_index: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.kind = config.attention
        self.config = config
        d = config.dim_per_head
        self.head_dim = d
        layout = attention_layout(config, tp_size)
        self.layout = layout
        self.qkv_proj = QKVParallelLinear(
            config.d_model,
            d,
            config.n_query_heads,
            config.num_kv_heads,
            bias=False,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.q_size = config.n_query_heads // tp_size * d
        self.kv_size = config.num_kv_heads // tp_size * d
        self.o_proj = RowParallelLinear(
            config.n_heads * d,
            config.d_model,
            bias=False,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            d,
            max_position=config.max_seq_len,
            is_neox_style=config.rope_style == "half",
            rope_parameters={"rope_theta": config.rope_theta, "rope_type": "default"},
            dtype=torch.float32,
        )
        self.attn = Attention(
            layout.num_heads,
            layout.head_size,
            layout.scale,
            num_kv_heads=layout.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.attn",
        )
        check_head_size(config, layout, self.attn.attn_backend)
        if self.kind == "diff_v1":
            self.lambda_init = config.lambda_init_for_layer(layer_index)
            for name in LAMBDA_VECTORS:
                self.register_parameter(name, nn.Parameter(torch.empty(d), requires_grad=False))
            self.head_norm_eps = config.head_norm_eps if config.head_norm else None
            if config.head_norm and config.head_norm_learnable:
                self.head_norm_weight = nn.Parameter(torch.empty(2 * d), requires_grad=False)
            else:
                self.head_norm_weight = None
        if self.kind == "diff_v2" and not config.v2_paired_heads and tp_size > 1:
            raise ValueError(
                "the unpaired DIFF V2 ablation (v2_paired_heads=False) subtracts heads that "
                "tensor parallelism places on different ranks; serve it with "
                "tensor_parallel_size=1"
            )
        if self.kind == "diff_v2" and config.v2_use_lambda:
            self.lambda_proj = ColumnParallelLinear(
                config.d_model,
                config.n_heads,
                bias=False,
                gather_output=False,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.lambda_proj",
            )
        else:
            self.lambda_proj = None

    def lambda_full(self) -> torch.Tensor:
        """DIFF V1 Eq. 2 in fp32: exp(λq1·λk1) − exp(λq2·λk2) + λ_init."""
        dot1 = torch.sum(self.lambda_q1.float() * self.lambda_k1.float())
        dot2 = torch.sum(self.lambda_q2.float() * self.lambda_k2.float())
        return torch.exp(dot1) - torch.exp(dot2) + self.lambda_init

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        d = self.head_dim
        if self.kind == "diff_v1":
            out = self.attn(v1_padded_queries(q, d), k, v)
            out = v1_combine(
                out,
                self.lambda_full(),
                d,
                self.head_norm_weight,
                self.head_norm_eps,
                self.lambda_init,
            )
        elif self.kind == "diff_v2":
            out = self.attn(q, k, v)
            lam = None
            if self.lambda_proj is not None:
                lam, _ = self.lambda_proj(x)
                if self.config.v2_lambda_sigmoid:
                    lam = torch.sigmoid(lam)
            out = v2_combine(out, lam, d, self.config.v2_paired_heads)
        else:
            out = self.attn(q, k, v)
        out, _ = self.o_proj(out)
        return out


class DiffAttnDecoderLayer(nn.Module):
    """DIFF V1 §2.2 Eq. 4–5: pre-norm attention and SwiGLU with residual connections."""

    def __init__(self, config: ModelConfig, layer_index: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        quant = vllm_config.quant_config
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = DiffAttnAttention(config, layer_index, vllm_config, f"{prefix}.attn")
        self.ffn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.d_model,
            [config.ffn_dim] * 2,
            bias=False,
            quant_config=quant,
            prefix=f"{prefix}.ffn.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            config.ffn_dim,
            config.d_model,
            bias=False,
            quant_config=quant,
            prefix=f"{prefix}.ffn.down_proj",
        )
        self.act = SiluAndMul()

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.attn_norm(hidden)
        else:
            hidden, residual = self.attn_norm(hidden, residual)
        hidden = self.attn(positions, hidden)
        hidden, residual = self.ffn_norm(hidden, residual)
        up, _ = self.gate_up_proj(hidden)
        hidden, _ = self.down_proj(self.act(up))
        return hidden, residual


class DiffAttnForCausalLM(nn.Module):
    """vLLM's model class for ``architectures: ["DiffAttnForCausalLM"]`` checkpoints."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = model_config_of(vllm_config.model_config.hf_config)
        self.config = config
        quant = vllm_config.quant_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(
            DiffAttnDecoderLayer(config, i, vllm_config, f"{prefix}model.layers.{i}")
            for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.d_model, quant_config=quant, prefix=f"{prefix}lm_head"
        )
        if config.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if intermediate_tensors is not None:
            raise ValueError("diffattn's vLLM model does not support pipeline parallelism")
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # ------------------------------------------------------------------------------------
    def _destination(self, name: str) -> tuple[str, object]:
        """The parameter a checkpoint tensor goes to, and the shard id for stacked ones."""
        if not name.startswith("model."):
            raise ValueError(f"unexpected tensor {name!r} (diffattn keys start with 'model.')")
        key = name[len("model.") :]
        parts = key.split(".")
        if parts[0] == "layers" and len(parts) >= 4:
            prefix = ".".join(parts[:2])
            rest = ".".join(parts[2:])
            stacked = {
                "attn.q_proj.weight": ("attn.qkv_proj.weight", "q"),
                "attn.k_proj.weight": ("attn.qkv_proj.weight", "k"),
                "attn.v_proj.weight": ("attn.qkv_proj.weight", "v"),
                "ffn.gate_proj.weight": ("gate_up_proj.weight", 0),
                "ffn.up_proj.weight": ("gate_up_proj.weight", 1),
                "ffn.down_proj.weight": ("down_proj.weight", None),
                "attn.head_norm.weight": ("attn.head_norm_weight", None),
            }
            target, shard = stacked.get(rest, (rest, None))
            return f"{prefix}.{target}", shard
        if key == "lm_head.weight":
            return "lm_head.weight", None
        return key, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = self._destination(name)
            if target == "lm_head.weight" and self.config.tie_embeddings:
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"the checkpoint holds {name!r}, which this {self.config.attention} model "
                    "has no parameter for"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        if self.config.tie_embeddings:
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks tensors for: {', '.join(missing)}")
        return loaded


def kv_cache_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the paged KV cache vLLM allocated to each attention layer of ``model``.

    For ``LLM.apply_model`` (which runs it where the model lives); divided by the cache's
    capacity in tokens (``num_gpu_blocks · block_size`` of vLLM's cache config) it is the
    measured cache cost per token that docs/serving.md states."""
    sizes = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            cache = module.kv_cache
            tensors = cache if isinstance(cache, list | tuple) else [cache]
            sizes[name] = tensors[0].numel() * tensors[0].element_size()
    return sizes
