"""DIFF V1: multi-head differential attention, Eq.1–3 of the paper and nothing else.

Layout (adjacent pairs, as in the official code): the ``n_heads`` query half-heads of width d
pair up as (Q1, Q2) = (2j, 2j+1) for differential head j; the ``n_kv_heads`` key half-heads
pair up as (K1, K2) = (2g, 2g+1) for KV group g; V has ``n_kv_heads / 2`` heads of width 2d.

GQA semantics (the same on every backend): differential head j belongs to KV group
g = j // (H / H_kv); its first map reads K1_g, its second map reads K2_g, and both read V_g.
This is what Microsoft's flash modules compute. Microsoft's naive module instead repeats the
interleaved key heads, so under GQA both maps of a head read the *same* key head; with MHA the
two agree.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from diffattn.attention.common import ProjectedAttention, with_maps
from diffattn.attention.kernels import differential_attention
from diffattn.attention.registry import ENTRY_DIFF
from diffattn.attention.types import (
    AttentionType,
    CacheLayout,
    ServedWeight,
    register_attention_type,
)
from diffattn.config import ModelConfig
from diffattn.layers import RMSNorm, local_share, memo_by_version

LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
"""Eq.2's re-parameterisation of λ: four vectors of width d per layer."""


def reparameterised_lambda(module: nn.Module) -> torch.Tensor:
    """Eq.2 for any module holding ``lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2``
    and ``lambda_init`` (ours, or Hugging Face's DiffLlama): exp(λq1·λk1) − exp(λq2·λk2) +
    λ_init, in fp32 (0-d tensor)."""
    dot1 = torch.sum(module.lambda_q1.float() * module.lambda_k1.float())
    dot2 = torch.sum(module.lambda_q2.float() * module.lambda_k2.float())
    return torch.exp(dot1) - torch.exp(dot2) + module.lambda_init


def add_lambda_and_head_norm(module: nn.Module, config: ModelConfig, d: int) -> None:
    """Eq.2's re-parameterisation and Eq.3's norm, uninitialised, on ``module``: the four
    vectors ``lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` of width d (λ itself is
    evaluated in fp32) and ``head_norm``, an RMSNorm over 2d (``None`` without
    ``config.head_norm``)."""
    module.lambda_q1 = nn.Parameter(torch.empty(d))
    module.lambda_k1 = nn.Parameter(torch.empty(d))
    module.lambda_q2 = nn.Parameter(torch.empty(d))
    module.lambda_k2 = nn.Parameter(torch.empty(d))
    module.head_norm = head_norm_for(config, d)


def head_norm_for(config: ModelConfig, d: int) -> RMSNorm | None:
    """Eq.3's per-head RMSNorm over 2d (one weight shared by all heads with
    ``config.head_norm_learnable``), or ``None`` without ``config.head_norm``."""
    if not config.head_norm:
        return None
    return RMSNorm(2 * d, config.head_norm_eps, learnable=config.head_norm_learnable)


def paired_heads_text(config: ModelConfig) -> str:
    """DIFF V1's heads in words, for the declarations' ``describe`` of every type on them."""
    d = config.dim_per_head
    return (
        f"{config.n_heads // 2} differential heads (Q1, Q2 of width {d}), "
        f"{config.num_kv_heads // 2} KV groups with V of width {2 * d}"
    )


class DiffAttentionV1(ProjectedAttention):
    """Eq.3: ``Concat((1 − λ_init)·RMSNorm(DiffAttn_j(X))) W_O`` with λ from Eq.2."""

    value_width_factor = 2  # V heads of width 2d (B, H_kv, N, 2d); K half-heads interleaved

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        # the baseline's projections, read as half-heads of width d
        super().__init__(config, layer_index)
        d = self.head_dim
        self.n_heads = config.n_heads // 2  # differential heads H
        self.n_kv_heads = config.num_kv_heads // 2  # KV groups H_kv
        self.lambda_init = config.lambda_init_for_layer(layer_index)
        add_lambda_and_head_norm(self, config, d)
        self.reset_lambda()

    def reset_own_parameters(self, generator: torch.Generator | None = None) -> None:
        """The type's own initialisation (``DiffTransformerLM.init_weights``): λ's vectors."""
        self.reset_lambda(generator)

    def reset_lambda(self, generator: torch.Generator | None = None) -> None:
        """λ vectors ~ N(0, lambda_std²), as in the official code."""
        with torch.no_grad():
            for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
                p.normal_(0.0, self.config.lambda_std, generator=generator)

    def lambda_full(self) -> torch.Tensor:
        """Eq.2: λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, computed in fp32 (0-d tensor).

        Without autograd (inference, decode steps) the value is kept until one of the four
        vectors changes (tracked by tensor identity and version counter), which saves a
        decode step about ten small ops per layer."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return reparameterised_lambda(self)
        vectors = (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)
        return memo_by_version(self, "_lambda", vectors, lambda: reparameterised_lambda(self))

    def attend(self, x, q, k, v, mask, need_weights):
        """Eq.1 per differential head j on (Q1, Q2) = (2j, 2j+1) and its group's (K1, K2),
        then Eq.3's per-head RMSNorm × (1 − λ_init)."""
        q1, q2 = q[:, 0::2], q[:, 1::2]
        k1, k2 = k[:, 0::2], k[:, 1::2]
        lam = local_share(self.lambda_full())  # replicated λ, read by this rank's heads
        (out, _), maps = with_maps(
            self.layer_index,
            need_weights,
            differential_attention,
            q1,
            q2,
            k1,
            k2,
            v,
            lam,
            mask,
            self.scale,
            self.backend,
            layer=self.layer_index,
        )
        if self.head_norm is not None:
            out = self.head_norm(out) * (1.0 - self.lambda_init)
        return out, maps


class DiffV1(AttentionType):
    """DIFF V1 (Ye et al., ICLR 2025, §2.1): the baseline's ``n_heads`` query heads paired
    into ``n_heads / 2`` differential heads, its ``n_kv_heads`` key heads into
    ``n_kv_heads / 2`` groups with V of width 2d, λ by Eq.2 and Eq.3's head norm. Parameter
    matched by construction (+4d λ and 2d norm weight a layer)."""

    name = "diff_v1"
    title = "DIFF V1"
    colour = "tab:blue"
    module = DiffAttentionV1
    config_fields = (
        "lambda_init",
        "lambda_std",
        "head_norm",
        "head_norm_learnable",
        "head_norm_eps",
    )
    differential = True
    paper_claims = True
    entry = ENTRY_DIFF
    bench_by_default = True
    source = "Differential Transformer (arXiv 2410.05258), Eq.1-3"
    lambda_label = "λ (Eq.2)"
    lambda_key = "lambda"
    vllm_reason = None
    hf_format = "hf-diffllama"
    tensor_parallel = True
    context_parallel_reason = None  # each map normalised by the kernel over the gathered keys
    heads_per_output_head = 2

    def check(self, config):
        kv = config.num_kv_heads
        if config.n_heads % 2 != 0:
            return [
                (
                    "n_heads",
                    f"diff_v1 pairs query heads into differential heads, so "
                    f"n_heads must be even, got {config.n_heads}",
                )
            ]
        if kv % 2 != 0:
            return [
                (
                    "n_kv_heads",
                    f"diff_v1 pairs key heads (K1, K2) and needs an even n_kv_heads, got {kv}",
                )
            ]
        return []

    def cache_layout(self, config) -> CacheLayout:
        d, kv = config.dim_per_head, config.num_kv_heads
        return CacheLayout(kv, d, kv // 2, 2 * d)

    def kv_units(self, config) -> int:
        return config.num_kv_heads // 2

    def scalar_lambda(self, module) -> torch.Tensor:
        """Eq.2's λ of the layer, from its λ vectors (:func:`reparameterised_lambda`)."""
        return reparameterised_lambda(module)

    def kv_unit_name(self, config) -> str:
        return "DIFF V1 KV groups (key-head pairs)"

    def extra_parameters(self, config) -> int:
        d = config.dim_per_head
        norm = 2 * d if config.head_norm and config.head_norm_learnable else 0
        return 4 * d + norm

    def matches_by_ffn(self, config) -> bool:
        return False  # 4d + 2d a layer: matched by construction (§3.1)

    def attention_flops_for_keys(self, config, keys: float, v1_form: str) -> float:
        """Two maps per differential head against V of width 2d, counted as ``v1_form``
        says: ``qk_once`` (App. A, FlashDiffAttn_1), ``v_once`` or ``split_v`` (four calls)."""
        d = config.dim_per_head
        per_map = 2.0 * d * keys
        pairs = config.n_heads // 2
        if v1_form == "qk_once":
            return pairs * 2 * (per_map + 2.0 * (2 * d) * keys)
        if v1_form == "v_once":
            return pairs * (2 * per_map + 2.0 * (2 * d) * keys)
        return pairs * 2 * 2 * (per_map + 2.0 * d * keys)

    vllm_width_note = "DIFF V1 runs its attention at width 2·head_dim = {width}"

    def vllm_call(self, config) -> tuple[int, int, int]:
        """Each differential head's (q1, q2) as two query heads zero-padded to 2d, against
        its group's K1/K2 and V of width 2d (:func:`diffattn.vllm_plugin.layout`)."""
        return config.n_heads, config.num_kv_heads // 2, 2 * config.dim_per_head

    def vllm_weights(self, config, layer_index: int) -> dict[str, ServedWeight]:
        d = config.dim_per_head
        weights = {name: ServedWeight((d,)) for name in LAMBDA_VECTORS}
        if config.head_norm and config.head_norm_learnable:
            weights["head_norm.weight"] = ServedWeight((2 * d,))
        return weights

    def vllm_queries(self, config, q):
        """Query head 2j is ``[q1_j | 0]``, head 2j+1 is ``[0 | q2_j]``: against a group's
        key ``[K1 | K2]`` (how ``k_proj`` lays the pair out) their products are exactly
        ``q1·K1`` and ``q2·K2``, since a product with an exact zero adds an exact zero."""
        d, tokens = config.dim_per_head, q.shape[0]
        pairs = q.view(tokens, -1, 2, d)
        padded = q.new_zeros(tokens, pairs.shape[1], 2, 2 * d)
        padded[:, :, 0, :d] = pairs[:, :, 0]
        padded[:, :, 1, d:] = pairs[:, :, 1]
        return padded.view(tokens, -1)

    def vllm_output(self, config, layer_index: int, out, x, weights):
        """Eq.1 and Eq.3 on the call's output ``(T, 2H·2d)``: ``o1 − λ·o2`` per differential
        head in fp32 with λ by Eq.2, then (``head_norm``) RMSNorm over 2d × (1 − λ_init), each
        step rounded to ``out``'s dtype where :class:`DiffAttentionV1` rounds; ``(T, H·2d)``."""
        lambda_init = config.lambda_init_for_layer(layer_index)
        vectors = {name: weights[name] for name in LAMBDA_VECTORS}
        lam = reparameterised_lambda(SimpleNamespace(lambda_init=lambda_init, **vectors))
        d, tokens = config.dim_per_head, out.shape[0]
        pairs = out.view(tokens, -1, 2, 2 * d).float()
        diff = (pairs[:, :, 0] - lam * pairs[:, :, 1]).to(out.dtype)
        if config.head_norm:
            y = diff.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + config.head_norm_eps)
            if "head_norm.weight" in weights:
                y = y * weights["head_norm.weight"].float()
            diff = y.to(out.dtype) * (1.0 - lambda_init)
        return diff.reshape(tokens, -1)

    def tp_plan(self, config, colwise, replicated):
        return {"": replicated(stream=False)}  # λ replicated, after its projections

    def lambda_init(self, config, layer_index: int) -> float:
        return config.lambda_init_for_layer(layer_index)

    def describe(self, config) -> str:
        return f"DIFF V1: {paired_heads_text(config)}"


DIFF_V1 = register_attention_type(DiffV1())
