"""Slow, obviously-correct reference for gated differential attention (M-DGSA).

Source: "Differential Gated Self-Attention" (Lygizou, Farsang & Grosu, arXiv 2505.24054,
v1/v2, 2025), which proposes *Multihead Differential Gated Self-Attention* (M-DGSA). What the
paper pins down (abstract and introduction; the method section's equations were not
available to us, see ``/tmp/specs/gated_diff.md`` when present):

* every head splits into an *excitatory* and an *inhibitory* branch, each with its own
  softmax attention map (DIFF V1's two maps A1, A2);
* the two maps are fused by a *sigmoid gate* that is *predicted from the token embedding*,
  *per head* and input dependent: it takes the place of DIFF V1's learned scalar λ, which is
  one number per layer shared by all tokens and heads.

Equations as implemented here (numbers are ours, G1-G5), for one sequence ``x`` of shape
``(N, D)`` (already RMS-normed by the block), differential head ``j < H = n_heads / 2`` in KV
group ``g = j // (H / H_kv)``, ``H_kv = n_kv_heads / 2``, head width d:

* G1 (branch maps, DIFF V1 Eq.1): ``A⁺_j = softmax(Q1_j K1_gᵀ / sqrt(d) + mask)`` (excitatory),
  ``A⁻_j = softmax(Q2_j K2_gᵀ / sqrt(d) + mask)`` (inhibitory), RoPE on Q and K.
* G2 (gate): ``g[t, j] = sigmoid(x_t · w_j + b_j)``, one value per token t and head j, from the
  token's own hidden state only; ``w_j`` is row j of ``gate_proj.weight`` (H, D), ``b_j`` entry
  j of ``gate_proj.bias`` (H,).
* G3 (fusion, row t of head j's map; the gate of the *query* token scales its whole row):
  ``"subtract"`` (default): ``A_j[t] = A⁺_j[t] − g[t, j] · A⁻_j[t]`` (the gate in λ's place);
  ``"convex"``: ``A_j[t] = g[t, j] · A⁺_j[t] − (1 − g[t, j]) · A⁻_j[t]``.
* G4 (head output and norm, DIFF V1 Eq.3): ``head_j = A_j V_g`` with V_g of width 2d, then
  ``head_j ← s · RMSNorm_2d(head_j)`` (weight ``head_norm.weight`` shared by all heads when
  learnable; the whole step skipped when ``config.head_norm`` is off), ``s = 1 − λ_init(l)``
  (``output_scale="lambda_init"``) or 1 (``"none"``).
* G5 (output): ``Concat(head_1 .. head_H) W_O``.

Layout and names are DIFF V1's (``diff_v1_attention`` in :mod:`oracle.reference_lm`):
query half-heads (2j, 2j+1) of ``q_proj``, key half-heads (2g, 2g+1) of ``k_proj``, ``v_proj``
with ``H_kv`` heads of width 2d, ``o_proj``, ``head_norm.weight``; the λ vectors are gone and
``gate_proj.weight`` / ``gate_proj.bias`` are new. Head-norm switches come from the config's
DIFF V1 fields (``head_norm``, ``head_norm_learnable``, ``head_norm_eps``), λ_init from
``config.lambda_init_for_layer``.

``options`` (the type's own; each one a detail the sources read do not settle: the abstract
names a sigmoid gate per head from the token's input and nothing finer; defaults in
:data:`DEFAULT_OPTIONS`):

* ``fusion``: ``"subtract"`` | ``"convex"`` (G3). With the per-head RMSNorm on, ``"convex"``
  equals ``"subtract"`` with an effective ``λ = (1 − g) / g`` in (0, ∞) up to the norm's eps,
  since the row factor g cancels in the norm; ``"subtract"`` bounds λ to (0, 1).
* ``gate_bias``: ``True`` | ``False``: whether ``gate_proj.bias`` (H,) exists.
* ``gate_bias_init``: ``"lambda_init"`` | ``"zero"``: the bias's initial value (only used by
  :func:`gated_diff_gate_bias_init`; the forward reads the given parameters).
  ``"lambda_init"``: the effective λ at a zero gate input equals DIFF V1's ``λ_init(l)``
  (``g = λ_init`` for ``subtract``, ``g = 1 / (1 + λ_init)`` for ``convex``); ``"zero"``:
  ``g = 1/2``.
* ``output_scale``: ``"lambda_init"`` | ``"none"`` (G4).

Everything runs in the dtype of the parameters; run it in fp64 for a tight reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .reference_lm import (
    Params,
    Rotary,
    attention_map,
    head_slice,
    linear,
    rms_norm,
    rope,
)

DEFAULT_OPTIONS: dict[str, Any] = {
    "fusion": "subtract",
    "gate_bias": True,
    "gate_bias_init": "lambda_init",
    "output_scale": "lambda_init",
}

_CHOICES: dict[str, tuple[Any, ...]] = {
    "fusion": ("subtract", "convex"),
    "gate_bias": (True, False),
    "gate_bias_init": ("lambda_init", "zero"),
    "output_scale": ("lambda_init", "none"),
}


def resolve_options(options: dict | None) -> dict[str, Any]:
    """``options`` over :data:`DEFAULT_OPTIONS`; an unknown key or value raises ValueError."""
    merged = {**DEFAULT_OPTIONS, **(options or {})}
    for key, value in merged.items():
        if key not in _CHOICES:
            raise ValueError(f"gated_diff: unknown option {key!r}; valid: {sorted(_CHOICES)}")
        if not any(value is c or (type(value) is type(c) and value == c) for c in _CHOICES[key]):
            raise ValueError(f"gated_diff: option {key}={value!r}; choose one of {_CHOICES[key]}")
    return merged


def _sizes(config) -> tuple[int, int, int]:
    """(d, H, H_kv): head width, differential heads, KV groups (DIFF V1's pairing)."""
    d = config.dim_per_head
    n_heads, n_kv = config.n_heads, config.num_kv_heads
    if n_heads % 2 or n_kv % 2 or (n_heads // 2) % (n_kv // 2):
        raise ValueError(f"gated_diff pairs heads: n_heads={n_heads}, n_kv_heads={n_kv}")
    return d, n_heads // 2, n_kv // 2


def gated_diff_parameter_shapes(config, options: dict | None = None) -> dict[str, tuple]:
    """Shapes of one layer's attention parameters, names relative to the attention prefix.

    ``q_proj.weight`` (n_heads·d, D), ``k_proj.weight`` and ``v_proj.weight`` (n_kv_heads·d, D)
    (V read as n_kv_heads/2 heads of width 2d), ``o_proj.weight`` (D, n_heads·d): the matched
    baseline's. ``head_norm.weight`` (2d,) when the head norm is on and learnable.
    ``gate_proj.weight`` (H, D) and, with ``gate_bias``, ``gate_proj.bias`` (H,), H = n_heads/2.
    """
    opts = resolve_options(options)
    d, n_diff, _ = _sizes(config)
    dm = config.d_model
    shapes: dict[str, tuple] = {
        "q_proj.weight": (config.n_heads * d, dm),
        "k_proj.weight": (config.num_kv_heads * d, dm),
        "v_proj.weight": (config.num_kv_heads * d, dm),
        "o_proj.weight": (dm, config.n_heads * d),
    }
    if config.head_norm and config.head_norm_learnable:
        shapes["head_norm.weight"] = (2 * d,)
    shapes["gate_proj.weight"] = (n_diff, dm)
    if opts["gate_bias"]:
        shapes["gate_proj.bias"] = (n_diff,)
    return shapes


def gated_diff_gate_bias_init(config, options: dict | None, layer_index: int) -> float:
    """Initial value of every entry of ``gate_proj.bias`` (see ``gate_bias_init``)."""
    opts = resolve_options(options)
    if opts["gate_bias_init"] == "zero":
        return 0.0
    lam = config.lambda_init_for_layer(layer_index)
    g0 = lam if opts["fusion"] == "subtract" else 1.0 / (1.0 + lam)
    return math.log(g0 / (1.0 - g0))


def gated_diff_gate(config, options: dict | None, params: Params, prefix: str, x: Tensor) -> Tensor:
    """G2: ``g[t, j] = sigmoid(x_t · w_j + b_j)``, shape ``(N, H)``, one entry per token and
    differential head, each from that token's ``x_t`` alone."""
    opts = resolve_options(options)
    _, n_diff, _ = _sizes(config)
    weight = params[f"{prefix}.gate_proj.weight"]
    bias = params[f"{prefix}.gate_proj.bias"] if opts["gate_bias"] else None
    columns = []
    for j in range(n_diff):
        logit = x @ weight[j]  # (N,)
        if bias is not None:
            logit = logit + bias[j]
        columns.append(torch.sigmoid(logit))
    return torch.stack(columns, dim=-1)


def gated_diff_attention(
    config,
    options: dict | None,
    params: Params,
    prefix: str,
    layer_index: int,
    x: Tensor,
    rot: Rotary,
    allowed: Tensor,
) -> Tensor:
    """G1-G5 for one sequence ``x`` ``(N, D)``; returns ``(N, D)`` after W_O. Same contract as
    ``diff_v1_attention`` (``rot`` and ``allowed`` from ``rotary_table`` / ``allowed_keys``)."""
    opts = resolve_options(options)
    d, n_diff, n_groups = _sizes(config)
    per_group = n_diff // n_groups
    wq, wk, wv = (params[f"{prefix}.{name}_proj.weight"] for name in ("q", "k", "v"))
    lambda_init = config.lambda_init_for_layer(layer_index)
    scale = 1.0 - lambda_init if opts["output_scale"] == "lambda_init" else 1.0
    learnable = config.head_norm and config.head_norm_learnable
    norm_weight = params[f"{prefix}.head_norm.weight"] if learnable else None
    gate = gated_diff_gate(config, opts, params, prefix, x)  # (N, H)
    ks = [rope(linear(x, head_slice(wk, m, d)), rot) for m in range(2 * n_groups)]
    vs = [linear(x, head_slice(wv, g, 2 * d)) for g in range(n_groups)]
    heads = []
    for j in range(n_diff):
        g = j // per_group
        q_exc = rope(linear(x, head_slice(wq, 2 * j, d)), rot)
        q_inh = rope(linear(x, head_slice(wq, 2 * j + 1, d)), rot)
        a_exc = attention_map(q_exc, ks[2 * g], allowed)  # G1, excitatory
        a_inh = attention_map(q_inh, ks[2 * g + 1], allowed)  # G1, inhibitory
        g_j = gate[:, j : j + 1]  # (N, 1): row t scaled by the query token's gate
        if opts["fusion"] == "subtract":  # G3
            fused = a_exc - g_j * a_inh
        else:
            fused = g_j * a_exc - (1.0 - g_j) * a_inh
        head = fused @ vs[g]  # G4
        if config.head_norm:
            head = scale * rms_norm(head, norm_weight, config.head_norm_eps)
        heads.append(head)
    return linear(torch.cat(heads, dim=-1), params[f"{prefix}.o_proj.weight"])  # G5
