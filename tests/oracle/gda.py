"""Slow, obviously-correct reference for Grouped Differential Attention (GDA).

Source: "Grouped Differential Attention" (Lim et al., Motif Technologies, arXiv 2510.06949,
v1, 2025). What we could read of it (abstract, summaries; the method section's equations were
not available to us, see ``/tmp/specs/gda.md`` when present) fixes the idea:

* DIFF V1's heads are split *unevenly* into a *signal-preserving* group (the first softmax map of
  each differential head) and a smaller *noise-control* group (the subtracted map);
* each noise head is *shared* by ``ratio`` signal heads, "controlled repetition, akin to GQA";
* *group-differentiated growth* enlarges a trained model by replicating only the signal heads.

The equations, the projection layout and the λ / norm treatment below follow the public code of
the same group (vLLM's ``GroupedDifferentialAttentionImpl``, which cites 2510.06949, and the
Motif-2-12.7B model that uses GDA): the DIFF V1 computation with the noise map repeated over
the signal heads of its group. Equation numbers are ours (D1-D5):

For one sequence ``x`` ``(N, D)`` (already RMS-normed by the block), head width d, ``r = ratio``,
``H_n`` noise heads, ``H_s = r · H_n`` signal heads, ``G = n_kv_heads / 2`` KV groups:

* D1 (maps): signal head i: ``A1_i = softmax(Q1_i K1_gᵀ / sqrt(d) + mask)``; noise head j:
  ``A2_j = softmax(Q2_j K2_gᵀ / sqrt(d) + mask)``; RoPE on Q and K.
* D2 (grouping): signal head i reads noise head ``j = i // r`` (the noise map is repeated r
  times, ``repeat_interleave``); both read KV group ``g = j // (H_n / G)``, so signal head i is
  in the same KV group as its noise head (this is also what flash-attn's GQA mapping
  ``i // (H_s / G)`` gives, since ``H_s / G = r · H_n / G``).
* D3 (λ, DIFF V1 Eq.2): ``λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init(l)``, one scalar per
  layer, shared by all heads and groups.
* D4 (difference and norm, DIFF V1 Eq.1 and 3): ``head_i = A1_i V_g − λ · (A2_j V_g)`` with V_g
  of width 2d, then ``head_i ← (1 − λ_init) · RMSNorm_2d(head_i)`` (weight ``head_norm.weight``
  shared by all heads when learnable; the whole step skipped when ``config.head_norm`` is off).
* D5 (output): ``Concat(head_0 .. head_{H_s−1}) W_O``: only the signal heads have outputs,
  so W_O reads ``H_s · 2d`` channels.

Parameters (names relative to ``prefix``; ``Q = H_s + H_n`` query heads of width d):

* ``q_proj.weight`` ``(Q·d, D)``: row block b (rows ``[b·d, (b+1)·d)``) with
  ``b = (r+1)·j + t``: ``t < r`` is signal head ``i = r·j + t``, ``t = r`` is noise head j.
  So the query heads come in groups of ``r + 1``, ``r`` signal heads then their noise head
  (vLLM's "stripe" layout ``[Q1 … Q1, Q2]`` per group). With ``r = 1`` this is DIFF V1's
  ``(Q1, Q2) = (2j, 2j+1)``.
* ``k_proj.weight`` ``(n_kv_heads·d, D)``: DIFF V1's key half-heads, ``K1_g`` = block 2g,
  ``K2_g`` = block 2g+1.
* ``v_proj.weight`` ``(n_kv_heads·d, D)``: G value heads of width 2d, head g = rows
  ``[2g·d, (2g+2)·d)``.
* ``o_proj.weight`` ``(D, H_s·2d)``: columns ``[2d·i, 2d·(i+1))`` read signal head i.
* ``lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` ``(d,)``; ``head_norm.weight``
  ``(2d,)`` when ``config.head_norm and config.head_norm_learnable``.

With ``ratio = 1`` (and the default head counts) every name, shape, layout and operation is
DIFF V1's, and :func:`gda_attention` equals ``diff_v1_attention`` exactly.

``options`` (the type's own; defaults in :data:`DEFAULT_OPTIONS`):

* ``ratio`` (int ≥ 1, default 3): signal heads per noise head. The paper finds moderate
  imbalance best and names 3:1 and 4:1; 3 divides the usual power-of-two head counts into
  ``(r + 1)`` groups (4 | 8, 16, 32), 4 does not (Motif-2-12.7B uses 4 with 40 query heads).
* ``head_budget`` (``"queries"`` default | ``"outputs"``): how H_n follows from the config when
  ``n_noise_heads`` is not given. ``"queries"``: the config's ``n_heads`` is the number of
  query heads, ``H_s + H_n = n_heads``, so ``H_n = n_heads / (r + 1)`` (vLLM's and Motif's
  convention, ``num_attention_heads = signal + noise``): W_Q, W_K, W_V and the number of
  softmax maps are the baseline's, W_O grows to ``H_s · 2d`` columns. ``"outputs"``: W_O keeps
  the baseline's ``n_heads · d`` columns, ``H_s = n_heads / 2``, ``H_n = H_s / r``: fewer
  query heads. The paper speaks of a fixed compute budget and "minimal computational overhead"
  (which fits ``"queries"``: same maps, larger W_O); how it sized its models is not available
  to us. Both give DIFF V1 at ``r = 1``.
* ``n_noise_heads`` (int or None, default None): H_n given outright (Motif's
  ``num_noise_heads``); ``head_budget`` is then not read. :func:`grow_signal_heads` returns
  options with it set, since growth changes ``H_s`` but not the config.

Everything runs in the dtype of the parameters; run it in fp64 for a tight reference.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .reference_lm import (
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
    "ratio": 3,
    "head_budget": "queries",
    "n_noise_heads": None,
}
HEAD_BUDGETS = ("queries", "outputs")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def gda_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` over :data:`DEFAULT_OPTIONS`; an unknown key or a bad value raises
    ``ValueError`` naming it."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(f"gda: unknown option(s) {unknown}; valid: {sorted(DEFAULT_OPTIONS)}")
    merged = {**DEFAULT_OPTIONS, **options}
    if not _positive_int(merged["ratio"]):
        raise ValueError(f"gda: ratio must be an integer >= 1, got {merged['ratio']!r}")
    if merged["head_budget"] not in HEAD_BUDGETS:
        raise ValueError(f"gda: head_budget must be one of {HEAD_BUDGETS}")
    if merged["n_noise_heads"] is not None and not _positive_int(merged["n_noise_heads"]):
        raise ValueError("gda: n_noise_heads must be a positive integer or None")
    return merged


class GDAHeads(NamedTuple):
    """Head counts of one GDA layer (see the module docstring)."""

    ratio: int  # r: signal heads per noise head
    n_signal: int  # H_s = r · H_n
    n_noise: int  # H_n
    n_groups: int  # G = n_kv_heads / 2 KV groups (K1, K2 pairs; V heads of width 2d)
    d: int  # head width

    @property
    def n_query(self) -> int:
        """Query heads of width d that are projected: ``H_s + H_n``."""
        return self.n_signal + self.n_noise

    def signal_block(self, i: int) -> int:
        """Row block of ``q_proj`` holding signal head i."""
        return (self.ratio + 1) * (i // self.ratio) + i % self.ratio

    def noise_block(self, j: int) -> int:
        """Row block of ``q_proj`` holding noise head j."""
        return (self.ratio + 1) * j + self.ratio

    def noise_of(self, i: int) -> int:
        """D2: the noise head shared by signal head i."""
        return i // self.ratio

    def group_of_noise(self, j: int) -> int:
        """D2: the KV group of noise head j (and of its signal heads)."""
        return j // (self.n_noise // self.n_groups)


def gda_heads(config, options: dict[str, Any] | None) -> GDAHeads:
    """Head counts for ``config`` (its ``n_heads``, ``num_kv_heads``, ``dim_per_head``) and the
    GDA ``options``; ``ValueError`` when they do not divide (module docstring, ``head_budget``)."""
    opts = gda_options(options)
    r, n_kv = opts["ratio"], config.num_kv_heads
    if n_kv % 2 != 0:
        raise ValueError(f"gda: pairs key heads (K1, K2) and needs an even n_kv_heads, got {n_kv}")
    if opts["n_noise_heads"] is not None:
        n_noise = opts["n_noise_heads"]
    elif opts["head_budget"] == "queries":
        if config.n_heads % (r + 1) != 0:
            raise ValueError(
                f"gda: head_budget='queries' splits n_heads={config.n_heads} into groups of "
                f"ratio + 1 = {r + 1}; it does not divide"
            )
        n_noise = config.n_heads // (r + 1)
    else:
        if config.n_heads % 2 != 0 or (config.n_heads // 2) % r != 0:
            raise ValueError(
                f"gda: head_budget='outputs' needs n_heads / 2 signal heads divisible by "
                f"ratio={r}, got n_heads={config.n_heads}"
            )
        n_noise = config.n_heads // 2 // r
    n_groups = n_kv // 2
    if n_noise % n_groups != 0:
        raise ValueError(
            f"gda: the {n_noise} noise heads must split evenly over the {n_groups} KV groups "
            f"(n_kv_heads={n_kv})"
        )
    return GDAHeads(r, r * n_noise, n_noise, n_groups, config.dim_per_head)


def gda_parameter_shapes(config, options: dict[str, Any] | None) -> dict[str, tuple[int, ...]]:
    """Shape of every attention parameter, by name relative to the layer's prefix."""
    h = gda_heads(config, options)
    d, dm = h.d, config.d_model
    shapes: dict[str, tuple[int, ...]] = {
        "q_proj.weight": (h.n_query * d, dm),
        "k_proj.weight": (2 * h.n_groups * d, dm),
        "v_proj.weight": (2 * h.n_groups * d, dm),
        "o_proj.weight": (dm, h.n_signal * 2 * d),
        "lambda_q1": (d,),
        "lambda_k1": (d,),
        "lambda_q2": (d,),
        "lambda_k2": (d,),
    }
    if config.head_norm and config.head_norm_learnable:
        shapes["head_norm.weight"] = (2 * d,)
    return shapes


def _count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def gda_parameter_budget(config, options: dict[str, Any] | None) -> dict[str, int]:
    """How a GDA layer compares with the baseline (= DIFF V1) it is matched to.

    The baseline's attention (and DIFF V1's, which equals it up to the 4d λ and 2d norm
    parameters) has ``D·d·(n_heads + 2·n_kv_heads)`` in W_Q, W_K, W_V and ``D·n_heads·d`` in
    W_O. GDA keeps W_K, W_V, λ and the norm and changes W_Q to ``(H_s + H_n)·d`` rows and W_O
    to ``H_s·2d`` columns, so per layer it has ``D·d·(H_s + H_n + 2·H_s − 2·n_heads)`` more
    parameters than DIFF V1:

    * ``head_budget="queries"`` (``H_s + H_n = n_heads``): ``D·d·n_heads·(r − 1)/(r + 1)`` more,
      all in W_O; the softmax maps (``n_heads`` of them) and W_Q/W_K/W_V are unchanged;
    * ``head_budget="outputs"`` (``H_s = n_heads / 2``): ``D·d·(n_heads/2)·(1 − 1/r)`` fewer,
      all in W_Q; W_O is unchanged, and fewer maps are computed.

    Returns the head counts, ``attention`` (this layer's attention parameters),
    ``diff_v1`` (DIFF V1's with the same config), ``extra`` (their difference, per layer) and
    ``matched_ffn_hidden`` (the SwiGLU width, to the unit, that gives the difference back:
    one hidden unit costs ``3·d_model``; rounded to nearest, ties wider), the rule
    ``presets.match_v2_params`` uses for DIFF V2. The paper states a fixed compute budget;
    whether and how it moved parameters between attention and FFN is not available to us.
    """
    h = gda_heads(config, options)
    ours = _count(gda_parameter_shapes(config, options))
    d, dm = h.d, config.d_model
    norm = 2 * d if config.head_norm and config.head_norm_learnable else 0
    diff = dm * d * (config.n_heads + 2 * config.num_kv_heads) + dm * config.n_heads * d
    diff += 4 * d + norm  # DIFF V1: the baseline's projections, λ vectors, head norm
    extra = ours - diff
    hidden = config.ffn_dim - extra / (3 * config.d_model)
    return {
        "n_signal": h.n_signal,
        "n_noise": h.n_noise,
        "n_query": h.n_query,
        "n_groups": h.n_groups,
        "attention": ours,
        "diff_v1": diff,
        "extra": extra,
        "matched_ffn_hidden": math.floor(hidden + 0.5),
    }


def _check_shapes(config, options, params: Params, prefix: str) -> None:
    for name, shape in gda_parameter_shapes(config, options).items():
        got = tuple(params[f"{prefix}.{name}"].shape)
        if got != shape:
            raise ValueError(f"gda: {prefix}.{name} has shape {got}, expected {shape}")


def gda_attention(
    config,
    options: dict[str, Any] | None,
    params: Params,
    prefix: str,
    layer_index: int,
    x: Tensor,
    rot: Rotary,
    allowed: Tensor,
) -> Tensor:
    """GDA, D1-D5 of the module docstring, for one sequence ``x`` ``(N, D)``; returns ``(N, D)``.

    Same contract as ``diff_v1_attention`` (``rot`` from ``rotary_table``, ``allowed`` from
    ``allowed_keys``); ``config`` supplies d, the head counts, λ_init and the head-norm switches.
    """
    h = gda_heads(config, options)
    _check_shapes(config, options, params, prefix)
    d = h.d
    wq, wk, wv = (params[f"{prefix}.{name}_proj.weight"] for name in ("q", "k", "v"))
    lam = diff_v1_lambda(config, params, prefix, layer_index)  # D3
    lambda_init = config.lambda_init_for_layer(layer_index)
    learnable = config.head_norm and config.head_norm_learnable
    norm_weight = params[f"{prefix}.head_norm.weight"] if learnable else None
    # Key half-heads m (K1 of group g is 2g, K2 is 2g+1); V heads of width 2d.
    ks = [rope(linear(x, head_slice(wk, m, d)), rot) for m in range(2 * h.n_groups)]
    vs = [linear(x, head_slice(wv, g, 2 * d)) for g in range(h.n_groups)]
    noise = []  # A2_j V_g, computed once per noise head and shared by its signal heads (D2)
    for j in range(h.n_noise):
        g = h.group_of_noise(j)
        q2 = rope(linear(x, head_slice(wq, h.noise_block(j), d)), rot)
        noise.append(attention_map(q2, ks[2 * g + 1], allowed) @ vs[g])
    heads = []
    for i in range(h.n_signal):
        j = h.noise_of(i)
        g = h.group_of_noise(j)
        q1 = rope(linear(x, head_slice(wq, h.signal_block(i), d)), rot)
        a1 = attention_map(q1, ks[2 * g], allowed)
        head = a1 @ vs[g] - lam * noise[j]  # D4: A1 V − λ (A2 V)
        if config.head_norm:
            head = (1.0 - lambda_init) * rms_norm(head, norm_weight, config.head_norm_eps)
        heads.append(head)
    return linear(torch.cat(heads, dim=-1), params[f"{prefix}.o_proj.weight"])  # D5


def grow_signal_heads(
    config,
    options: dict[str, Any] | None,
    params: Params,
    prefix: str,
    factor: int,
    split_output: bool = True,
    symmetry_noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, Any], Params]:
    """Group-differentiated growth of one layer: replicate every signal head ``factor`` times,
    keep the noise heads (and K, V, λ, the head norm) as they are.

    Returns ``(new_options, new_params)``: ``new_options`` has ``ratio · factor`` and
    ``n_noise_heads`` set to the unchanged H_n (so the same ``config`` describes the grown
    layer); ``new_params`` holds this layer's grown tensors under the same names (other
    entries of ``params`` are not copied). The inputs are not modified.

    * ``q_proj``: new signal head ``i'`` is a copy of old signal head ``i'' = i' // factor``
      (each head's copies adjacent), in the group of the same noise head; the noise heads'
      rows are copied unchanged into the new ``(r·factor + 1)``-head groups.
    * ``o_proj``: each copy gets the old head's 2d columns divided by ``factor``
      (``split_output``, default), or a verbatim copy (``split_output=False``).

    The function at the moment of growth: every copy computes exactly the old head's output
    (same query rows, same KV group, same noise head, same λ and norm), and the copies enter
    W_O as a sum, so with ``split_output`` the grown layer computes the *same function* as
    before (as Net2Net / hypercloning widening does); without it, every head's contribution is
    counted ``factor`` times and the layer's output is exactly ``factor`` times the old one.

    ``symmetry_noise`` (default 0): std of a perturbation added to the copies' W_O columns with
    zero sum over the copies of each head, so the function is still the same; without it the
    copies receive identical gradients and never separate. The paper says growth replicates
    only the signal heads; whether it rescales W_O or perturbs the copies is not available to
    us, hence these two switches.
    """
    if not _positive_int(factor):
        raise ValueError(f"gda: factor must be an integer >= 1, got {factor!r}")
    h = gda_heads(config, options)
    _check_shapes(config, options, params, prefix)
    d = h.d
    new_options = {
        **gda_options(options),
        "ratio": h.ratio * factor,
        "n_noise_heads": h.n_noise,
    }
    new = gda_heads(config, new_options)
    wq = params[f"{prefix}.q_proj.weight"].detach()
    wo = params[f"{prefix}.o_proj.weight"].detach()
    q_blocks: list[Tensor] = [torch.empty(0)] * new.n_query
    o_blocks: list[Tensor] = [torch.empty(0)] * new.n_signal
    for j in range(h.n_noise):
        q_blocks[new.noise_block(j)] = head_slice(wq, h.noise_block(j), d)
    for i in range(h.n_signal):
        columns = wo[:, 2 * d * i : 2 * d * (i + 1)]
        scale = 1.0 / factor if split_output else 1.0
        if symmetry_noise > 0.0 and factor > 1:
            noise = torch.randn(
                (factor, *columns.shape), generator=generator, dtype=torch.float64
            ).to(columns)
            noise = symmetry_noise * (noise - noise.mean(dim=0, keepdim=True))
        else:
            noise = torch.zeros((factor, *columns.shape), dtype=columns.dtype)
        for c in range(factor):
            i_new = i * factor + c
            assert new.noise_of(i_new) == h.noise_of(i)
            q_blocks[new.signal_block(i_new)] = head_slice(wq, h.signal_block(i), d)
            o_blocks[i_new] = columns * scale + noise[c]
    new_params = {
        f"{prefix}.{name}": params[f"{prefix}.{name}"].detach().clone()
        for name in gda_parameter_shapes(config, options)
        if name not in ("q_proj.weight", "o_proj.weight")
    }
    new_params[f"{prefix}.q_proj.weight"] = torch.cat(q_blocks, dim=0).clone()
    new_params[f"{prefix}.o_proj.weight"] = torch.cat(o_blocks, dim=1).clone()
    _check_shapes(config, new_options, new_params, prefix)
    return new_options, new_params
