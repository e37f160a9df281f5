"""Gated differential attention: M-DGSA (Lygizou, Farsang & Grosu, "Differential Gated
Self-Attention", arXiv 2505.24054).

Source of the equations. The paper's method section could not be read (only its title, abstract
and the start of its introduction); what they fix: each head has an excitatory and an
inhibitory softmax map (DIFF V1's two maps), fused by a sigmoid gate predicted per head from the
token embedding, in place of DIFF V1's one λ per layer. The equations below are *reconstructed*;
the numbers G1-G5 are ours, not the paper's. Differential head j (of ``H = n_heads / 2``) in KV
group ``g = j // (H / H_kv)``, ``H_kv = n_kv_heads / 2``, head width d, layer input x (after the
block's RMSNorm):

* G1 ``A⁺_j = softmax(Q1_j K1_gᵀ/√d + M)``, ``A⁻_j = softmax(Q2_j K2_gᵀ/√d + M)`` (DIFF V1 Eq.1)
* G2 ``g[t, j] = sigmoid(x_t · w_j + b_j)``: ``gate_proj`` (``(H, D)`` weight, ``(H,)`` bias),
  one gate per token and head, from that token's x alone
* G3 row t of head j's map (the query token's gate): ``"subtract"``: ``A⁺ − g·A⁻``;
  ``"convex"``: ``g·A⁺ − (1 − g)·A⁻``
* G4 ``head_j = A_j V_g`` (V of width 2d), then ``s·RMSNorm_2d(head_j)`` (DIFF V1 Eq.3's norm;
  ``s = 1 − λ_init`` or 1), skipped with ``head_norm`` off
* G5 ``Concat(head_j) W_O``

Layout: DIFF V1's q/k/v/o projections and head norm; no λ vectors; ``gate_proj`` is new.

Options (``attention_options.gated_diff``): ``fusion`` (``"subtract"`` | ``"convex"``, G3),
``gate_bias`` (whether ``gate_proj`` has a bias), ``gate_bias_init`` (``"lambda_init"``: the
gate at a zero input gives DIFF V1's λ_init(l), ``g = λ_init`` for subtract and
``g = 1/(1 + λ_init)`` for convex, i.e. an effective λ of λ_init; ``"zero"``: g = 1/2) and
``output_scale`` (``"lambda_init"``: ``s = 1 − λ_init`` | ``"none"``: s = 1).

Computation: one call of DIFF V2's entry point
(:func:`~diffattn.attention.kernels.differential_attention_v2`), whose token-wise λ
``(B, H, N, 1)`` takes the gate, so every backend's DIFF V2 path (fused ones included) serves
it. That entry point pairs query heads ``(2j, 2j+1)`` that read one key head; DIFF V1's two maps
read two key heads, so both are given at width 2d: ``[Q1, 0]`` and ``[0, Q2]`` against
``[K1, K2]`` (scale ``1/√d``), which gives exactly ``Q1 K1ᵀ`` and ``Q2 K2ᵀ``. ``"convex"`` is
``g·(o⁺ − λ' o⁻)`` with ``λ' = (1 − g)/g = exp(−z)``, the gate's logit z clamped to ±80 (where
sigmoid is 0 or 1 to float32 precision) so that λ' stays finite.

Maps (``output_attentions``): ``a1`` = A⁺, ``a2`` = A⁻, ``lam`` the λ that multiplies A⁻
relative to A⁺ (``g``, or ``(1 − g)/g`` for convex), ``(B, H, N, 1)``, and ``diff`` the map of
G3, from which the output is computed.

The KV cache is DIFF V1's (the gate needs only the token's own x).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diffattn.attention.common import AttentionMaps, ProjectedAttention, with_maps
from diffattn.attention.diff_v1 import head_norm_for, paired_heads_text
from diffattn.attention.differential_common import PairedHeadsType, one_of, output_from_map
from diffattn.attention.kernels import differential_attention_v2
from diffattn.attention.types import TypeOption, register_attention_type
from diffattn.config import ModelConfig

NAME = "gated_diff"
LOGIT_BOUND = 80.0
"""|gate logit| beyond which ``"convex"`` clamps it (sigmoid(80) = 1 − 2e-35)."""


def gate_bias_value(config, layer_index: int) -> float:
    """The initial value of every entry of ``gate_proj.bias`` (``gate_bias_init``): the logit
    of λ_init(l) (subtract) or of 1/(1 + λ_init(l)) (convex), or 0."""
    options = config.options_of(NAME)
    if options["gate_bias_init"] == "zero":
        return 0.0
    lam = config.lambda_init_for_layer(layer_index)
    gate = lam if options["fusion"] == "subtract" else 1.0 / (1.0 + lam)
    return math.log(gate / (1.0 - gate))


def paired_width(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DIFF V1's query half-heads ``(B, 2H, N, d)`` and key half-heads ``(B, 2H_kv, S, d)`` as
    DIFF V2's pairs: query heads ``[Q1_j, 0]``, ``[0, Q2_j]`` (2j, 2j+1) and key heads
    ``[K1_g, K2_g]``, all of width 2d, so pair j reads one key head and its scores are
    ``Q1_j K1_gᵀ`` and ``Q2_j K2_gᵀ``."""
    q1, q2 = q[:, 0::2], q[:, 1::2]
    zeros = torch.zeros_like(q1)
    pairs = torch.stack((torch.cat((q1, zeros), -1), torch.cat((zeros, q2), -1)), dim=2)
    keys = torch.cat((k[:, 0::2], k[:, 1::2]), dim=-1)
    return pairs.flatten(1, 2), keys


class GatedDifferentialAttention(ProjectedAttention):
    """G1-G5 of the module docstring: DIFF V1's maps fused by a per-token, per-head gate."""

    value_width_factor = 2  # V heads of width 2d (B, H_kv, N, 2d); K half-heads interleaved

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.n_heads = config.n_heads // 2  # differential heads H
        self.n_kv_heads = config.num_kv_heads // 2  # KV groups H_kv
        options = config.options_of(NAME)
        self.fusion = options["fusion"]
        self.lambda_init = config.lambda_init_for_layer(layer_index)
        self.output_scale = 1.0 - self.lambda_init if options["output_scale"] != "none" else 1.0
        self.gate_proj = nn.Linear(config.d_model, self.n_heads, bias=options["gate_bias"])
        self.head_norm = head_norm_for(config, self.head_dim)
        self.reset_own_parameters()

    def reset_own_parameters(self, generator: torch.Generator | None = None) -> None:
        """The gate's bias (``gate_bias_init``); its weight is initialised as every Linear."""
        if self.gate_proj.bias is not None:
            with torch.no_grad():
                self.gate_proj.bias.fill_(gate_bias_value(self.config, self.layer_index))

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """G2's ``x_t · w_j + b_j``, ``(B, H, N, 1)``."""
        return self.gate_proj(x).transpose(1, 2).unsqueeze(-1)

    def gate_lambda(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(λ, row scale)`` of G3 from gate logits z (any shape): subtract: ``(g, None)``
        (``A⁺ − g·A⁻``); convex: ``((1 − g)/g, g)`` (``g·(A⁺ − λ'·A⁻)``, ``λ' = exp(−z)``)."""
        if self.fusion == "subtract":
            return torch.sigmoid(logits), None
        bounded = logits.clamp(-LOGIT_BOUND, LOGIT_BOUND)
        return torch.exp(-bounded), torch.sigmoid(bounded)

    def attend(self, x, q, k, v, mask, need_weights):
        """G1-G3 in one DIFF V2 call (token-wise λ), then G4's head norm × s."""
        lam, row_scale = self.gate_lambda(self.gate_logits(x))
        pairs, keys = paired_width(q, k)
        out, maps = with_maps(
            self.layer_index,
            need_weights,
            differential_attention_v2,
            pairs,
            keys,
            v,
            lam,
            mask,
            self.scale,
            self.backend,
            paired=True,
            layer=self.layer_index,
        )
        if row_scale is not None:
            if maps is None:
                out = out * row_scale.to(out.dtype)
            else:
                applied = maps.diff * row_scale.float()
                out = output_from_map(applied, v)
                maps = AttentionMaps(diff=applied, a1=maps.a1, a2=maps.a2, lam=maps.lam)
        if self.head_norm is not None:
            out = self.head_norm(out) * self.output_scale
        return out, maps


OPTIONS = (
    TypeOption(
        "fusion",
        "subtract",
        "how the gate g fuses the two maps (G3): 'subtract' (A⁺ − g·A⁻, the gate in DIFF V1's "
        "λ's place) or 'convex' (g·A⁺ − (1 − g)·A⁻)",
        kind=str,
        check=one_of("subtract", "convex"),
    ),
    TypeOption("gate_bias", True, "whether gate_proj has a bias b_j (G2)", kind=bool),
    TypeOption(
        "gate_bias_init",
        "lambda_init",
        "the bias's initial value: 'lambda_init' (the effective λ at a zero gate input is DIFF "
        "V1's λ_init of the layer) or 'zero' (g = 1/2)",
        kind=str,
        check=one_of("lambda_init", "zero"),
    ),
    TypeOption(
        "output_scale",
        "lambda_init",
        "the factor after the head norm (G4): 'lambda_init' (1 − λ_init, DIFF V1 Eq.3) or "
        "'none' (1)",
        kind=str,
        check=one_of("lambda_init", "none"),
    ),
)


class GatedDiff(PairedHeadsType):
    """M-DGSA (arXiv 2505.24054; G1-G5 reconstructed, see
    :mod:`diffattn.attention.gated_diff`): DIFF V1's heads and head norm, its λ replaced by a
    sigmoid gate per token and head, ``gate_proj``: d_model → n_heads / 2. ``H·(D + 1)`` more
    parameters a layer than the baseline's attention, treated as matched by construction (the
    SwiGLU would narrow by less than two hidden units a layer)."""

    name = NAME
    title = "Gated DIFF"
    colour = "tab:brown"
    module = GatedDifferentialAttention
    options = OPTIONS
    config_fields = ("lambda_init", "head_norm", "head_norm_learnable", "head_norm_eps")
    source = (
        "Differential Gated Self-Attention, M-DGSA (arXiv 2505.24054); G1-G5 reconstructed "
        "from the abstract"
    )
    lambda_label = "mean λ of the gate (G3: g, or (1 − g)/g for convex)"
    lambda_key = "lambda_mean"
    entry = "diff_v2"  # the kernel entry point its module calls (and observers see)
    vllm_reason = "the diffattn vLLM plugin declares no layout for the per-token gate of two maps"
    tensor_parallel = True
    context_parallel_reason = None  # the gate is token-wise: local to each rank

    def token_lambda(self, module):
        """``gate_proj``'s output z ``(B, N, H)``, read as G3's λ (``g`` or ``(1 − g)/g``)."""
        return module.gate_proj, lambda logits: module.gate_lambda(logits)[0]

    def extra_linear_outputs(self, config) -> int:
        return config.n_heads // 2  # gate_proj: d_model -> H

    def extra_parameters(self, config) -> int:
        """``gate_proj`` (``H·D``, ``+H`` with its bias) and the 2d head-norm weight."""
        heads = config.n_heads // 2
        bias = heads if config.options_of(self.name)["gate_bias"] else 0
        norm = 2 * config.dim_per_head if config.head_norm and config.head_norm_learnable else 0
        return heads * config.d_model + bias + norm

    def attention_flops_for_keys(self, config, keys: float, v1_form: str) -> float:
        """DIFF V1's count (G1 and G4 are its two maps and V products). The layer runs them
        as one DIFF V2 call at width 2d, Q·K over zero halves included, which this count
        leaves out."""
        return super().attention_flops_for_keys(config, keys, v1_form)

    def tp_plan(self, config, colwise, replicated):
        """Whole KV groups per rank (DIFF V1's projections), ``gate_proj`` split by output
        head so that g_j sits with head j, the head norm's weight replicated."""
        return {"gate_proj": colwise(), "": replicated(stream=False)}

    def describe(self, config) -> str:
        fusion = config.options_of(self.name)["fusion"]
        return f"Gated DIFF ({fusion}): {paired_heads_text(config)}, a gate per head and token"


GATED_DIFF = register_attention_type(GatedDiff())
