"""``DiffAttnForCausalLM`` for vLLM: diffattn checkpoints on vLLM's paged KV cache, continuous
batching, prefix caching and chunked prefill, for every attention type whose declaration gives
a vLLM layout (baseline, DIFF V1, DIFF V2, GDA), each layer of its own type.

Built from vLLM's own layers: ``VocabParallelEmbedding``, ``QKVParallelLinear`` (q, k, v of
width d as the checkpoint stores them), its rotary embedding (rotate-half or interleaved as
``rope_style`` says), ``Attention`` over the paged cache, ``RMSNorm``, the SwiGLU's
``MergedColumnParallelLinear`` + ``SiluAndMul`` + ``RowParallelLinear``, ``ParallelLMHead`` and
``LogitsProcessor``; ``q_proj`` and ``o_proj`` are as wide as the type's ``query_heads`` and
``output_heads · output_width`` (GDA: ``H_s + H_n`` query heads, W_O over ``H_s·2d``). How each
layer's type becomes one stock attention call is
:mod:`diffattn.vllm_plugin.layout`; the arithmetic around the call (DIFF V1's padded queries,
Eq. 1 and 3, DIFF V2's ``o1 − λ·o2``) is its declaration's ``vllm_queries`` and
``vllm_output``, the same as diffattn's forward, rounded at the same places.

The weights are read from the checkpoint's safetensors under the names diffattn writes
(``model.layers.{i}.attn.q_proj.weight``, ...; a type's own tensors under the names its
``vllm_weights`` gives); a missing or unexpected tensor is an error naming it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
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
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors

from diffattn.attention.types import ServedWeight
from diffattn.config import ModelConfig
from diffattn.vllm_plugin.layout import attention_layout, head_size_problem


def model_config_of(hf_config) -> ModelConfig:
    """The diffattn :class:`ModelConfig` of the checkpoint vLLM opened."""
    to_model_config = getattr(hf_config, "to_model_config", None)
    if to_model_config is None:
        raise ValueError(
            f"diffattn's vLLM model serves diffattn checkpoints (model_type 'diffattn'), got a "
            f"config of type {type(hf_config).__name__}"
        )
    return to_model_config()


def check_head_size(config: ModelConfig, layer_index: int, layout, backend) -> None:
    """Refuse, before any request, a head width the chosen attention backend cannot run."""
    problem = head_size_problem(config, layer_index, layout, backend)
    if problem is not None:
        raise ValueError(problem)


def served_weight(spec: ServedWeight, tp_rank: int, tp_size: int) -> nn.Parameter:
    """This rank's part of a :class:`ServedWeight`, with the loader that cuts it out of the
    checkpoint's whole tensor."""
    shape = list(spec.shape)
    if spec.split_dim is not None:
        shape[spec.split_dim] //= tp_size
    param = nn.Parameter(torch.empty(shape), requires_grad=False)

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if spec.split_dim is not None:
            size = param.shape[spec.split_dim]
            loaded = loaded.narrow(spec.split_dim, tp_rank * size, size)
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"expected a tensor of shape {tuple(spec.shape)}, got {loaded.shape}")
        param.data.copy_(loaded)

    set_weight_attrs(param, {"weight_loader": load})
    return param


class DiffAttnAttention(nn.Module):
    """One attention layer over vLLM's paged cache, of the layer's own type: the call its
    declaration gives (``layout.py``), its queries before and its combine step after it."""

    def __init__(self, config: ModelConfig, layer_index: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.declaration = config.type_of_layer(layer_index)
        self.config = config
        self.layer_index = layer_index
        d = config.dim_per_head
        layout = attention_layout(config, layer_index, tp_size)
        self.layout = layout
        query_heads = self.declaration.query_heads(config)
        self.qkv_proj = QKVParallelLinear(
            config.d_model,
            d,
            query_heads,
            config.num_kv_heads,
            bias=False,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.q_size = query_heads // tp_size * d
        self.kv_size = config.num_kv_heads // tp_size * d
        self.o_proj = RowParallelLinear(
            self.declaration.output_heads(config) * self.declaration.output_width(config),
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
        check_head_size(config, layer_index, layout, self.attn.attn_backend)
        self.weight_names = self._add_weights(tp_size)

    def _add_weights(self, tp_size: int) -> tuple[str, ...]:
        """The type's own tensors (``vllm_weights``) as parameters under their checkpoint
        names (``head_norm.weight`` becomes the parameter ``weight`` of a child ``head_norm``)."""
        specs = self.declaration.vllm_weights(self.config, self.layer_index)
        for name, spec in specs.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                child = getattr(owner, part, None)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                if type(child) is not nn.Module:
                    owner = None
                    break
                owner = child
            if owner is None or hasattr(owner, leaf):
                raise ValueError(
                    f"attention type {self.declaration.name!r} declares a vLLM weight {name!r} "
                    "that clashes with a module of the served layer; rename it"
                )
            rank = get_tensor_model_parallel_rank()
            owner.register_parameter(leaf, served_weight(spec, rank, tp_size))
        return tuple(specs)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(self.declaration.vllm_queries(self.config, q), k, v)
        weights = {name: self.get_parameter(name) for name in self.weight_names}
        out = self.declaration.vllm_output(self.config, self.layer_index, out, x, weights)
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
                    f"the checkpoint holds {name!r}, which the served model has no parameter for"
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
