"""Slow, obviously-correct twin of ``diffattn.DiffTransformerLM``.

Written directly from the equations, with explicit Python loops over batch rows and heads and
one ``softmax(q @ k.T / sqrt(d) + mask)`` per head. It shares no code with ``diffattn``: it only
reads fields of the config and takes the model's parameters as a plain ``name -> tensor`` dict,
so the result is differentiable with respect to every tensor in that dict.

Sources:
    DIFF V1: "Differential Transformer" (Ye et al., ICLR 2025), Eq.1-5.
    DIFF V2: "Differential Transformer V2" (Ye et al., 2026 blog), section "Code".
    Baseline: the LLaMA block (pre-RMSNorm, SwiGLU, RoPE, grouped-query attention).

Everything runs in the dtype of the parameters; run it in fp64 for a tight reference.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

Params = dict[str, Tensor]


# --- building blocks ---------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm (Zhang & Sennrich, 2019), the LN(·) of V1 Eq.3-5.

    ``x / sqrt(mean(x², last dim) + eps) * weight``; no weight when ``weight`` is None.
    """
    y = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """Bias-free linear layer with a ``(out, in)`` weight: ``y = x @ W.T``."""
    return x @ weight.T


def swiglu(x: Tensor, params: Params, prefix: str) -> Tensor:
    """SwiGLU of V1 Eq.5: ``down(silu(gate(x)) * up(x))`` with ``silu(z) = z * sigmoid(z)``."""
    gate = linear(x, params[f"{prefix}.gate_proj.weight"])
    up = linear(x, params[f"{prefix}.up_proj.weight"])
    return linear(gate * torch.sigmoid(gate) * up, params[f"{prefix}.down_proj.weight"])


def token_positions(mask_row: Tensor | None, n: int) -> list[int]:
    """RoPE position of each token: ``t`` unmasked, else ``cumsum(mask) - 1`` clamped at 0."""
    if mask_row is None:
        return list(range(n))
    positions, seen = [], 0
    for t in range(n):
        seen += int(mask_row[t])
        positions.append(max(seen - 1, 0))
    return positions


class Rotary(NamedTuple):
    """cos/sin of the rotation angles ``(N, d/2)`` of one sequence, and the channel pairing."""

    cos: Tensor
    sin: Tensor
    style: str


def rotary_table(positions: list[int], d: int, theta: float, style: str) -> Rotary:
    """RoPE angles (Su et al., 2021): ``angle[t, i] = position[t] * theta^(-2i/d)``, ``i < d/2``.

    Computed in Python double precision.
    """
    if style not in ("half", "interleaved"):
        raise ValueError(f"unknown rope style {style!r}")
    angles = [[p * theta ** (-2.0 * i / d) for i in range(d // 2)] for p in positions]
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)
    return Rotary(cos, sin, style)


def rope(x: Tensor, rot: Rotary) -> Tensor:
    """Rotate one head ``x`` of shape ``(N, d)``: channel pair i of token t turns by
    ``angle[t, i]``, ``(a, b) -> (a cos - b sin, a sin + b cos)``.

    * ``"half"``: pair i is channels ``(i, i + d/2)``. This equals
      ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]`` and
      ``cos``/``sin`` of ``cat(angle, angle)``.
    * ``"interleaved"``: pair i is channels ``(2i, 2i+1)``.
    """
    n, d = x.shape
    cos, sin = rot.cos.to(x), rot.sin.to(x)
    if rot.style == "half":
        a, b = x[:, : d // 2], x[:, d // 2 :]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    a, b = x[:, 0::2], x[:, 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).reshape(n, d)


def allowed_keys(mask_row: Tensor | None, n: int, device: torch.device) -> Tensor:
    """Boolean ``(N, N)``: query i may attend key j iff ``j <= i`` and (j is real or j == i)."""
    real = [True] * n if mask_row is None else [int(m) == 1 for m in mask_row]
    rows = [[j <= i and (real[j] or j == i) for j in range(n)] for i in range(n)]
    return torch.tensor(rows, dtype=torch.bool, device=device)


def attention_map(q: Tensor, k: Tensor, allowed: Tensor) -> Tensor:
    """One softmax attention map ``softmax(q @ k.T / sqrt(d) + mask)`` for ``(N, d)`` q, k."""
    d = q.shape[-1]
    scores = q @ k.T / math.sqrt(d)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def head_slice(w_out: Tensor, index: int, width: int) -> Tensor:
    """Rows ``[index * width, (index + 1) * width)`` of a projection's ``(out, in)`` weight."""
    return w_out[index * width : (index + 1) * width]


# --- attention variants (one sequence x: (N, D), already RMS-normed) -----------------------


def baseline_attention(
    config, params: Params, prefix: str, x: Tensor, rot: Rotary, allowed: Tensor
) -> Tensor:
    """LLaMA grouped-query attention.

    ``head_i = softmax(Q_i K_g^T / sqrt(d) + mask) V_g`` with ``g = i // (n_heads/n_kv_heads)``,
    output ``Concat(head_1..head_n) W_O``.
    """
    d = config.dim_per_head
    n_heads, n_kv = config.n_heads, config.num_kv_heads
    group = n_heads // n_kv
    wq, wk, wv = (params[f"{prefix}.{name}_proj.weight"] for name in ("q", "k", "v"))
    ks = [rope(linear(x, head_slice(wk, g, d)), rot) for g in range(n_kv)]
    vs = [linear(x, head_slice(wv, g, d)) for g in range(n_kv)]
    heads = []
    for i in range(n_heads):
        g = i // group
        q = rope(linear(x, head_slice(wq, i, d)), rot)
        heads.append(attention_map(q, ks[g], allowed) @ vs[g])
    return linear(torch.cat(heads, dim=-1), params[f"{prefix}.o_proj.weight"])


def diff_v1_lambda(config, params: Params, prefix: str, layer_index: int) -> Tensor:
    """V1 Eq.2: ``λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init``, one scalar per layer."""
    lq1, lk1 = params[f"{prefix}.lambda_q1"], params[f"{prefix}.lambda_k1"]
    lq2, lk2 = params[f"{prefix}.lambda_q2"], params[f"{prefix}.lambda_k2"]
    lambda_init = config.lambda_init_for_layer(layer_index)
    return torch.exp(torch.sum(lq1 * lk1)) - torch.exp(torch.sum(lq2 * lk2)) + lambda_init


def diff_v1_attention(
    config,
    params: Params,
    prefix: str,
    layer_index: int,
    x: Tensor,
    rot: Rotary,
    allowed: Tensor,
    lambda_probe: Tensor | None = None,
) -> Tensor:
    """Multi-head differential attention, V1 Eq.1-3.

    Eq.1 per differential head j: ``(softmax(Q1 K1^T/sqrt(d)) − λ softmax(Q2 K2^T/sqrt(d))) V``
    with ``Q1, Q2`` = query half-heads ``2j, 2j+1``, and for KV group
    ``g = j // (H / H_kv)``: ``K1, K2`` = key half-heads ``2g, 2g+1`` and V = value head g of
    width 2d. Eq.3: ``head_j ← (1 − λ_init) · RMSNorm_2d(head_j)`` (weight shared by all heads,
    if learnable; skipped entirely when head_norm is off), output ``Concat(head_j) W_O``.

    ``lambda_probe`` (optional, ``(H, N, 2d)``, zeros) is added to λ entrywise in
    ``A1 V − λ (A2 V)``: the output does not change, and its gradient holds the individual
    terms whose sum is ``dL/dλ``.
    """
    d = config.dim_per_head
    n_diff, n_groups = config.n_heads // 2, config.num_kv_heads // 2
    per_group = n_diff // n_groups
    wq, wk, wv = (params[f"{prefix}.{name}_proj.weight"] for name in ("q", "k", "v"))
    lam = diff_v1_lambda(config, params, prefix, layer_index)
    lambda_init = config.lambda_init_for_layer(layer_index)
    learnable = config.head_norm and config.head_norm_learnable
    norm_weight = params[f"{prefix}.head_norm.weight"] if learnable else None
    # Key half-heads m = 0..n_kv_heads-1 (K1 of group g is 2g, K2 is 2g+1); V heads of width 2d.
    ks = [rope(linear(x, head_slice(wk, m, d)), rot) for m in range(2 * n_groups)]
    vs = [linear(x, head_slice(wv, g, 2 * d)) for g in range(n_groups)]
    heads = []
    for j in range(n_diff):
        g = j // per_group
        q1 = rope(linear(x, head_slice(wq, 2 * j, d)), rot)
        q2 = rope(linear(x, head_slice(wq, 2 * j + 1, d)), rot)
        a1 = attention_map(q1, ks[2 * g], allowed)
        a2 = attention_map(q2, ks[2 * g + 1], allowed)
        lam_j = lam if lambda_probe is None else lam + lambda_probe[j]
        head = a1 @ vs[g] - lam_j * (a2 @ vs[g])  # Eq.1: (A1 − λ A2) V
        if config.head_norm:  # Eq.3
            head = (1.0 - lambda_init) * rms_norm(head, norm_weight, config.head_norm_eps)
        heads.append(head)
    return linear(torch.cat(heads, dim=-1), params[f"{prefix}.o_proj.weight"])


def diff_v2_attention(
    config, params: Params, prefix: str, x: Tensor, rot: Rotary, allowed: Tensor
) -> Tensor:
    """DIFF V2 (blog, "Code"): ``out_i = o_a − λ_i o_b`` over 2·n_heads softmax query heads.

    ``o_m = softmax(q_m k_g^T / sqrt(d) + mask) v_g`` with ``g = m // (2 n_heads / n_kv_heads)``.
    Pairs are ``(a, b) = (2i, 2i+1)`` (paired heads) or ``(i, i + n_heads)`` (ablation).
    ``λ_i = sigmoid(x W_λ^T)_i`` per token (raw without the sigmoid ablation; 1 without λ).
    No per-head norm; output ``Concat(out_i) W_O``.
    """
    d = config.dim_per_head
    n_out, n_kv = config.n_heads, config.num_kv_heads
    n_query = 2 * n_out
    group = n_query // n_kv
    wq, wk, wv = (params[f"{prefix}.{name}_proj.weight"] for name in ("q", "k", "v"))
    ks = [rope(linear(x, head_slice(wk, g, d)), rot) for g in range(n_kv)]
    vs = [linear(x, head_slice(wv, g, d)) for g in range(n_kv)]
    o = []
    for m in range(n_query):
        g = m // group
        q = rope(linear(x, head_slice(wq, m, d)), rot)
        o.append(attention_map(q, ks[g], allowed) @ vs[g])
    if config.v2_use_lambda:
        lam = linear(x, params[f"{prefix}.lambda_proj.weight"])  # (N, n_heads)
        if config.v2_lambda_sigmoid:
            lam = torch.sigmoid(lam)
    else:
        lam = torch.ones(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    outs = []
    for i in range(n_out):
        a, b = (2 * i, 2 * i + 1) if config.v2_paired_heads else (i, i + n_out)
        outs.append(o[a] - lam[:, i : i + 1] * o[b])
    return linear(torch.cat(outs, dim=-1), params[f"{prefix}.o_proj.weight"])


# --- the language model ----------------------------------------------------------------------


def oracle_forward(
    config,
    params: Params,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    lambda_probes: dict[int, Tensor] | None = None,
) -> Tensor:
    """Logits ``(B, N, V)`` of the decoder-only LM, one batch row at a time.

    Per layer (V1 Eq.4-5): ``Y = X + Attn(RMSNorm(X))``, ``X' = Y + SwiGLU(RMSNorm(Y))``.
    Final: ``logits = RMSNorm(X_L) @ W_lm^T`` with ``W_lm`` the embedding when tied.

    ``lambda_probes`` (DIFF V1 only, optional): per layer a zero tensor ``(B, H, N, 2d)``, see
    :func:`diff_v1_attention`.
    """
    eps = config.norm_eps
    embed = params["embed_tokens.weight"]
    lm_head = embed if config.tie_embeddings else params["lm_head.weight"]
    batch, n = input_ids.shape
    rows = []
    for b in range(batch):
        mask_row = None if attention_mask is None else attention_mask[b]
        positions = token_positions(mask_row, n)
        rot = rotary_table(positions, config.dim_per_head, config.rope_theta, config.rope_style)
        allowed = allowed_keys(mask_row, n, embed.device)
        x = embed[input_ids[b]]  # (N, D)
        for layer in range(config.n_layers):
            p = f"layers.{layer}"
            h = rms_norm(x, params[f"{p}.attn_norm.weight"], eps)
            if config.attention == "baseline":
                attn = baseline_attention(config, params, f"{p}.attn", h, rot, allowed)
            elif config.attention == "diff_v1":
                probe = None if lambda_probes is None else lambda_probes[layer][b]
                attn = diff_v1_attention(config, params, f"{p}.attn", layer, h, rot, allowed, probe)
            elif config.attention == "diff_v2":
                attn = diff_v2_attention(config, params, f"{p}.attn", h, rot, allowed)
            else:
                raise ValueError(f"unknown attention {config.attention!r}")
            x = x + attn  # Eq.4
            x = x + swiglu(rms_norm(x, params[f"{p}.ffn_norm.weight"], eps), params, f"{p}.ffn")
        rows.append(linear(rms_norm(x, params["norm.weight"], eps), lm_head))
    return torch.stack(rows)
