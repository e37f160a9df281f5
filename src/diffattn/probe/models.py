"""What the probe needs to know about a model: its decoder layers, attention modules and heads.

Two families are understood:

* ``diffattn``: :class:`~diffattn.model.DiffTransformerLM` and the Hugging Face wrapper
  :class:`~diffattn.hf.DiffAttnForCausalLM`. Attention is watched at the kernel seam
  (:mod:`diffattn.attention.observe`).
* ``hf``: Hugging Face decoders whose layers have a ``self_attn`` module with ``q_proj``,
  ``k_proj``, ``v_proj`` and ``o_proj`` and that dispatch through ``AttentionInterface``
  (Llama, Qwen2, Mistral, DiffLlama and alike). Attention is watched through an attention
  function of ours (:mod:`diffattn.probe.hf`).

Head outputs are what ``o_proj`` reads, split into its heads: ``n_heads`` of width d for softmax
attention and DIFF V2, ``n_heads / 2`` differential heads of width 2d for DIFF V1 and DiffLlama.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class LayerView:
    """One decoder layer as the probe sees it.

    Attributes:
        index: depth, 0-based.
        block: the decoder layer (its output is the layer's hidden state).
        attention: the attention module.
        o_proj: the output projection, reading ``out_heads × out_head_dim`` features.
        out_heads, out_head_dim: the head split of ``o_proj``'s input.
        kind: ``"softmax"``, ``"diff_v1"``, ``"diff_v2"`` or ``"diffllama"``.
    """

    index: int
    block: nn.Module
    attention: nn.Module
    o_proj: nn.Linear
    out_heads: int
    out_head_dim: int
    kind: str


@dataclass
class ModelView:
    """The layers of a model and how its attention can be watched."""

    family: str  # "diffattn" or "hf"
    top: nn.Module
    layers: list[LayerView]


def _diffattn_lm(model: nn.Module):
    from diffattn.model import DiffTransformerLM

    if isinstance(model, DiffTransformerLM):
        return model
    wrapped = getattr(model, "module", None)  # DistributedDataParallel
    if isinstance(wrapped, nn.Module) and wrapped is not model:
        return _diffattn_lm(wrapped)
    inner = getattr(model, "model", None)
    if isinstance(inner, DiffTransformerLM):
        return inner
    return None


def view(model: nn.Module) -> ModelView:
    """The :class:`ModelView` of ``model``; ``ValueError`` naming what is unsupported."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"the probe watches torch.nn.Module models, got {type(model).__name__}")
    lm = _diffattn_lm(model)
    if lm is not None:
        return ModelView(
            "diffattn", model, [_diffattn_layer(i, b) for i, b in enumerate(lm.layers)]
        )
    layers = []
    for _, module in model.named_modules():
        attn = getattr(module, "self_attn", None)
        if isinstance(attn, nn.Module) and isinstance(getattr(attn, "o_proj", None), nn.Linear):
            layers.append(_hf_layer(len(layers), module, attn))
    if not layers:
        raise ValueError(
            f"{type(model).__name__} is not supported by the probe: expected a diffattn model "
            "or a Hugging Face decoder whose layers have self_attn with q/k/v/o_proj "
            "(Llama, Qwen2, Mistral, DiffLlama)"
        )
    return ModelView("hf", model, layers)


def _diffattn_layer(index: int, block: nn.Module) -> LayerView:
    from diffattn.attention import DiffAttentionV1, DiffAttentionV2

    attn = block.attn
    if isinstance(attn, DiffAttentionV1):
        kind, heads, width = "diff_v1", attn.n_heads, 2 * attn.head_dim
    elif isinstance(attn, DiffAttentionV2):
        kind, heads, width = "diff_v2", attn.n_heads, attn.head_dim
    else:
        kind, heads, width = "softmax", attn.n_heads, attn.head_dim
    return LayerView(index, block, attn, attn.o_proj, heads, width, kind)


def is_diffllama_attention(attn: nn.Module) -> bool:
    """Hugging Face DiffLlama: one call per map pair, heads h and h + H/2 paired."""
    return hasattr(attn, "lambda_q1") and hasattr(attn, "groupnorm")


def _hf_layer(index: int, block: nn.Module, attn: nn.Module) -> LayerView:
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int):
        raise ValueError(f"layer {index}: {type(attn).__name__} has no integer head_dim")
    width = attn.o_proj.in_features
    if is_diffllama_attention(attn):
        return LayerView(
            index, block, attn, attn.o_proj, width // (2 * head_dim), 2 * head_dim, "diffllama"
        )
    return LayerView(index, block, attn, attn.o_proj, width // head_dim, head_dim, "softmax")
