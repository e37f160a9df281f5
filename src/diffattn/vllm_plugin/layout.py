"""How each layer of a diffattn model maps onto one stock paged-attention call of vLLM.

vLLM's ``Attention`` layer computes ``softmax(q kᵀ · scale) v`` per query head over a paged KV
cache of ``num_kv_heads`` heads of one width, query head ``i`` reading KV head
``i // (num_heads / num_kv_heads)``. Each layer is served by the call its attention type
declares (:meth:`~diffattn.attention.types.AttentionType.vllm_call`), with the type's queries
before it and its combine step after it (``vllm_queries``, ``vllm_output``), so the layers of a
stack of mixed types each get their own call. This module states the calls in plain torch and
without vLLM, so the layout is tested on its own and its cache cost is a number, not a claim.

* **baseline**: ``n_heads`` query heads, ``n_kv_heads`` KV heads of width d (LLaMA GQA).
* **DIFF V2** (V2 blog): ``2·n_heads`` query heads of width d, interleaved so that (2i, 2i+1)
  fall in one GQA group, over the baseline's ``n_kv_heads`` KV heads; then
  ``o_{2i} − λ_i·o_{2i+1}``. The cache is the baseline's.
* **DIFF V1** (Eq. 1): differential head j of KV group g needs ``softmax(q1_j K1_gᵀ)V_g`` and
  ``softmax(q2_j K2_gᵀ)V_g`` with K1, K2 of width d and V of width 2d. Stored as one KV head
  per group of width 2d: its key is ``[K1_g | K2_g]`` (how ``k_proj`` already lays the pair out)
  and its value is ``V_g``. The two maps become two query heads of width 2d padded with zeros,
  ``[q1_j | 0]`` and ``[0 | q2_j]``: their dot products with ``[K1 | K2]`` are exactly
  ``q1·K1`` and ``q2·K2``, with the scale ``d^-1/2`` of width d. The cache then holds K1, K2 at
  width d and V at 2d once per group, which is the least any layout can store, and equals the
  matched baseline's bytes per token. The price is compute: the Q·Kᵀ products run at width 2d.
* **GDA** (arXiv 2510.06949): DIFF V1's call over its ``H_s`` signal heads, each paired with
  the query of its noise head (``r`` signal heads share one), over DIFF V1's KV groups and
  cache; W_O reads the ``H_s`` heads of width 2d.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffattn.config import ModelConfig


@dataclass(frozen=True)
class AttentionLayout:
    """The stock attention call that serves one layer of a diffattn model.

    Attributes:
        num_heads: query heads of the call.
        num_kv_heads: KV heads of the call (what the cache stores for the layer).
        head_size: the width of every query, key and value head of the call.
        scale: the softmax scale (``d^-1/2`` with d the model's head width, for every type).
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float

    def kv_cache_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes of KV cache one token occupies in this layer (keys and values)."""
        return 2 * self.num_kv_heads * self.head_size * element_bytes


def attention_layout(config: ModelConfig, layer_index: int, tp_size: int = 1) -> AttentionLayout:
    """The call of :class:`AttentionLayout` serving layer ``layer_index``, per tensor-parallel
    rank.

    Raises:
        ValueError: the layer's type declares no vLLM layout (its ``vllm_reason``), or
            ``tp_size`` does not split its heads into whole KV units (whole (K1, K2) pairs for
            DIFF V1), or the type cannot be split at all (its ``tp_problem``).
    """
    declaration = config.type_of_layer(layer_index)
    if declaration.vllm_reason is not None:
        raise ValueError(
            f"vLLM cannot serve attention type {declaration.name!r}: {declaration.vllm_reason}"
        )
    kv_units = declaration.kv_units(config)
    if not isinstance(tp_size, int) or tp_size < 1 or kv_units % tp_size:
        unit = declaration.kv_unit_name(config)
        raise ValueError(
            f"tensor parallel size {tp_size} must divide the {kv_units} {unit} of this model"
        )
    problem = declaration.tp_problem(config, tp_size) if tp_size > 1 else None
    if problem is not None:
        raise ValueError(f"{problem}; serve it with a tensor parallel size of 1")
    heads, kv_heads, width = declaration.vllm_call(config)
    return AttentionLayout(heads // tp_size, kv_heads // tp_size, width, config.dim_per_head**-0.5)


def attention_layouts(config: ModelConfig, tp_size: int = 1) -> tuple[AttentionLayout, ...]:
    """:func:`attention_layout` of every layer, in order."""
    return tuple(attention_layout(config, i, tp_size) for i in range(config.n_layers))


def head_size_problem(
    config: ModelConfig, layer_index: int, layout: AttentionLayout, backend
) -> str | None:
    """Why vLLM attention ``backend`` (its class) cannot run ``layout``'s call for layer
    ``layer_index``, or ``None``."""
    if backend.supports_head_size(layout.head_size):
        return None
    supported = ", ".join(map(str, backend.get_supported_head_sizes()))
    declaration = config.type_of_layer(layer_index)
    what = declaration.vllm_width_note.format(width=layout.head_size)
    return (
        f"vLLM's {backend.get_name()} attention backend cannot serve the {declaration.name} "
        f"attention of this model: {what}, and the backend supports head sizes {supported}"
    )


def kv_cache_bytes_per_token(config: ModelConfig, element_bytes: int) -> int:
    """Bytes of KV cache the layouts of :func:`attention_layouts` store per token, all layers."""
    return sum(
        layout.kv_cache_bytes_per_token(element_bytes) for layout in attention_layouts(config)
    )


def ideal_kv_cache_bytes_per_token(config: ModelConfig, element_bytes: int) -> int:
    """The least KV cache a token needs, all layers: K and V as each layer's type computes them
    (its ``cache_layout``). Baseline and DIFF V2: ``n_kv_heads`` keys and values of width d.
    DIFF V1: per KV group, K1 and K2 of width d and V of width 2d (DIFF V1 §2.1), which is the
    same count."""
    elements = sum(
        config.type_of_layer(i).cache_layout(config).elements_per_token
        for i in range(config.n_layers)
    )
    return elements * element_bytes
