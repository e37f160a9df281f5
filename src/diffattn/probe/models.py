"""What the probe needs to know about a model: its decoder layers, attention modules and heads.

Two families are understood:

* ``diffattn``: :class:`~diffattn.model.DiffTransformerLM` and the Hugging Face wrapper
  :class:`~diffattn.hf.DiffAttnForCausalLM`. Attention is watched at the kernel seam
  (:mod:`diffattn.attention.observe`).
* ``hf``: Hugging Face decoders whose layers have a ``self_attn`` module with ``q_proj``,
  ``k_proj``, ``v_proj`` and ``o_proj`` and that dispatch through ``AttentionInterface``
  (Llama, Qwen2, Mistral, DiffLlama and alike). Attention is watched through an attention
  function of ours (:mod:`diffattn.probe.hf`).

A diffattn layer is seen through its attention type's declaration
(:class:`~diffattn.attention.types.AttentionType`, ``config.type_of_layer(i)``), so every
registered type and every layer of a mixed stack (``ModelConfig.layer_types``) is watched as
its own type declares: the heads ``o_proj`` reads (``output_heads``, ``output_width``), whether
it is differential, and where its λ is read (``scalar_lambda``, ``token_lambda``). Maps are
captured for every layer whatever its type, at the kernel seam its module calls.

Head outputs are what ``o_proj`` reads, split into its heads: ``n_heads`` of width d for softmax
attention and DIFF V2, ``n_heads / 2`` differential heads of width 2d for DIFF V1 and DiffLlama.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from diffattn.attention.diff_v1 import reparameterised_lambda
from diffattn.attention.registry import ENTRY_SOFTMAX
from diffattn.attention.types import AttentionType

DIFFLLAMA = "diffllama"
"""The kind of a Hugging Face DiffLlama layer (its events are reported as DIFF V1's)."""


@dataclass
class LayerView:
    """One decoder layer as the probe sees it.

    Attributes:
        index: depth, 0-based.
        block: the decoder layer (its output is the layer's hidden state).
        attention: the attention module.
        o_proj: the output projection, reading ``out_heads × out_head_dim`` features.
        out_heads, out_head_dim: the head split of ``o_proj``'s input.
        kind: what the attention computes, as its events name it: the kernel entry point a
            diffattn layer's type calls (``"softmax"``, ``"diff_v1"``, ``"diff_v2"``:
            ``AttentionType.entry``), ``"softmax"`` for Hugging Face softmax layers,
            ``"diffllama"`` for Hugging Face DiffLlama.
        declaration: the layer's attention type (diffattn models), else ``None``.
        differential: whether the layer subtracts a second map (A1 − λA2).
        lambda_key: the key its λ is recorded under (``"lambda"``: one λ per layer;
            ``"lambda_mean"``: the mean of a λ per token), ``None`` without a λ.
        scalar_lambda: reads the layer's one λ (DIFF V1 Eq.2, DiffLlama) from its parameters,
            a 0-d fp32 tensor; ``None`` for a layer without one.
        token_lambda: ``(submodule, to_lambda)``: where a per-token λ is read (DIFF V2's
            ``lambda_proj``, then the sigmoid); ``None`` without one.
    """

    index: int
    block: nn.Module
    attention: nn.Module
    o_proj: nn.Linear
    out_heads: int
    out_head_dim: int
    kind: str
    declaration: AttentionType | None = None
    differential: bool = False
    lambda_key: str | None = None
    scalar_lambda: Callable[[], torch.Tensor] | None = None
    token_lambda: tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]] | None = None

    @property
    def type_name(self) -> str:
        """The layer's attention type (diffattn), else its :attr:`kind`."""
        return self.kind if self.declaration is None else self.declaration.name


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
            "diffattn",
            model,
            [_diffattn_layer(i, b, lm.config) for i, b in enumerate(lm.layers)],
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


def _diffattn_layer(index: int, block: nn.Module, config) -> LayerView:
    """Layer ``index`` as its type declares it (``config.type_of_layer(index)``)."""
    declaration = config.type_of_layer(index)
    attn = block.attn
    # a declaration that reads a λ per layer overrides scalar_lambda (it is read later, when
    # the parameters have their values, and may be sharded then)
    has_scalar = type(declaration).scalar_lambda is not AttentionType.scalar_lambda
    token = declaration.token_lambda(attn)
    has_lambda = has_scalar or token is not None
    return LayerView(
        index,
        block,
        attn,
        attn.o_proj,
        declaration.output_heads(config),
        declaration.output_width(config),
        declaration.entry,
        declaration=declaration,
        differential=declaration.differential,
        lambda_key=declaration.lambda_key if has_lambda else None,
        scalar_lambda=functools.partial(declaration.scalar_lambda, attn) if has_scalar else None,
        token_lambda=token,
    )


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
            index,
            block,
            attn,
            attn.o_proj,
            width // (2 * head_dim),
            2 * head_dim,
            DIFFLLAMA,
            differential=True,
            lambda_key="lambda",
            scalar_lambda=functools.partial(reparameterised_lambda, attn),
        )
    return LayerView(index, block, attn, attn.o_proj, width // head_dim, head_dim, ENTRY_SOFTMAX)
