"""How each attention type of diffattn maps onto one stock paged-attention call of vLLM.

vLLM's ``Attention`` layer computes ``softmax(q kᵀ · scale) v`` per query head over a paged KV
cache of ``num_kv_heads`` heads of one width, query head ``i`` reading KV head
``i // (num_heads / num_kv_heads)``. This module states, in plain torch and without vLLM, how
the three types are expressed as such a call, so the layout is tested on its own and its cache
cost is a number, not a claim.

* **baseline**: ``n_heads`` query heads, ``n_kv_heads`` KV heads of width d (LLaMA GQA).
* **DIFF V2** (V2 blog): ``2·n_heads`` query heads of width d, interleaved so that (2i, 2i+1)
  fall in one GQA group, over the baseline's ``n_kv_heads`` KV heads; then
  ``o_{2i} − λ_i·o_{2i+1}``. The cache is the baseline's.
* **DIFF V1** (Eq. 1): differential head j of KV group g needs ``softmax(q1_j K1_gᵀ)V_g`` and
  ``softmax(q2_j K2_gᵀ)V_g`` with K1, K2 of width d and V of width 2d. Stored as one KV head
  per group of width 2d: its key is ``[K1_g | K2_g]`` (how ``k_proj`` already lays the pair out)
  and its value is ``V_g``. The two maps become two query heads of width 2d padded with zeros,
  ``[q1_j | 0]`` and ``[0 | q2_j]``: their dot products with ``[K1 | K2]`` are exactly
  ``q1·K1`` and ``q2·K2`` (a product with an exact zero adds an exact zero), with the scale
  ``d^-1/2`` of width d. The cache then holds K1, K2 at width d and V at 2d once per group,
  which is the least any layout can store, and equals the matched baseline's bytes per token.
  The price is compute: the Q·Kᵀ products run at width 2d, twice the ideal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffattn.config import ModelConfig


@dataclass(frozen=True)
class AttentionLayout:
    """The stock attention call that serves one layer of a diffattn model.

    Attributes:
        num_heads: query heads of the call.
        num_kv_heads: KV heads of the call (what the cache stores per layer).
        head_size: the width of every query, key and value head of the call.
        scale: the softmax scale (``d^-1/2`` with d the model's head width, for every type).
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float

    def kv_cache_bytes_per_token(self, n_layers: int, element_bytes: int) -> int:
        """Bytes of KV cache one token occupies in all layers (keys and values)."""
        return 2 * self.num_kv_heads * self.head_size * element_bytes * n_layers


def attention_layout(config: ModelConfig, tp_size: int = 1) -> AttentionLayout:
    """The call of :class:`AttentionLayout` for ``config``, per tensor-parallel rank.

    Raises:
        ValueError: ``tp_size`` does not split the heads into whole KV groups (whole (K1, K2)
            pairs for DIFF V1).
    """
    declaration = config.single_type("vLLM's attention layout")
    if declaration.vllm_reason is not None:
        raise ValueError(
            f"vLLM cannot serve attention type {declaration.name!r}: {declaration.vllm_reason}"
        )
    kv_units = declaration.kv_units(config)
    if tp_size < 1 or kv_units % tp_size:
        unit = declaration.kv_unit_name(config)
        raise ValueError(
            f"tensor parallel size {tp_size} must divide the {kv_units} {unit} of this model"
        )
    heads, kv_heads, width = declaration.vllm_call(config)
    return AttentionLayout(heads // tp_size, kv_heads // tp_size, width, config.dim_per_head**-0.5)


def head_size_problem(config: ModelConfig, layout: AttentionLayout, backend) -> str | None:
    """Why vLLM attention ``backend`` (its class) cannot run ``layout``'s call, or ``None``."""
    if backend.supports_head_size(layout.head_size):
        return None
    supported = ", ".join(map(str, backend.get_supported_head_sizes()))
    what = config.single_type("vLLM").vllm_width_note.format(width=layout.head_size)
    return (
        f"vLLM's {backend.get_name()} attention backend cannot serve this {config.attention} "
        f"model: {what}, and the backend supports head sizes {supported}"
    )


def ideal_kv_cache_bytes_per_token(config: ModelConfig, element_bytes: int) -> int:
    """The least KV cache a token needs, all layers: K and V as the model computes them.

    Baseline and DIFF V2: ``n_kv_heads`` keys and values of width d. DIFF V1: per KV group, K1
    and K2 of width d and V of width 2d (DIFF V1 §2.1), which is the same count."""
    per_layer = config.single_type("vLLM").cache_layout(config).elements_per_token
    return per_layer * element_bytes * config.n_layers


def v1_padded_queries(q: torch.Tensor, head_dim: int) -> torch.Tensor:
    """DIFF V1's queries as the call's query heads: ``(T, H·2·d)`` → ``(T, 2H·2d)``.

    ``q`` holds the differential heads' (q1, q2) pairs side by side, as ``q_proj`` projects
    them (after RoPE). Query head 2j is ``[q1_j | 0]``, head 2j+1 is ``[0 | q2_j]``."""
    tokens = q.shape[0]
    pairs = q.view(tokens, -1, 2, head_dim)
    padded = q.new_zeros(tokens, pairs.shape[1], 2, 2 * head_dim)
    padded[:, :, 0, :head_dim] = pairs[:, :, 0]
    padded[:, :, 1, head_dim:] = pairs[:, :, 1]
    return padded.view(tokens, -1)


def v1_combine(
    out: torch.Tensor,
    lam: torch.Tensor,
    head_dim: int,
    norm_weight: torch.Tensor | None,
    norm_eps: float | None,
    lambda_init: float,
) -> torch.Tensor:
    """Eq. 1 and Eq. 3 on the call's output ``(T, 2H·2d)``: ``o1 − λ·o2`` per differential
    head in fp32, then (``norm_eps`` not ``None``) RMSNorm over 2d × (1 − λ_init), each step
    rounded to ``out``'s dtype where diffattn's own forward rounds it; ``(T, H·2d)``."""
    tokens = out.shape[0]
    pairs = out.view(tokens, -1, 2, 2 * head_dim).float()
    diff = (pairs[:, :, 0] - lam.float() * pairs[:, :, 1]).to(out.dtype)
    if norm_eps is not None:
        x = diff.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps)
        if norm_weight is not None:
            y = y * norm_weight.float()
        diff = y.to(out.dtype) * (1.0 - lambda_init)
    return diff.reshape(tokens, -1)


def v2_combine(out: torch.Tensor, lam: torch.Tensor | None, head_dim: int, paired: bool):
    """The V2 blog's ``o1 − λ·o2`` on the call's output ``(T, 2H·d)`` → ``(T, H·d)``.

    ``paired``: heads (2i, 2i+1), one GQA group; otherwise (i, i+H) (ablation 1). ``lam`` is
    ``(T, H)`` (sigmoid already applied, or the raw projection of ablation 3), or ``None`` for
    ``o1 − o2`` (ablation 2)."""
    tokens = out.shape[0]
    heads = out.view(tokens, -1, head_dim)
    if paired:
        o1, o2 = heads[:, 0::2], heads[:, 1::2]
    else:
        o1, o2 = heads.chunk(2, dim=1)
    if lam is None:
        return (o1 - o2).reshape(tokens, -1)
    return (o1 - lam.unsqueeze(-1) * o2).reshape(tokens, -1)
