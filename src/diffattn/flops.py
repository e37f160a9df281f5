"""FLOP counts per token and the throughput bound they imply.

Counted from the projection shapes of a :class:`~diffattn.config.ModelConfig` (a matmul of
an ``m``-wide input into ``n`` outputs costs ``2·m·n`` FLOPs per token):

* **linear**, per layer: W_Q, W_K, W_V, W_O at their real widths (GQA, DIFF V2's doubled W_Q),
  DIFF V2's W_λ (d_model → h), and the SwiGLU's three matrices (``3·d_model·d_ff``).
* **attention**, per layer, under causal masking (a query reads ≈ N/2 keys on average):
  ``QKᵀ`` costs ``2·d·N/2`` per query head and map, ``AV`` costs ``2·d_v·N/2``.

  - baseline: ``n_heads`` heads of width d: ``2·N·n_heads·d`` (= ``2·N·d_model``).
  - DIFF V1, QK once (each map against the full 2d-wide V): ``n_heads/2`` heads with two
    maps each, ``2·(N·d) + 2·(N·2d)``: ``3·N·n_heads·d``.
  - DIFF V1, V once (``(P1 − λ·P2)·V`` as one product; the ``fused`` and ``triton``
    kernels): ``n_heads/2`` heads, ``2·(N·d) + N·2d`` each: ``2·N·n_heads·d``, the baseline's.
  - DIFF V1, split-V two-call form (each map once per d-wide half of V, so QKᵀ is computed
    twice; HF DiffLlama), which costs the same as QKᵀ on Q and K zero-padded to 2d (the
    ``sdpa`` and ``flash`` backends): ``4·N·n_heads·d``.
  - DIFF V2: ``2·n_heads`` query heads of width d, values of width d: ``4·N·n_heads·d``.
* **LM head**: ``2·d_model·vocab``.
* **decode** (:func:`decode_flops_per_token`): one new token per step reads every cached key, so
  its attention costs as above with ``N/2`` replaced by the number of keys it reads.

Norms, RoPE, softmax and other elementwise work are left out. Backward costs twice the
forward, so a training step costs three forwards and the bound is the same in both modes.
The ratio ``flops(baseline) / flops(model)`` is the best throughput ratio a model can reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffattn.config import ModelConfig

V1Form = Literal["qk_once", "v_once", "two_call"]
V1_FORMS: tuple[str, ...] = ("qk_once", "v_once", "two_call")


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs per token, summed over all layers, by part."""

    linear: float
    attention: float
    lm_head: float

    @property
    def forward(self) -> float:
        """Forward FLOPs per token."""
        return self.linear + self.attention + self.lm_head

    @property
    def training(self) -> float:
        """Forward plus backward FLOPs per token (backward = 2× forward)."""
        return 3.0 * self.forward


def over_layers(config: ModelConfig, per_layer) -> float:
    """``per_layer(i)`` summed over the layers: ``n_layers · per_layer(0)`` when every layer
    has the same type (one product, as counts were always made), else the sum."""
    if not config.is_mixed:
        return config.n_layers * per_layer(0)
    return sum(per_layer(i) for i in range(config.n_layers))


def linear_flops_per_layer(config: ModelConfig, layer_index: int = 0) -> float:
    """Forward FLOPs per token of one block's projections (attention and SwiGLU)."""
    kind = config.type_of_layer(layer_index)
    d, h, h_kv = config.dim_per_head, config.n_heads, config.num_kv_heads
    widths = kind.query_heads(config) * d + 2 * h_kv * d  # W_Q, W_K, W_V outputs
    widths += h * d  # W_O input: n_heads·d channels in every type
    widths += kind.extra_linear_outputs(config)  # e.g. DIFF V2's W_λ: d_model -> n_heads
    widths += 3 * config.ffn_dim  # SwiGLU gate, up and down
    return 2.0 * config.d_model * widths


def attention_flops_per_layer(
    config: ModelConfig, seq_len: int, v1_form: V1Form = "qk_once", layer_index: int = 0
) -> float:
    """Forward FLOPs per token of one layer's causal attention (≈ ``seq_len/2`` keys)."""
    return attention_flops_for_keys(config, seq_len / 2, v1_form, layer_index)


def attention_flops_for_keys(
    config: ModelConfig, keys: float, v1_form: V1Form = "qk_once", layer_index: int = 0
) -> float:
    """Forward FLOPs of one query token's attention in one layer when it reads ``keys`` keys
    (the layer type's ``attention_flops_for_keys``)."""
    if v1_form not in V1_FORMS:
        raise ValueError(f"v1_form must be one of {', '.join(V1_FORMS)}, got {v1_form!r}")
    return config.type_of_layer(layer_index).attention_flops_for_keys(config, keys, v1_form)


def flops_per_token(config: ModelConfig, seq_len: int, v1_form: V1Form = "qk_once") -> FlopCount:
    """Forward FLOPs per token of ``DiffTransformerLM(config)`` at sequence length ``seq_len``.

    ``v1_form`` chooses how DIFF V1's attention is counted (ignored for other types).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return FlopCount(
        linear=over_layers(config, lambda i: linear_flops_per_layer(config, i)),
        attention=over_layers(
            config, lambda i: attention_flops_per_layer(config, seq_len, v1_form, i)
        ),
        lm_head=2.0 * config.d_model * config.vocab_size,
    )


def decode_flops_per_token(
    config: ModelConfig, prompt_len: int, new_tokens: int, v1_form: V1Form = "qk_once"
) -> float:
    """Forward FLOPs per generated token, averaged over ``new_tokens`` decode steps after a
    prompt of ``prompt_len`` tokens: step ``i`` (0-based) reads ``prompt_len + i + 1`` keys, so
    the mean is ``prompt_len + (new_tokens + 1) / 2`` keys per step."""
    if prompt_len < 1 or new_tokens < 1:
        raise ValueError(f"prompt_len and new_tokens must be >= 1, got {prompt_len}, {new_tokens}")
    keys = prompt_len + (new_tokens + 1) / 2
    layers = over_layers(
        config,
        lambda i: linear_flops_per_layer(config, i)
        + attention_flops_for_keys(config, keys, v1_form, i),
    )
    return layers + 2.0 * config.d_model * config.vocab_size


def throughput_bound(
    config: ModelConfig,
    baseline: ModelConfig,
    seq_len: int,
    v1_form: V1Form = "qk_once",
) -> float:
    """Best throughput ratio ``model / baseline`` the FLOP counts allow (same in both modes)."""
    return (
        flops_per_token(baseline, seq_len).forward
        / flops_per_token(config, seq_len, v1_form).forward
    )


def v1_form_for_kernel(kernel: str) -> V1Form:
    """How DIFF V1's FLOPs count on a resolved kernel: ``fused`` and ``triton`` compute
    ``(P1 − λ·P2)·V`` as one product; ``reference`` runs two softmax calls against the full V;
    ``sdpa`` and ``flash`` zero-pad Q and K to V's 2d width, which costs what the split-V
    two-call form costs."""
    if kernel in ("fused", "triton"):
        return "v_once"
    return "qk_once" if kernel == "reference" else "two_call"
