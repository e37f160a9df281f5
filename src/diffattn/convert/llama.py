"""Hugging Face ``LlamaForCausalLM`` ↔ diffattn baseline.

The diffattn baseline *is* a Llama decoder (pre-norm RMSNorm, GQA attention without biases,
rotate-half RoPE, SwiGLU with SiLU), so the weights map one to one under the names of
:mod:`diffattn.convert.common`. The only exception is a diffattn baseline trained with
``rope_style="interleaved"``: its query and key channels are permuted into rotate-half order
(:func:`diffattn.convert.layout.interleaved_to_half`), which gives identical logits.

Settings a Llama checkpoint may have that diffattn does not implement (rope scaling, partial
rotary, attention or MLP biases, an activation other than SiLU) are refused with a
``ValueError`` naming the field. Attention dropout is a training-only setting and is dropped.
"""

from __future__ import annotations

import torch

from diffattn.config import ModelConfig
from diffattn.convert import common
from diffattn.convert.layout import interleaved_to_half


def llama_config_to_diffattn(hf_config, source: str = "config.json") -> ModelConfig:
    """The baseline :class:`ModelConfig` equivalent to an HF ``LlamaConfig``."""
    return common.model_config_from_hf(hf_config, source, attention="baseline")


def diffattn_config_to_llama(config: ModelConfig, ids: dict | None = None):
    """The HF ``LlamaConfig`` equivalent to a diffattn baseline config (``rope_style`` aside):
    a model whose attention type declares ``hf_format = "hf-llama"``."""
    transformers = common.require_transformers()
    common.check_hf_format(config, "hf-llama")
    if config.d_model % config.n_heads:
        raise ValueError(
            f"ModelConfig.d_model={config.d_model} is not divisible by n_heads={config.n_heads}, "
            "which Hugging Face LlamaConfig requires (head_dim may differ, the ratio may not)"
        )
    return transformers.LlamaConfig(**common.hf_config_fields(config, ids), mlp_bias=False)


def llama_state_to_diffattn(
    hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str = "weights"
) -> dict[str, torch.Tensor]:
    """Rename (and check) an HF Llama state dict for a diffattn baseline."""
    return common.hf_state_to_diffattn(hf_state, config, source)


def diffattn_state_to_llama(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF Llama tensors of a diffattn baseline state dict (interleaved RoPE made rotate-half)."""
    state = dict(state)
    if config.rope_style == "interleaved":
        d = config.dim_per_head
        for i in range(config.n_layers):
            for name, heads in (("q_proj", config.n_heads), ("k_proj", config.num_kv_heads)):
                key = f"layers.{i}.attn.{name}.weight"
                state[key] = interleaved_to_half(state[key], heads, d)
    return common.diffattn_state_to_hf(state, config)


LLAMA = common.HFFamily(
    hf_config_name="LlamaConfig",
    hf_model_name="LlamaForCausalLM",
    config_to_diffattn=llama_config_to_diffattn,
    state_to_diffattn=llama_state_to_diffattn,
    config_from_diffattn=diffattn_config_to_llama,
    state_from_diffattn=diffattn_state_to_llama,
)
"""HF Llama ↔ diffattn baseline: ``LLAMA.to_diffattn(src, out)`` and ``LLAMA.from_diffattn``."""
