"""DINT: differential-integral attention (Cang et al., "DINT Transformer", arXiv 2501.17486,
EMNLP 2025).

Source of the equations. The paper's body could not be read; the equations below are
*reconstructed* from its abstract ("computing global importance scores and integrating them
into the attention matrix"; "the unified parameter design enforces row-normalized attention
matrices"), public summaries (DINT builds on DIFF V1's two maps, λ and multi-head block), and
the one public implementation found (a non-causal tabular model: ``A1 − λ A2 + λ ·
mean_over_rows(A1)``). The equation numbers D1-D7 are ours, not the paper's:

* D1 ``[Q1; Q2] = X W_Q``, ``[K1; K2] = X W_K``, ``V = X W_V``                (DIFF V1 Eq.1)
* D2 ``A1 = softmax(Q1 K1ᵀ/√d + M)``, ``A2 = softmax(Q2 K2ᵀ/√d + M)``
* D3 ``λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init``                          (DIFF V1 Eq.2)
* D4 the integral (global-importance) term, a column mean of the map over a set of rows:
  ``G[i, :] = (1/|R(i)|) Σ_{m ∈ R(i)} A1[m, :]``
* D5 ``DINT(X) = (A1 − λ A2 + γ G) V`` with the unified parameter ``γ = λ``
* D6 rows of A1, A2 and G sum to 1, so rows of the map sum to ``1 − λ + γ`` = 1 when ``γ = λ``
* D7 ``head_j ← (1 − λ_init)·RMSNorm_2d(head_j)``, ``Concat(head_j) W_O``      (DIFF V1 Eq.3)

Layout, parameters and initialisation are DIFF V1's (the module subclasses
:class:`~diffattn.attention.diff_v1.DiffAttentionV1`): DINT adds no parameter.

Options (``attention_options.dint``; what the sources leave open):

* ``integral_rows``: ``"visible"`` (default): ``R(i)`` is the set of rows query i may see,
  ``m ≤ i`` under the causal mask (a running mean over the prefix), real rows only with padding
  (a padding query's row is its own), rows of its own document when documents are packed. It is
  causal and keeps D6. ``"all"`` (the unmasked column mean over every row, as the one public
  implementation, a non-causal tabular model by a third party, computes it; how the paper
  treats causality could not be read) lets a token read later tokens under the causal mask, so
  the causal LM refuses it.
* ``integral_map``: the map averaged: ``"first"`` (A1, default; the public code), ``"second"``
  (A2) or ``"both"`` ((A1 + A2)/2).
* ``gamma``: ``"lambda"`` (default, γ = λ) or a fixed number; ``0.0`` is DIFF V1.

Computation, on every backend through the kernel entry points: since G is a mean of rows of A1,
``G V`` is the same mean of the rows of ``A1 V``. The layer runs DIFF V1's call
(:func:`~diffattn.attention.kernels.differential_attention`: ``A1 V − λ A2 V``), one more call
for the averaged map's output (``softmax_attention``; ``"both"``: DIFF V1's call with λ = −1),
and :func:`visible_mean` of that output: masked cumulative sums over the query rows, restarted
per packed document, or, under a full 4-D mask, the mean over the rows the mask lets each query
see (refused unless the mask is transitive, as D6 needs).

KV cache: the integral term of a new token averages the outputs of *every earlier* token's
first map, which keys and values do not determine (the earlier queries are gone), so a DINT
layer refuses to attend from a cache that holds tokens (one ``ValueError``). A forward that
fills an empty cache is exact; generation recomputes the whole sequence without a cache.

Maps (``output_attentions``): ``a1``, ``a2``, ``lam`` as DIFF V1 returns them, and ``diff`` the
whole map of D5, ``A1 − λ A2 + γ G``, from which the layer's output is then computed. An
observer of :mod:`diffattn.attention.observe` (the probe) sees DIFF V1's call of the layer (A1,
A2, λ, ``A1 − λ A2``); the integral term is added outside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from diffattn.attention.common import AttentionMaps, with_maps
from diffattn.attention.diff_v1 import (
    DIFF_V1,
    DiffAttentionV1,
    paired_heads_text,
    reparameterised_lambda,
)
from diffattn.attention.differential_common import PairedHeadsType, one_of, output_from_map
from diffattn.attention.kernels import differential_attention, softmax_attention
from diffattn.attention.mask import AttentionMask
from diffattn.attention.types import TypeOption, register_attention_type
from diffattn.config import ModelConfig
from diffattn.layers import local_share

NAME = "dint"

CACHE_REFUSAL = (
    "attention type 'dint' cannot attend from a KV cache that holds tokens: the integral "
    "term of a new token (D4) averages the first map's outputs of every earlier token, which "
    "the cached keys and values do not determine; run the whole sequence without a cache "
    "(use_cache=False)"
)


# --------------------------------------------------------------------------------------------
# the integral term: a mean over the query rows each query may see (D4, "visible")
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VisibleRows:
    """``R(i)`` of D4 for a call whose N queries are the first N keys: the masking rule's
    causal prefix, restricted to ``real`` rows (a padding query's row is its own) and to the
    query's document (``runs``), or, for a full mask, the rows ``allowed[i]`` names."""

    real: torch.Tensor | None = None
    """``(B, N)`` bool, ``True`` for real tokens; ``None`` without padding."""
    runs: torch.Tensor | None = None
    """``(B, N)`` index of each token's run of one document; ``None`` for one document."""
    allowed: torch.Tensor | None = None
    """``(B or 1, 1, N, N)`` bool, a transitive full mask; ``None`` for the rule above."""


def visible_rows(mask: AttentionMask, n: int, n_keys: int) -> VisibleRows:
    """The rows each of the ``n`` queries of a call averages over, from the call's ``mask``.

    Refuses (``ValueError``) a call after cached tokens (:data:`CACHE_REFUSAL`), a full mask
    that lets a query read keys after the call's own tokens, and a full mask that is not
    transitive (a visible row that reads a key the query may not: G would leak it, D6 fails).
    """
    offset = mask.query_offset
    if isinstance(offset, torch.Tensor):
        if torch.compiler.is_compiling():
            raise ValueError(CACHE_REFUSAL)
        offset = int(offset)
    if offset != 0:
        raise ValueError(CACHE_REFUSAL)
    if mask.allowed is None:
        real = None if mask.key_padding is None else mask.key_padding[:, :n].bool()
        runs = None if mask.document_ids is None else mask.document_ids[:, :n]
        return VisibleRows(real=real, runs=runs)
    device = mask.allowed.device
    allowed = mask.dense(n, n_keys, device)
    if n_keys > n and bool(allowed[..., n:].any()):
        raise ValueError(
            "dint: the 4-D attention mask lets a query read a key after the call's tokens; "
            "the integral term averages the call's own query rows"
        )
    allowed = allowed[..., :n]
    reach = torch.matmul(allowed.float(), allowed.float()) > 0
    if bool((reach & ~allowed).any()):
        raise ValueError(
            "dint: the 4-D attention mask is not transitive (a row that query i may see reads a "
            "key that i may not), so the integral term (D4) would leak that key to i"
        )
    return VisibleRows(allowed=allowed)


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 where the device has it (sums over a document restart by subtracting two
    prefix sums, which float32 would round at the scale of the whole row), else float32."""
    return torch.float64 if x.device.type in ("cpu", "cuda") else torch.float32


def _before_document(total: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    """For each row, ``total`` (prefix sums along dim 2) at the row before its document's
    first row, 0 for a document that starts the sequence."""
    n = runs.shape[1]
    index = torch.arange(n, device=runs.device).expand_as(runs)
    starts = torch.ones_like(runs, dtype=torch.bool)
    starts[:, 1:] = runs[:, 1:] != runs[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    before = (first - 1)[:, None, :, None]
    gathered = total.gather(2, before.clamp_min(0).expand(-1, total.shape[1], -1, total.shape[3]))
    return gathered * (before >= 0).to(total.dtype)


def visible_mean(src: torch.Tensor, rows: VisibleRows) -> torch.Tensor:
    """D4 applied to ``src`` ``(B, H, N, w)``: row i becomes the mean of ``src``'s rows in
    ``R(i)`` (:class:`VisibleRows`). Applied to ``A1 V`` it gives ``G V``; applied to A1 (w = S)
    it gives G. Accumulated in float64 (float32 where the device has no float64)."""
    acc = _accumulation_dtype(src)
    values = src.to(acc)
    if rows.allowed is not None:
        weights = rows.allowed.to(acc)
        return (torch.matmul(weights, values) / weights.sum(-1, keepdim=True)).to(src.dtype)
    bsz, n = values.shape[0], values.shape[2]
    if rows.real is None:
        weights = torch.ones(bsz, 1, n, 1, dtype=acc, device=values.device)
    else:
        weights = rows.real[:, None, :, None].to(acc)
    total = (values * weights).cumsum(dim=2)
    count = weights.cumsum(dim=2)
    if rows.runs is not None:
        total = total - _before_document(total, rows.runs)
        count = count - _before_document(count, rows.runs)
    mean = total / count.clamp_min(1.0)
    if rows.real is not None:  # a padding query sees only its own row
        mean = torch.where(rows.real[:, None, :, None], mean, values)
    return mean.to(src.dtype)


# --------------------------------------------------------------------------------------------
# the module
# --------------------------------------------------------------------------------------------
class DintAttention(DiffAttentionV1):
    """D1-D7: DIFF V1's projections, λ (Eq.2) and head norm (Eq.3), plus ``γ G V`` (D4, D5)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        options = config.options_of(NAME)
        self.integral_map = options["integral_map"]
        self.gamma = options["gamma"]

    def coefficient(self, lam: torch.Tensor) -> torch.Tensor | float:
        """γ of D5: λ itself (the unified parameter) or the fixed ``gamma`` option."""
        return lam if self.gamma == "lambda" else float(self.gamma)

    def integral_source(self, q1, q2, k1, k2, v, mask) -> torch.Tensor:
        """The output of the averaged map (``integral_map``): ``A1 V``, ``A2 V`` or
        ``(A1 + A2) V / 2`` (DIFF V1's call with λ = −1), ``(B, H, N, 2d)``. Not observed."""
        if self.integral_map == "first":
            return softmax_attention(q1, k1, v, mask, self.scale, self.backend)[0]
        if self.integral_map == "second":
            return softmax_attention(q2, k2, v, mask, self.scale, self.backend)[0]
        minus_one = torch.full((), -1.0, device=q1.device)
        both = differential_attention(q1, q2, k1, k2, v, minus_one, mask, self.scale, self.backend)
        return both[0] * 0.5

    def attend(self, x, q, k, v, mask, need_weights):
        """D2-D5 per differential head, then D7 (Eq.3's head norm × (1 − λ_init))."""
        rows = visible_rows(mask, q.shape[2], k.shape[2])
        q1, q2 = q[:, 0::2], q[:, 1::2]
        k1, k2 = k[:, 0::2], k[:, 1::2]
        lam = local_share(self.lambda_full())  # replicated λ, read by this rank's heads
        gamma = self.coefficient(lam)
        args = (q1, q2, k1, k2, v, lam, mask, self.scale, self.backend)
        (out, _), maps = with_maps(
            self.layer_index, need_weights, differential_attention, *args, layer=self.layer_index
        )
        if maps is None:
            integral = visible_mean(self.integral_source(q1, q2, k1, k2, v, mask), rows)
            out = out + _as(gamma, out) * integral  # D5: (A1 − λA2)V + γ·GV
        else:
            source = {"first": maps.a1, "second": maps.a2}.get(self.integral_map)
            if source is None:
                source = (maps.a1 + maps.a2) / 2
            applied = maps.diff + _as(gamma, maps.diff) * visible_mean(source, rows)
            out = output_from_map(applied, v)
            maps = AttentionMaps(diff=applied, a1=maps.a1, a2=maps.a2, lam=maps.lam)
        if self.head_norm is not None:
            out = self.head_norm(out) * (1.0 - self.lambda_init)
        return out, maps


def _as(gamma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    return gamma.to(like.dtype) if isinstance(gamma, torch.Tensor) else gamma


# --------------------------------------------------------------------------------------------
# the declaration
# --------------------------------------------------------------------------------------------
def _integral_rows(value: Any) -> str | None:
    if value == "all":
        return (
            "'all' averages every query row of the map (the unmasked form of the public "
            "non-causal code), which under the causal mask lets a token read later tokens; the "
            "causal LM takes 'visible'"
        )
    return one_of("visible", "all")(value)


@dataclass(frozen=True)
class GammaOption(TypeOption):
    """γ: the text ``lambda`` (γ = λ) or a finite number."""

    def parse(self, text: str) -> Any:
        if text.strip().lower() == "lambda":
            return "lambda"
        try:
            return float(text)
        except ValueError:
            raise ValueError(
                f"option {self.name!r}: expected 'lambda' or a number, got {text!r}"
            ) from None

    def problem(self, value: Any) -> str | None:
        if value == "lambda" and isinstance(value, str):
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be 'lambda' or a number, got {value!r}"
        return None if math.isfinite(value) else f"must be finite, got {value!r}"


OPTIONS = (
    TypeOption(
        "integral_rows",
        "visible",
        "the query rows the integral term G averages (D4): 'visible', the rows the query may "
        "see (causal running mean; real rows; its own document); 'all' (the unmasked mean over "
        "every row, as the public non-causal code takes it) is refused in the causal LM",
        kind=str,
        check=_integral_rows,
    ),
    TypeOption(
        "integral_map",
        "first",
        "the softmax map averaged into G: 'first' (A1, the public implementation), 'second' "
        "(A2) or 'both' ((A1 + A2)/2)",
        kind=str,
        check=one_of("first", "second", "both"),
    ),
    GammaOption(
        "gamma",
        "lambda",
        "the coefficient of G (D5): 'lambda' (γ = λ, the unified parameter: rows of the map sum "
        "to 1) or a fixed number (0 gives DIFF V1)",
    ),
)


class Dint(PairedHeadsType):
    """DINT (arXiv 2501.17486; D1-D7 reconstructed, see :mod:`diffattn.attention.dint`): DIFF
    V1's heads, λ and head norm with the integral term ``γ G`` added to the map. DIFF V1's
    parameters exactly, so matched by construction."""

    name = NAME
    title = "DINT"
    colour = "tab:purple"
    module = DintAttention
    options = OPTIONS
    decodes_from_cache = False  # G needs every earlier token's first-map output (module doc)
    source = (
        "DINT Transformer (arXiv 2501.17486); D1-D7 reconstructed from the abstract, summaries "
        "and a public implementation"
    )
    lambda_label = "λ (DIFF V1 Eq.2; γ = λ)"
    lambda_key = "lambda"
    entry = "diff_v1"  # the kernel entry point of its observed call
    vllm_reason = (
        "DINT's integral term averages every earlier token's first-map output, which a paged "
        "KV cache does not hold"
    )
    tensor_parallel = True
    context_parallel_reason = (
        "DINT's integral term (D4) averages the first map's outputs over earlier query rows, "
        "which live on other context-parallel ranks; gathered keys and values do not "
        "determine them"
    )

    def scalar_lambda(self, module) -> torch.Tensor:
        """λ of DIFF V1 Eq.2 from the layer's four vectors (γ = λ by default)."""
        return reparameterised_lambda(module)

    def extra_parameters(self, config) -> int:
        return DIFF_V1.extra_parameters(config)  # no parameter of its own

    def attention_flops_for_keys(self, config, keys: float, v1_form: str) -> float:
        """DIFF V1's count (D1-D5 need its two maps; ``G V`` is a running mean of ``A1 V``,
        O(d) a query). The layer recomputes the averaged map's output in one more call (two
        maps for ``integral_map='both'``), which this count leaves out."""
        return super().attention_flops_for_keys(config, keys, v1_form)

    def tp_plan(self, config, colwise, replicated):
        """DIFF V1's: whole KV groups per rank; λ and the norm weight replicated. The
        integral term is per head and per token, so it stays on the rank of its head."""
        return {"": replicated(stream=False)}

    def describe(self, config) -> str:
        options = config.options_of(self.name)
        return (
            f"DINT: {paired_heads_text(config)}, integral term of the "
            f"{options['integral_map']} map, γ = {options['gamma']}"
        )


DINT = register_attention_type(Dint())
