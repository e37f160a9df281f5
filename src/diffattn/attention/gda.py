"""GDA: Grouped Differential Attention (Lim et al., Motif Technologies, arXiv 2510.06949).

DIFF V1's differential heads split *unevenly*: ``H_s = r·H_n`` signal-preserving maps (the
first map of a differential head) share ``H_n`` noise-control maps (the subtracted one), each
noise head serving the ``r`` signal heads of its group ("controlled repetition, akin to GQA").

Source of the equations. The paper's method section could not be read (only its abstract and
third-party summaries), so the equations and the layout below are *reconstructed* from public
code of the same authors' ecosystem, which agrees on the layout and the equations (λ_init is
DIFF V1's schedule here; Motif's own code was not read): vLLM's
``GroupedDifferentialAttentionImpl`` (``v1/attention/backends/grouped_diff_attn.py``, which
cites 2510.06949) and the Motif-2-12.7B model that uses GDA (40 query heads = 32 signal + 8
noise, ratio 4). The equation numbers D1-D5 are ours, not the paper's. With head width d,
``G = n_kv_heads / 2`` KV groups:

* D1: signal head i: ``A1_i = softmax(Q1_i K1_gᵀ/√d + mask)``; noise head j:
  ``A2_j = softmax(Q2_j K2_gᵀ/√d + mask)``; RoPE on Q and K.
* D2: signal head i reads noise head ``j = i // r``; both read KV group
  ``g = i // (H_s / G) = j // (H_n / G)`` (flash-attn's GQA map).
* D3: ``λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init(l)``: DIFF V1 Eq.2, one scalar per layer.
* D4: ``head_i = A1_i V_g − λ·A2_j V_g`` with V_g of width 2d, then
  ``(1 − λ_init)·RMSNorm_2d(head_i)``: DIFF V1 Eq.1 and Eq.3.
* D5: ``Concat(head_0 .. head_{H_s−1}) W_O``: only signal heads have outputs; W_O reads
  ``H_s·2d`` channels.

Layout: ``q_proj`` holds ``H_s + H_n`` query heads of width d in groups of ``r + 1``, ``r``
signal heads then their noise head (vLLM's "stripe" layout; block ``(r+1)·j + t`` is signal
head ``r·j + t`` for ``t < r`` and noise head j for ``t = r``); ``k_proj``/``v_proj`` are
DIFF V1's (K1_g, K2_g = key heads 2g, 2g+1; V_g of width 2d); ``o_proj`` reads signal head i
in columns ``[2d·i, 2d·(i+1))``. With ``ratio = 1`` every name, shape and operation is DIFF
V1's.

The open choices are the type's options (``attention_options.gda``): ``ratio`` (the paper
finds 3:1 and 4:1 best), ``head_budget`` (what ``n_heads`` counts: all query heads, as vLLM
and Motif count them, or twice the output heads) and ``n_noise_heads`` (given outright).

Computation: each signal head is given its noise head's query (the noise queries repeated
``r`` times), so the layer is DIFF V1 Eq.1 over ``H_s`` head pairs, through the same kernel
entry point (:func:`diffattn.attention.kernels.differential_attention`) on every backend; a
ratio-1 layer makes exactly DIFF V1's call. The noise maps are then computed once per signal
head, not once per noise head, and :meth:`Gda.attention_flops_for_keys` counts them so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from diffattn.attention.common import ProjectedAttention
from diffattn.attention.diff_v1 import (
    DIFF_V1,
    DiffAttentionV1,
    add_lambda_and_head_norm,
    reparameterised_lambda,
)
from diffattn.attention.registry import ENTRY_DIFF
from diffattn.attention.types import (
    AttentionType,
    CacheLayout,
    ServedWeight,
    TypeOption,
    positive_int,
    register_attention_type,
)
from diffattn.config import ModelConfig

HEAD_BUDGETS = ("queries", "outputs")
"""What the config's ``n_heads`` counts for GDA (see the ``head_budget`` option)."""


class GdaHeads(NamedTuple):
    """The head counts of one GDA layer."""

    ratio: int
    """r: signal heads per noise head."""
    n_signal: int
    """H_s = r·H_n: signal heads, the heads W_O reads."""
    n_noise: int
    """H_n: noise heads."""
    n_groups: int
    """G = n_kv_heads / 2: KV groups (K1, K2 pairs; V heads of width 2d)."""

    @property
    def n_query(self) -> int:
        """Query heads of width d that ``q_proj`` projects: ``H_s + H_n``."""
        return self.n_signal + self.n_noise


def pair_with_noise(q: torch.Tensor, ratio: int) -> torch.Tensor:
    """D2 on query heads along dim 1 in ``(ratio + 1)``-head groups (r signal heads, then
    their noise head): ``(B, H_s + H_n, ...)`` → ``(B, 2·H_s, ...)`` with heads ``(2i, 2i + 1)
    = (Q1_i, Q2_{i // r})``, DIFF V1's pairs. Ratio 1 returns ``q`` itself."""
    if ratio == 1:
        return q
    groups = q.unflatten(1, (q.shape[1] // (ratio + 1), ratio + 1))  # (B, H_n, r + 1, ...)
    signal = groups[:, :, :ratio]
    noise = groups[:, :, ratio:].expand_as(signal)  # noise head j for its r signal heads
    return torch.stack((signal, noise), dim=3).flatten(1, 3)


class GroupedDifferentialAttention(ProjectedAttention):
    """D1-D5 of the module docstring: DIFF V1's λ (Eq.2) and head norm (Eq.3), ``H_n`` noise
    maps shared by ``r`` signal heads each, W_O over the ``H_s`` signal heads of width 2d."""

    value_width_factor = 2  # V heads of width 2d, as DIFF V1

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        heads = GDA.heads(config)
        super().__init__(config, layer_index, q_heads=heads.n_query)
        d = self.head_dim
        self.o_proj = nn.Linear(heads.n_signal * 2 * d, config.d_model, bias=False)  # D5
        self.ratio = heads.ratio
        self.n_heads = heads.n_signal  # the output heads
        self.n_noise_heads = heads.n_noise
        self.n_kv_heads = heads.n_groups
        self.lambda_init = config.lambda_init_for_layer(layer_index)
        add_lambda_and_head_norm(self, config, d)  # D3, D4: DIFF V1's λ vectors and head norm
        self.reset_lambda()

    # DIFF V1's initialisation and λ (Eq.2), on the same four vectors
    reset_own_parameters = DiffAttentionV1.reset_own_parameters
    reset_lambda = DiffAttentionV1.reset_lambda
    lambda_full = DiffAttentionV1.lambda_full

    def paired_queries(self, q: torch.Tensor) -> torch.Tensor:
        """D2: the query heads as DIFF V1's pairs, ``(Q1_i, Q2_{i // r})`` = heads
        ``(2i, 2i + 1)`` for signal head i: ``(B, H_s + H_n, N, d)`` → ``(B, 2·H_s, N, d)``.
        Ratio 1 returns ``q`` itself (already DIFF V1's pairs).

        Head counts are read from the tensor (a tensor-parallel rank holds whole KV groups,
        each with whole ``(r + 1)``-head query groups)."""
        return pair_with_noise(q, self.ratio)

    def attend(self, x, q, k, v, mask, need_weights):
        """D1, D2, D4: DIFF V1 Eq.1 over the signal heads paired with their noise heads
        (:meth:`paired_queries`) against their group's (K1, K2) and V, then Eq.3's head norm:
        :meth:`DiffAttentionV1.attend`, the same kernel call."""
        return DiffAttentionV1.attend(self, x, self.paired_queries(q), k, v, mask, need_weights)


def _head_budget(value: Any) -> str | None:
    return None if value in HEAD_BUDGETS else f"must be one of {', '.join(HEAD_BUDGETS)}"


@dataclass(frozen=True)
class OptionalIntOption(TypeOption):
    """A :class:`TypeOption` whose value is a positive integer or ``None`` (text ``none``)."""

    def parse(self, text: str) -> Any:
        return None if text.strip().lower() == "none" else super().parse(text)

    def problem(self, value: Any) -> str | None:
        return None if value is None else super().problem(value)


OPTIONS = (
    TypeOption(
        "ratio",
        3,
        "signal heads per noise head (r); the paper finds moderate imbalance best, 3:1 or 4:1",
        kind=int,
        check=positive_int,
    ),
    TypeOption(
        "head_budget",
        "queries",
        "what n_heads counts when n_noise_heads is not given: 'queries' (H_s + H_n = n_heads, "
        "as vLLM and Motif count them: the baseline's W_Q and maps, W_O grows to H_s·2d) or "
        "'outputs' (H_s = n_heads / 2: the baseline's W_O, fewer query heads)",
        kind=str,
        check=_head_budget,
    ),
    OptionalIntOption(
        "n_noise_heads",
        None,
        "H_n given outright (Motif's num_noise_heads; set by growth); head_budget is then not read",
        kind=int,
        check=positive_int,
    ),
)


class Gda(AttentionType):
    """GDA (arXiv 2510.06949, equations reconstructed from vLLM's and Motif-2's code; see
    :mod:`diffattn.attention.gda`): ``H_s = r·H_n`` signal heads sharing ``H_n`` noise heads,
    DIFF V1's KV groups, λ and head norm, W_O over ``H_s·2d``."""

    name = "gda"
    title = "GDA"
    colour = "tab:green"
    module = GroupedDifferentialAttention
    options = OPTIONS
    config_fields = DIFF_V1.config_fields  # λ_init, λ std, the head norm: DIFF V1's fields
    differential = True
    entry = ENTRY_DIFF  # DIFF V1's entry point, over the signal heads paired with their noise
    source = (
        "Grouped Differential Attention (arXiv 2510.06949); D1-D5 reconstructed from vLLM's "
        "GroupedDifferentialAttentionImpl and Motif-2-12.7B"
    )
    lambda_label = "λ (DIFF V1 Eq.2)"
    lambda_key = "lambda"
    vllm_reason = None  # DIFF V1's call over the signal heads paired with their noise heads
    tensor_parallel = True
    context_parallel_reason = None  # DIFF V1's call: rows over the gathered K/V

    # --- heads ----------------------------------------------------------------------------
    def heads(self, config) -> GdaHeads:
        """The head counts of ``config``'s GDA layers (``ValueError`` when they do not fit:
        :meth:`check` says why)."""
        problems = self.check(config)
        if problems:
            field, why = problems[0]
            raise ValueError(f"ModelConfig.{field}: {why}")
        opts = config.options_of(self.name)
        r = opts["ratio"]
        n_noise = opts["n_noise_heads"]
        if n_noise is None:
            n_noise = (
                config.n_heads // (r + 1)
                if opts["head_budget"] == "queries"
                else config.n_heads // 2 // r
            )
        return GdaHeads(r, r * n_noise, n_noise, config.num_kv_heads // 2)

    def check(self, config):
        """Even ``n_kv_heads`` (K1, K2 pairs); ``n_heads`` splitting as ``head_budget`` says;
        noise heads spread evenly over the KV groups. Options that are themselves refused
        are left to the config's check of ``attention_options``, which names them."""
        stored = config.attention_options.get(self.name, {})
        if not isinstance(stored, dict) or self.option_problems(stored):
            return []
        opts = self.option_values(stored)
        r, kv, h = opts["ratio"], config.num_kv_heads, config.n_heads
        where = f"attention_options.{self.name}"
        if kv % 2 != 0:
            why = f"gda pairs key heads (K1, K2) and needs an even n_kv_heads, got {kv}"
            return [("n_kv_heads", why)]
        if opts["n_noise_heads"] is not None:
            n_noise, field = opts["n_noise_heads"], f"{where}.n_noise_heads"
        elif opts["head_budget"] == "queries":
            if h % (r + 1) != 0:
                return [
                    (
                        f"{where}.ratio",
                        f"head_budget='queries' splits n_heads={h} into groups of ratio + 1 = "
                        f"{r + 1} query heads (r signal, 1 noise); {r + 1} does not divide {h}",
                    )
                ]
            n_noise, field = h // (r + 1), f"{where}.ratio"
        else:
            if h % 2 != 0 or (h // 2) % r != 0:
                return [
                    (
                        f"{where}.ratio",
                        f"head_budget='outputs' makes n_heads / 2 signal heads, which ratio={r} "
                        f"must divide; got n_heads={h}",
                    )
                ]
            n_noise, field = h // 2 // r, f"{where}.ratio"
        if n_noise % (kv // 2) != 0:
            return [
                (
                    field,
                    f"the {n_noise} noise heads must split evenly over the {kv // 2} KV groups "
                    f"(n_kv_heads={kv} key heads in K1, K2 pairs)",
                )
            ]
        return []

    def query_heads(self, config) -> int:
        return self.heads(config).n_query

    def output_heads(self, config) -> int:
        return self.heads(config).n_signal

    def n_heads_for_output_heads(self, output_heads: int, stored) -> int:
        """``n_heads`` for ``H_s = output_heads`` signal heads: ``H_s + H_s / r`` with
        ``head_budget`` 'queries', ``2·H_s`` with 'outputs'; ``ValueError`` when ``r`` does not
        divide ``H_s``, or when ``n_noise_heads`` fixes the heads (give ``n_heads`` then)."""
        opts = self.option_values(stored)
        r, where = opts["ratio"], f"attention_options.{self.name}"
        if opts["n_noise_heads"] is not None:
            raise ValueError(
                f"num_attention_heads cannot give n_heads for gda with {where}.n_noise_heads "
                "set (the noise heads are fixed; n_heads is the baseline's head budget): give "
                "n_heads"
            )
        if output_heads % r != 0:
            raise ValueError(
                f"num_attention_heads={output_heads} signal heads do not split into groups of "
                f"{where}.ratio={r}"
            )
        if opts["head_budget"] == "queries":
            return output_heads + output_heads // r
        return 2 * output_heads

    def output_width(self, config) -> int:
        return 2 * config.dim_per_head

    def cache_layout(self, config) -> CacheLayout:
        return DIFF_V1.cache_layout(config)  # K1/K2 of width d, V of width 2d

    def kv_units(self, config) -> int:
        return config.num_kv_heads // 2

    def kv_unit_name(self, config) -> str:
        return "GDA KV groups (key-head pairs)"

    # --- parameters and FLOPs ---------------------------------------------------------------
    def _projection_difference(self, config) -> int:
        """W_Q and W_O parameters beyond the baseline's: ``D·d·(H_s + H_n − n_heads)`` in W_Q
        and ``D·(H_s·2d − n_heads·d)`` in W_O (negative when smaller)."""
        heads, d, dm = self.heads(config), config.dim_per_head, config.d_model
        return dm * d * (heads.n_query - config.n_heads) + dm * self.extra_linear_outputs(config)

    def extra_linear_outputs(self, config) -> int:
        """W_O's input channels beyond the baseline's ``n_heads·d`` (``H_s·2d − n_heads·d``;
        negative when fewer). Not a projection of its own, but the same FLOPs per token,
        ``2·d_model`` a channel, which is what this count is for."""
        return 2 * config.dim_per_head * self.heads(config).n_signal - config.n_heads * (
            config.dim_per_head
        )

    def extra_parameters(self, config) -> int:
        """vs. the baseline: W_Q's and W_O's difference, DIFF V1's 4d λ and 2d norm weight.
        ``head_budget='queries'``: ``+D·d·n_heads·(r − 1)/(r + 1)`` in W_O;
        ``'outputs'``: ``−D·d·(n_heads/2)·(1 − 1/r)`` in W_Q."""
        return self._projection_difference(config) + DIFF_V1.extra_parameters(config)

    def matches_by_ffn(self, config) -> bool:
        """Whether W_Q or W_O differ from the baseline's (the FFN gives the difference back,
        or takes it when negative); at ratio 1 the type is DIFF V1, matched by construction."""
        return self._projection_difference(config) != 0

    def attention_flops_for_keys(self, config, keys: float, v1_form: str) -> float:
        """As the kernels compute it: DIFF V1's count (in its ``v1_form``) over ``H_s``
        differential heads, since each signal head is given its noise head's query and the
        noise maps are computed once per signal head (module docstring). The equations need
        ``H_s + H_n`` maps, not ``2·H_s``: a kernel computing each noise map once would do
        ``(H_s + H_n) / (2·H_s)`` of the QKᵀ work. At ratio 1 this is DIFF V1's count."""
        twin = config.replace(
            attention=DIFF_V1.name,
            layer_types=None,
            attention_options={},
            n_heads=2 * self.heads(config).n_signal,
            head_dim=config.dim_per_head,
        )
        return DIFF_V1.attention_flops_for_keys(twin, keys, v1_form)

    # --- tensor parallelism -----------------------------------------------------------------
    def tp_plan(self, config, colwise, replicated):
        """DIFF V1's: a rank holding KV groups ``[a, b)`` holds their key rows, value rows,
        the ``(r + 1)``-head query groups of their noise heads (contiguous q_proj rows) and
        their signal heads' W_O columns (contiguous), so the plain column/row shards of the
        projections hold whole groups; λ and the norm weight are replicated."""
        return {"": replicated(stream=False)}

    # --- vLLM -------------------------------------------------------------------------------
    vllm_width_note = "GDA runs its attention at width 2·head_dim = {width}, as DIFF V1"

    def vllm_call(self, config) -> tuple[int, int, int]:
        """DIFF V1's call over the ``H_s`` differential heads (D2): each signal head's ``(q1,
        q2)`` as two query heads zero-padded to 2d against its KV group's ``[K1 | K2]`` and V of
        width 2d; the call's GQA map (query head i reads KV head ``i // (2·H_s / G)``) is D2's
        ``g = i // (H_s / G)``."""
        return 2 * self.heads(config).n_signal, config.num_kv_heads // 2, 2 * config.dim_per_head

    def vllm_weights(self, config, layer_index: int) -> dict[str, ServedWeight]:
        """DIFF V1's: the four λ vectors (D3) and the head norm's weight (D4), whole on every
        rank. ``q_proj`` (``H_s + H_n`` heads in ``(r + 1)``-head groups) and ``o_proj`` (over
        ``H_s·2d``) are the plugin's own projections, sized by :meth:`query_heads`,
        :meth:`output_heads` and :meth:`output_width`."""
        return DIFF_V1.vllm_weights(config, layer_index)

    def vllm_queries(self, config, q):
        """D2 then DIFF V1's padding: the ``(r + 1)``-head groups of ``q_proj`` on this rank
        ``(T, (H_s + H_n)·d / tp)`` become the pairs ``(Q1_i, Q2_{i // r})``
        (:func:`pair_with_noise`), each padded to
        ``[q1 | 0]``, ``[0 | q2]`` (:meth:`DiffV1.vllm_queries`): ``(T, 2·H_s·2d / tp)``.
        A rank holds whole KV groups, so whole ``(r + 1)``-head groups."""
        tokens, d = q.shape[0], config.dim_per_head
        paired = pair_with_noise(q.view(tokens, -1, d), self.heads(config).ratio)
        return DIFF_V1.vllm_queries(config, paired.reshape(tokens, -1))

    def vllm_output(self, config, layer_index: int, out, x, weights):
        """D4 = DIFF V1 Eq.1 and Eq.3 on the call's output (:meth:`DiffV1.vllm_output`, the same
        λ, rounding and head norm): ``(T, H_s·2d / tp)``, W_O's input (D5)."""
        return DIFF_V1.vllm_output(config, layer_index, out, x, weights)

    def scalar_lambda(self, module) -> torch.Tensor:
        """D3 = DIFF V1 Eq.2's λ of the layer, from its λ vectors."""
        return reparameterised_lambda(module)

    def lambda_init(self, config, layer_index: int) -> float:
        return config.lambda_init_for_layer(layer_index)

    def describe(self, config) -> str:
        heads, d = self.heads(config), config.dim_per_head
        return (
            f"GDA {heads.ratio}:1: {heads.n_signal} signal and {heads.n_noise} noise heads "
            f"(Q of width {d}), {heads.n_groups} KV groups with V of width {2 * d}, W_O over "
            f"{heads.n_signal}·{2 * d}"
        )


GDA = register_attention_type(Gda())
