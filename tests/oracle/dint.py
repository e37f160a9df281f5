"""Slow, obviously-correct DINT attention (differential-integral attention).

Source: "DINT Transformer" (Cang, Liu, Zhang, Zhao, Shi; arXiv 2501.17486, EMNLP 2025). The
paper's full text was not available to the author of this file; the equations below are
reconstructed from its abstract and public summaries (an integral "global importance" term
added to DIFF V1's differential map, with a *unified parameter* that makes every row of the
final map sum to 1) and from the one public implementation found (a non-causal tabular model:
``A1 − λ A2 + λ · mean_over_rows(A1)``). Equation numbers below are this file's own:

* (D1) ``[Q1; Q2] = X W_Q``, ``[K1; K2] = X W_K``, ``V = X W_V``           (DIFF V1 Eq.1)
* (D2) ``A1 = softmax(Q1 K1^T / sqrt(d) + mask)``, ``A2 = softmax(Q2 K2^T / sqrt(d) + mask)``
* (D3) ``λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init``                   (DIFF V1 Eq.2)
* (D4) integral / global-importance term: row i of ``G`` is the mean of the rows of A1 over a
  set of query rows ``R(i)``: ``G[i, :] = (1/|R(i)|) Σ_{m ∈ R(i)} A1[m, :]`` — a column mean
  of the attention map, i.e. how much attention each key receives on average. Without a mask
  ``R(i)`` is every row and G is one vector repeated N times (the form of the one public,
  non-causal implementation, by a third party; the paper's own form could not be read).
* (D5) ``DINT(X) = (A1 − λ A2 + γ G) V`` with the unified parameter ``γ = λ``.
* (D6) row normalisation: rows of A1, A2 and G each sum to 1, so rows of
  ``A1 − λ A2 + γ G`` sum to ``1 − λ + γ``, which is 1 exactly when ``γ = λ``, whatever λ.
* (D7) multi-head: ``head_j ← (1 − λ_init) · RMSNorm_2d(head_j)``, ``Concat(head_j) W_O``
  (DIFF V1 Eq.3, kept unchanged).

Layout, parameter names and λ_init are DIFF V1's (see ``reference_lm.diff_v1_attention``):
query half-heads (2j, 2j+1) form differential head j, key half-heads (2g, 2g+1) form KV group
g = j // (H / H_kv), V has ``n_kv_heads / 2`` heads of width 2d. DINT adds no parameter, so
its parameter count equals DIFF V1's (the baseline's plus 4d λ entries and, with a learnable
head norm, 2d norm weights per layer).

Options (``options`` dict; what the sources read do not settle, the causal case above all):

* ``integral_rows``: which query rows the column mean of (D4) runs over.
    - ``"visible"`` (default): ``R(i) = {m : query i may attend key m}`` — under the causal
      mask the rows ``m ≤ i`` (a running mean over the prefix), under padding the real rows
      before i plus i itself. It is the only choice that is causal *and* keeps (D6): every
      row m ∈ R(i) attends only keys that i may attend (the mask is transitive; checked), so
      G[i] is a distribution over i's own keys. With a full (bidirectional) mask it equals
      the plain column mean of the public code.
    - ``"all"``: every row, the unmasked formula of the public non-causal code. With a causal
      mask this lets query i see keys after i (through later rows of A1): not usable for a
      decoder LM, kept for encoders and for reference.
* ``integral_map``: which softmax map is averaged. ``"first"`` (default; the public code
  averages A1, the "signal" map), ``"second"`` (A2), ``"both"`` ((A1 + A2) / 2). Any choice
  keeps (D6), since rows of each sum to 1.
* ``gamma``: the integral coefficient. ``"lambda"`` (default: γ = λ, the unified parameter
  that gives (D6)), or a fixed float. ``gamma=0.0`` turns DINT back into DIFF V1 exactly.

Everything runs in the dtype of the parameters; run it in fp64 for a tight reference.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from oracle.reference_lm import (
    Params,
    Rotary,
    attention_map,
    diff_v1_lambda,
    head_slice,
    linear,
    rms_norm,
    rope,
)

DEFAULT_OPTIONS: dict[str, Any] = {
    "integral_rows": "visible",
    "integral_map": "first",
    "gamma": "lambda",
}
"""The options the sources read do not settle, with the defaults chosen (module docstring)."""


def resolve_options(options: dict | None) -> dict[str, Any]:
    """``options`` over :data:`DEFAULT_OPTIONS`; unknown keys and values are errors."""
    given = dict(options or {})
    unknown = sorted(set(given) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(f"unknown DINT options {unknown}; known: {sorted(DEFAULT_OPTIONS)}")
    out = {**DEFAULT_OPTIONS, **given}
    if out["integral_rows"] not in ("visible", "all"):
        raise ValueError(f"integral_rows must be 'visible' or 'all', got {out['integral_rows']!r}")
    if out["integral_map"] not in ("first", "second", "both"):
        raise ValueError(
            f"integral_map must be 'first', 'second' or 'both', got {out['integral_map']!r}"
        )
    gamma = out["gamma"]
    if gamma != "lambda" and (isinstance(gamma, bool) or not isinstance(gamma, int | float)):
        raise ValueError(f"gamma must be 'lambda' or a number, got {gamma!r}")
    return out


def dint_parameter_shapes(config, options: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Shapes of one DINT attention layer's parameters, named relative to its prefix.

    The same names and shapes as DIFF V1: DINT's integral term has no parameter of its own.
    """
    resolve_options(options)
    d, dm = config.dim_per_head, config.d_model
    h, h_kv = config.n_heads, config.num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {
        "q_proj.weight": (h * d, dm),  # query half-heads of width d
        "k_proj.weight": (h_kv * d, dm),  # key half-heads of width d
        "v_proj.weight": (h_kv * d, dm),  # h_kv / 2 value heads of width 2d
        "o_proj.weight": (dm, h * d),
        "lambda_q1": (d,),
        "lambda_k1": (d,),
        "lambda_q2": (d,),
        "lambda_k2": (d,),
    }
    if config.head_norm and config.head_norm_learnable:
        shapes["head_norm.weight"] = (2 * d,)
    return shapes


def visible_rows(allowed: Tensor, i: int) -> Tensor:
    """Indices of the query rows ``m`` that query ``i`` may see (``allowed[i, m]``).

    Checks that each such row attends only keys that ``i`` may attend, so that averaging those
    rows of a map gives ``i`` nothing it could not see itself.
    """
    rows = torch.nonzero(allowed[i]).flatten()
    if rows.numel() == 0:
        raise ValueError(f"query {i} may see no position, the integral term is undefined")
    for m in rows.tolist():
        if bool((allowed[m] & ~allowed[i]).any()):
            raise ValueError(
                f"mask is not transitive: row {m}, visible to query {i}, attends keys that {i} "
                "may not; the integral term would leak them"
            )
    return rows


def integral_term(source: Tensor, allowed: Tensor, rows_option: str) -> Tensor:
    """(D4): ``G[i] = mean over m ∈ R(i) of source[m]``, one explicit loop over query rows i."""
    n = source.shape[0]
    out = []
    for i in range(n):
        rows = visible_rows(allowed, i) if rows_option == "visible" else torch.arange(n)
        out.append(source[rows].mean(dim=0))
    return torch.stack(out)


class DintHead(NamedTuple):
    """The three maps of one differential head j (each ``(N, N)``) and its value head."""

    a1: Tensor  # softmax(Q1 K1^T / sqrt(d) + mask)
    a2: Tensor  # softmax(Q2 K2^T / sqrt(d) + mask)
    g: Tensor  # the integral term (D4)
    v: Tensor  # value head of width 2d, (N, 2d)


def dint_heads(
    config, options: dict | None, params: Params, prefix: str, x: Tensor, rot: Rotary, allowed
) -> list[DintHead]:
    """(D1), (D2) and (D4) for every differential head j, with DIFF V1's layout."""
    opts = resolve_options(options)
    if config.n_heads % 2 or config.num_kv_heads % 2:
        raise ValueError("DINT pairs query and key half-heads: n_heads, n_kv_heads must be even")
    d = config.dim_per_head
    n_diff, n_groups = config.n_heads // 2, config.num_kv_heads // 2
    per_group = n_diff // n_groups
    wq, wk, wv = (params[f"{prefix}.{name}_proj.weight"] for name in ("q", "k", "v"))
    ks = [rope(linear(x, head_slice(wk, m, d)), rot) for m in range(2 * n_groups)]
    vs = [linear(x, head_slice(wv, g, 2 * d)) for g in range(n_groups)]
    heads = []
    for j in range(n_diff):
        g = j // per_group
        q1 = rope(linear(x, head_slice(wq, 2 * j, d)), rot)
        q2 = rope(linear(x, head_slice(wq, 2 * j + 1, d)), rot)
        a1 = attention_map(q1, ks[2 * g], allowed)
        a2 = attention_map(q2, ks[2 * g + 1], allowed)
        source = {"first": a1, "second": a2, "both": (a1 + a2) / 2}[opts["integral_map"]]
        heads.append(DintHead(a1, a2, integral_term(source, allowed, opts["integral_rows"]), vs[g]))
    return heads


def dint_coefficients(
    config, options: dict | None, params: Params, prefix: str, layer_index: int
) -> tuple[Tensor, Tensor | float]:
    """``(λ, γ)``: λ of (D3), γ = λ itself (the same tensor) or the fixed ``gamma`` option."""
    opts = resolve_options(options)
    lam = diff_v1_lambda(config, params, prefix, layer_index)
    gamma = lam if opts["gamma"] == "lambda" else float(opts["gamma"])
    return lam, gamma


def dint_map(
    config,
    options: dict | None,
    params: Params,
    prefix: str,
    layer_index: int,
    x: Tensor,
    rot: Rotary,
    allowed: Tensor,
) -> Tensor:
    """The final map ``A1 − λ A2 + γ G`` of (D5) for every differential head: ``(H, N, N)``."""
    lam, gamma = dint_coefficients(config, options, params, prefix, layer_index)
    heads = dint_heads(config, options, params, prefix, x, rot, allowed)
    return torch.stack([h.a1 - lam * h.a2 + gamma * h.g for h in heads])


def dint_attention(
    config,
    options: dict | None,
    params: Params,
    prefix: str,
    layer_index: int,
    x: Tensor,
    rot: Rotary,
    allowed: Tensor,
) -> Tensor:
    """Multi-head DINT attention of one sequence ``x`` ``(N, D)``, already RMS-normed.

    Per differential head j, (D5) as ``A1 V − λ (A2 V) + γ (G V)`` (the first two terms
    computed exactly as ``diff_v1_attention`` does, so ``gamma=0.0`` reproduces it bit for
    bit), then (D7): ``(1 − λ_init)·RMSNorm_2d`` if the config has the head norm, and
    ``Concat(head_j) W_O``. Returns ``(N, D)``.
    """
    lam, gamma = dint_coefficients(config, options, params, prefix, layer_index)
    lambda_init = config.lambda_init_for_layer(layer_index)
    learnable = config.head_norm and config.head_norm_learnable
    norm_weight = params[f"{prefix}.head_norm.weight"] if learnable else None
    outs = []
    for h in dint_heads(config, options, params, prefix, x, rot, allowed):
        head = h.a1 @ h.v - lam * (h.a2 @ h.v) + gamma * (h.g @ h.v)  # (D5)
        if config.head_norm:  # (D7)
            head = (1.0 - lambda_init) * rms_norm(head, norm_weight, config.head_norm_eps)
        outs.append(head)
    return linear(torch.cat(outs, dim=-1), params[f"{prefix}.o_proj.weight"])
