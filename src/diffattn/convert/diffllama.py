"""Hugging Face ``DiffLlamaForCausalLM`` ↔ diffattn DIFF V1 (``attention="diff_v1"``).

What HF DiffLlama computes (transformers' ``DiffLlamaAttention``), with H query heads and
H_kv key/value heads of width d, r = H / H_kv, and m = H/2 differential heads:

* differential head j < m takes query heads j and j + m; with g = j // r its two maps read
  key heads g and g + H_kv/2, and both read the value pair (v_g, v_{g + H_kv/2}) (the two halves
  of V, each broadcast back over the KV axis);
* λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init with λ_init = 0.8 − 0.6·exp(−0.3·layer_idx) for the
  0-based ``layer_idx``: exactly :func:`diffattn.config.lambda_init_schedule`;
* an RMSNorm over each head's 2d channels without weight (``eps = rms_norm_eps``), times
  (1 − λ_init), and o_proj over the heads' outputs in order;
* rotate-half RoPE.

diffattn DIFF V1 with ``n_heads = H``, ``n_kv_heads = H_kv``, ``head_dim = d`` computes the
same thing with adjacent pairs, so the converter permutes the rows of q_proj, k_proj and
v_proj (:func:`diffattn.convert.layout.halves_to_pairs`) and leaves o_proj alone: head j's
output channels are (P·v_g, P·v_{g+H_kv/2}) in both layouts. The config gets
``rope_style="half"``, ``head_norm=True``, ``head_norm_learnable=False``,
``head_norm_eps = norm_eps = rms_norm_eps`` and ``lambda_init="exp"``.

Back to HF, a diffattn V1 model must use the λ_init depth schedule, a per-head norm with
``head_norm_eps == norm_eps``; interleaved RoPE is permuted into rotate-half order, and a
learnable head-norm weight (shared by all heads) is folded into o_proj's columns, since
``o_proj(w ⊙ y) = (o_proj · diag(w)) y``.
"""

from __future__ import annotations

import torch

from diffattn.config import ModelConfig
from diffattn.convert import common
from diffattn.convert.layout import halves_to_pairs, interleaved_to_half, pairs_to_halves


def diffllama_config_to_diffattn(hf_config, source: str = "config.json") -> ModelConfig:
    """The DIFF V1 :class:`ModelConfig` equivalent to an HF ``DiffLlamaConfig``."""
    dropout = getattr(hf_config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(f"{source}: attention_dropout={dropout} is not supported")
    return common.model_config_from_hf(
        hf_config,
        source,
        attention="diff_v1",
        lambda_init="exp",
        lambda_std=float(getattr(hf_config, "lambda_std_dev", 0.1) or 0.1),
        head_norm=True,
        head_norm_learnable=False,
        head_norm_eps=float(hf_config.rms_norm_eps),
    )


def diffattn_config_to_diffllama(config: ModelConfig, ids: dict | None = None):
    """The HF ``DiffLlamaConfig`` equivalent to a diffattn DIFF V1 config (a model whose
    attention type declares ``hf_format = "hf-diffllama"``).

    Raises ``ValueError`` naming the field when the model computes something DiffLlama cannot.
    """
    transformers = common.require_transformers()
    common.check_hf_format(config, "hf-diffllama")
    if config.lambda_init != "exp":
        raise ValueError(
            f"ModelConfig.lambda_init={config.lambda_init!r}: HF DiffLlama always uses the "
            "depth schedule 0.8 - 0.6*exp(-0.3*layer_idx) ('exp')"
        )
    if not config.head_norm:
        raise ValueError(
            "ModelConfig.head_norm=False: HF DiffLlama always applies the per-head RMSNorm"
        )
    if config.head_norm_eps != config.norm_eps:
        raise ValueError(
            f"ModelConfig.head_norm_eps={config.head_norm_eps} differs from norm_eps="
            f"{config.norm_eps}; HF DiffLlama uses rms_norm_eps for both"
        )
    return transformers.DiffLlamaConfig(
        **common.hf_config_fields(config, ids),
        attention_dropout=0.0,
        lambda_std_dev=config.lambda_std,
    )


def diffllama_state_to_diffattn(
    hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str = "weights"
) -> dict[str, torch.Tensor]:
    """diffattn V1 tensors of an HF DiffLlama state dict: renamed, q/k/v rows paired."""
    state = common.hf_state_to_diffattn(hf_state, config, source)
    d = config.dim_per_head
    for i in range(config.n_layers):
        prefix = f"layers.{i}.attn."
        state[prefix + "q_proj.weight"] = halves_to_pairs(
            state[prefix + "q_proj.weight"], config.n_heads, d
        )
        for name in ("k_proj", "v_proj"):
            key = prefix + name + ".weight"
            state[key] = halves_to_pairs(state[key], config.num_kv_heads, d)
    return state


def diffattn_state_to_diffllama(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF DiffLlama tensors of a diffattn V1 state dict (see the module docstring)."""
    state = dict(state)
    d = config.dim_per_head
    for i in range(config.n_layers):
        prefix = f"layers.{i}.attn."
        q, k, v = (prefix + name + ".weight" for name in ("q_proj", "k_proj", "v_proj"))
        if config.rope_style == "interleaved":
            state[q] = interleaved_to_half(state[q], config.n_heads, d)
            state[k] = interleaved_to_half(state[k], config.num_kv_heads, d)
        state[q] = pairs_to_halves(state[q], config.n_heads, d)
        state[k] = pairs_to_halves(state[k], config.num_kv_heads, d)
        state[v] = pairs_to_halves(state[v], config.num_kv_heads, d)
        weight = state.pop(prefix + "head_norm.weight", None)
        if weight is not None:  # fold the shared head-norm weight into o_proj's columns
            o = prefix + "o_proj.weight"
            scale = weight.float().repeat(config.n_heads // 2)
            state[o] = (state[o].float() * scale[None, :]).to(state[o].dtype)
    # folded: the tensors are those of the same model without a learnable head-norm weight
    return common.diffattn_state_to_hf(state, config.replace(head_norm_learnable=False))


DIFFLLAMA = common.HFFamily(
    hf_config_name="DiffLlamaConfig",
    hf_model_name="DiffLlamaForCausalLM",
    config_to_diffattn=diffllama_config_to_diffattn,
    state_to_diffattn=diffllama_state_to_diffattn,
    config_from_diffattn=diffattn_config_to_diffllama,
    state_from_diffattn=diffattn_state_to_diffllama,
)
"""HF DiffLlama ↔ diffattn DIFF V1: ``DIFFLLAMA.to_diffattn(src, out)`` and ``.from_diffattn``."""
