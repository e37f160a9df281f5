"""Finding the softmax attention layers Dex can extend, in any supported decoder.

An attention layer is any module with ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``
children whose ``o_proj`` is an ``nn.Linear`` reading the concatenated head outputs
``(…, n_heads·head_dim)`` in head order. This covers Hugging Face ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM`` and other decoders of that shape, and
:class:`diffattn.DiffTransformerLM` with ``attention="baseline"`` (the paper's Dex-S, App. D).
Layers are numbered 0, 1, … in module order, i.e. by depth.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
SUPPORTED = (
    "Dex supports decoders whose attention modules have q_proj, k_proj, v_proj and o_proj "
    "nn.Linear children (Hugging Face LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM "
    "and alike) and diffattn's DiffTransformerLM with attention='baseline'"
)
_DIFFERENTIAL_MARKERS = ("lambda_q1", "lambda_proj")


@dataclass
class AttentionSite:
    """One attention layer: its depth index, qualified name, module and head geometry."""

    index: int
    name: str
    module: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def o_proj(self) -> nn.Module:
        return self.module.o_proj


def _head_dim(name: str, module: nn.Module) -> int:
    head_dim = getattr(module, "head_dim", None)
    config = getattr(module, "config", None)
    if head_dim is None and config is not None:
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None and getattr(config, "num_attention_heads", None):
            head_dim = config.hidden_size // config.num_attention_heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(
            f"cannot tell the head width of attention module {name!r} "
            f"({type(module).__name__}): it has no integer head_dim attribute or config; "
            f"{SUPPORTED}"
        )
    return head_dim


def _is_differential(module: nn.Module) -> bool:
    """Whether ``module`` is differential attention: the module of a registered type that
    declares itself ``differential`` (DIFF V1/V2, GDA, DINT, gated DIFF, or one from another
    package), or one with a λ of its own (HF's DiffLlama: ``lambda_q1``)."""
    from diffattn.attention.types import attention_type, attention_type_names

    for name in attention_type_names():
        declared = attention_type(name)
        if declared.differential and isinstance(module, declared.module):
            return True
    return any(hasattr(module, marker) for marker in _DIFFERENTIAL_MARKERS)


def find_attention(model: nn.Module) -> list[AttentionSite]:
    """Every attention layer of ``model`` in depth order; ``ValueError`` when unsupported."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"expected a torch.nn.Module, got {type(model).__name__}; {SUPPORTED}")
    sites: list[AttentionSite] = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if not all(p in children for p in PROJECTIONS):
            continue
        if _is_differential(module):
            raise ValueError(
                f"attention module {name!r} ({type(module).__name__}) is already differential "
                f"attention; Dex extends softmax attention. {SUPPORTED}"
            )
        for proj in PROJECTIONS:
            if not isinstance(children[proj], nn.Linear):
                raise ValueError(
                    f"{name}.{proj} is a {type(children[proj]).__name__}, not an nn.Linear; "
                    f"{SUPPORTED}"
                )
        head_dim = _head_dim(name, module)
        width, kv_width = module.o_proj.in_features, module.v_proj.out_features
        if width % head_dim or kv_width % head_dim:
            raise ValueError(
                f"{name}: o_proj reads {width} and v_proj writes {kv_width} features, "
                f"not multiples of head_dim={head_dim}"
            )
        n_heads, n_kv_heads = width // head_dim, kv_width // head_dim
        sites.append(AttentionSite(len(sites), name, module, n_heads, n_kv_heads, head_dim))
    if not sites:
        raise ValueError(f"{type(model).__name__} has no supported attention modules; {SUPPORTED}")
    return sites
