"""The gated differential attention oracle (``tests/oracle/gated_diff.py``, M-DGSA, arXiv
2505.24054) against identities its equations imply, in fp64 at tiny sizes:

* the gate takes DIFF V1's λ's place: a constant gate c gives DIFF V1 with λ = c (``convex``
  fusion: λ = (1 − c)/c), and any gate gives DIFF V1 with λ moved per token and head to the
  gate's value (through ``diff_v1_attention``'s ``lambda_probe``);
* the gate is per token and per head: one token's x moves only that token's gates, heads
  differ, and head j's gate reads only row j of ``gate_proj``;
* lengths 1, 7 and 129, MHA and GQA, causal with a left-padded row: shapes, causality, pads
  invisible to real tokens, the closed form at length 1, gradients reaching every parameter.
"""

from __future__ import annotations

import math

import pytest
import torch

from diffattn import ModelConfig
from oracle.gated_diff import (
    DEFAULT_OPTIONS,
    gated_diff_attention,
    gated_diff_gate,
    gated_diff_gate_bias_init,
    gated_diff_parameter_shapes,
    resolve_options,
)
from oracle.reference_lm import (
    allowed_keys,
    diff_v1_attention,
    diff_v1_lambda,
    rms_norm,
    rotary_table,
    token_positions,
)

P = "attn"
LAYER = 2  # λ_init = 0.8 − 0.6·exp(−0.6) ≈ 0.4707
TIGHT = 1e-12
F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def make_config(n_kv_heads: int = 8, **changes) -> ModelConfig:
    """8 query half-heads of width 4 → H = 4 differential heads; n_kv_heads 8 (MHA), 4 or 2."""
    fields = dict(
        attention="diff_v1",  # gated diff uses DIFF V1's head pairing and its validation
        vocab_size=16,
        d_model=16,
        n_layers=3,
        n_heads=8,
        head_dim=4,
        n_kv_heads=n_kv_heads,
        max_seq_len=256,
        backend="reference",
    )
    return ModelConfig(**{**fields, **changes})


def make_params(config, options=None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp64 parameters of every shape, away from any init identity (norm weight ≠ 1)."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in gated_diff_parameter_shapes(config, options).items():
        value = torch.randn(shape, generator=gen, dtype=F64)
        if name == "head_norm.weight":
            value = 1.0 + 0.2 * value
        elif name.startswith(("q_proj", "k_proj")):
            value = 0.8 * value  # sharp enough maps that A⁺ and A⁻ differ clearly
        else:
            value = 0.5 * value
        params[f"{P}.{name}"] = value
    return params


def make_input(config, n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return rms_norm(torch.randn(n, config.d_model, generator=gen, dtype=F64), None, 1e-6)


def geometry(config, n: int, mask_row=None):
    positions = token_positions(mask_row, n)
    rot = rotary_table(positions, config.dim_per_head, config.rope_theta, config.rope_style)
    return rot, allowed_keys(mask_row, n, torch.device("cpu"))


def with_v1_lambda(config, params, lam: float) -> dict[str, torch.Tensor]:
    """``params`` plus DIFF V1 λ vectors giving exactly λ = exp(q1·k1) − exp(q2·k2) + λ_init
    = ``lam``: q2 = k2 = 0 and q1·k1 = log(lam − λ_init + 1)."""
    d = config.dim_per_head
    lambda_init = config.lambda_init_for_layer(LAYER)
    e0 = torch.zeros(d, dtype=F64)
    e0[0] = 1.0
    v1 = dict(params)
    v1[f"{P}.lambda_q1"] = e0
    v1[f"{P}.lambda_k1"] = e0 * math.log(lam - lambda_init + 1.0)
    v1[f"{P}.lambda_q2"] = torch.zeros(d, dtype=F64)
    v1[f"{P}.lambda_k2"] = torch.zeros(d, dtype=F64)
    assert abs(diff_v1_lambda(config, v1, P, LAYER).item() - lam) < 1e-14
    return v1


def constant_gate(params, c: float) -> dict[str, torch.Tensor]:
    """Gate projection zeroed and bias logit(c): g ≡ c for every token and head."""
    out = dict(params)
    out[f"{P}.gate_proj.weight"] = torch.zeros_like(params[f"{P}.gate_proj.weight"])
    out[f"{P}.gate_proj.bias"] = torch.full_like(
        params[f"{P}.gate_proj.bias"], math.log(c / (1 - c))
    )
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# --- (a) the gate's role: DIFF V1's λ, per token and head ------------------------------------


@pytest.mark.parametrize("n_kv", [8, 4])
@pytest.mark.parametrize("head_norm", [True, False])
def test_constant_gate_is_diff_v1_with_that_lambda(n_kv, head_norm):
    config = make_config(n_kv, head_norm=head_norm)
    c = 0.3  # ≠ λ_init, so λ_init's two roles (offset, output scale) are told apart
    params = constant_gate(make_params(config), c)
    x = make_input(config, 9)
    rot, allowed = geometry(config, 9)
    gated = gated_diff_attention(config, {}, params, P, LAYER, x, rot, allowed)
    v1 = diff_v1_attention(config, with_v1_lambda(config, params, c), P, LAYER, x, rot, allowed)
    assert rel(gated, v1) < TIGHT


@pytest.mark.parametrize("head_norm", [True, False])
def test_convex_constant_gate_is_scaled_diff_v1(head_norm):
    """``g A⁺ − (1 − g) A⁻ = g (A⁺ − λ A⁻)`` with λ = (1 − g)/g; the factor g survives without
    the head norm and cancels in it (eps made negligible)."""
    config = make_config(4, head_norm=head_norm, head_norm_eps=1e-30)
    c = 0.4
    params = constant_gate(make_params(config), c)
    x = make_input(config, 9)
    rot, allowed = geometry(config, 9)
    gated = gated_diff_attention(config, {"fusion": "convex"}, params, P, LAYER, x, rot, allowed)
    v1_params = with_v1_lambda(config, params, (1 - c) / c)
    v1 = diff_v1_attention(config, v1_params, P, LAYER, x, rot, allowed)
    assert rel(gated, v1 if head_norm else c * v1) < 1e-10


@pytest.mark.parametrize("n_kv", [8, 2])
def test_any_gate_is_diff_v1_with_lambda_moved_per_token_and_head(n_kv):
    """V1's ``lambda_probe`` adds to λ per head j, token t: probe[j, t] = g[t, j] − λ."""
    config = make_config(n_kv)
    params = make_params(config)
    n = 11
    mask_row = torch.tensor([0, 0] + [1] * (n - 2))
    x = make_input(config, n)
    rot, allowed = geometry(config, n, mask_row)
    gate = gated_diff_gate(config, {}, params, P, x)  # (N, H)
    v1_params = with_v1_lambda(config, params, 0.25)
    lam = diff_v1_lambda(config, v1_params, P, LAYER)
    probe = (gate.T - lam).unsqueeze(-1).expand(-1, -1, 2 * config.dim_per_head)
    v1 = diff_v1_attention(config, v1_params, P, LAYER, x, rot, allowed, lambda_probe=probe)
    gated = gated_diff_attention(config, {}, params, P, LAYER, x, rot, allowed)
    assert rel(gated, v1) < TIGHT
    assert gate.std() > 0.05  # a real per-token, per-head spread was tested, not a constant


@pytest.mark.parametrize("fusion", ["subtract", "convex"])
def test_bias_init_gives_diff_v1_lambda_init(fusion):
    """``gate_bias_init="lambda_init"``: at a zero gate input the effective λ is λ_init(l)."""
    config = make_config()
    opts = {"fusion": fusion}
    b = gated_diff_gate_bias_init(config, opts, LAYER)
    g = 1.0 / (1.0 + math.exp(-b))
    effective = g if fusion == "subtract" else (1.0 - g) / g
    assert abs(effective - config.lambda_init_for_layer(LAYER)) < 1e-12
    assert gated_diff_gate_bias_init(config, {**opts, "gate_bias_init": "zero"}, LAYER) == 0.0


# --- (b) the gate is per token and per head ----------------------------------------------------


def test_gate_is_per_token_and_per_head():
    config = make_config(4)
    params = make_params(config)
    n, t = 7, 3
    x = make_input(config, n)
    gate = gated_diff_gate(config, {}, params, P, x)
    assert gate.shape == (n, config.n_heads // 2)
    assert ((gate > 0) & (gate < 1)).all()
    # heads differ from each other on every token
    for a in range(gate.shape[1]):
        for b in range(a):
            assert (gate[:, a] - gate[:, b]).abs().min() > 1e-6
    # one token's x moves that token's gates (all heads) and no other token's
    x2 = x.clone()
    x2[t] = make_input(config, 1, seed=7)[0]
    moved = gated_diff_gate(config, {}, params, P, x2)
    others = [i for i in range(n) if i != t]
    assert torch.equal(moved[others], gate[others])
    assert ((moved[t] - gate[t]).abs() > 1e-9).all()
    # head j reads only row j of gate_proj.weight and entry j of its bias
    j = 1
    p2 = dict(params)
    p2[f"{P}.gate_proj.weight"] = params[f"{P}.gate_proj.weight"].clone()
    p2[f"{P}.gate_proj.weight"][j] += 0.3
    p2[f"{P}.gate_proj.bias"] = params[f"{P}.gate_proj.bias"].clone()
    p2[f"{P}.gate_proj.bias"][j] -= 0.2
    changed = gated_diff_gate(config, {}, p2, P, x)
    rest = [i for i in range(gate.shape[1]) if i != j]
    assert torch.equal(changed[:, rest], gate[:, rest])
    assert ((changed[:, j] - gate[:, j]).abs() > 1e-9).all()


def test_gate_without_bias():
    config = make_config()
    opts = {"gate_bias": False}
    params = make_params(config, opts)
    assert f"{P}.gate_proj.bias" not in params
    x = make_input(config, 5)
    expected = torch.sigmoid(x @ params[f"{P}.gate_proj.weight"].T)
    assert torch.allclose(gated_diff_gate(config, opts, params, P, x), expected, atol=1e-15)


# --- (c) lengths, MHA/GQA, causal + padding, gradients -----------------------------------------

CASES = [(n, kv, pad) for n in (1, 7, 129) for kv in (8, 4, 2) for pad in (False, True)]


@pytest.mark.parametrize(("n", "n_kv", "padded"), CASES)
def test_shapes_causality_padding_gradients(n, n_kv, padded):
    config = make_config(n_kv)
    params = {k: v.requires_grad_(True) for k, v in make_params(config).items()}
    n_pad = min(n - 1, 3) if padded else 0
    mask_row = torch.tensor([0] * n_pad + [1] * (n - n_pad)) if padded else None
    rot, allowed = geometry(config, n, mask_row)
    x = make_input(config, n)
    out = gated_diff_attention(config, {}, params, P, LAYER, x, rot, allowed)
    assert out.shape == (n, config.d_model) and torch.isfinite(out).all()

    with torch.no_grad():
        if n > 1:  # causal: the last token's x reaches no earlier output
            x2 = x.clone()
            x2[-1] = make_input(config, 1, seed=9)[0]
            later = gated_diff_attention(config, {}, params, P, LAYER, x2, rot, allowed)
            assert torch.equal(later[:-1], out[:-1])
            assert not torch.equal(later[-1], out[-1])
        if n_pad:  # pad tokens' x reaches no real token
            x3 = x.clone()
            x3[:n_pad] = make_input(config, n_pad, seed=10)
            padded_out = gated_diff_attention(config, {}, params, P, LAYER, x3, rot, allowed)
            assert torch.equal(padded_out[n_pad:], out[n_pad:])

    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    (out * weights).sum().backward()
    for name, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if n == 1 and name.startswith((f"{P}.q_proj", f"{P}.k_proj")):
            # one key: both maps are the constant 1, so Q and K get exactly no gradient
            assert torch.count_nonzero(p.grad) == 0, name
        else:
            assert p.grad.abs().max() > 0, name


@pytest.mark.parametrize("fusion", ["subtract", "convex"])
def test_length_one_closed_form(fusion):
    """One token: A⁺ = A⁻ = 1, so head_j = s·RMSNorm((1 − g_j) v) (subtract) or
    s·RMSNorm((2 g_j − 1) v) (convex), with s = 1 − λ_init."""
    config = make_config(4)
    opts = {"fusion": fusion}
    params = make_params(config)
    x = make_input(config, 1)
    rot, allowed = geometry(config, 1)
    out = gated_diff_attention(config, opts, params, P, LAYER, x, rot, allowed)
    d, n_diff = config.dim_per_head, config.n_heads // 2
    gate = gated_diff_gate(config, opts, params, P, x)[0]
    v = x @ params[f"{P}.v_proj.weight"].T  # (1, n_kv·d): groups of width 2d
    s = 1.0 - config.lambda_init_for_layer(LAYER)
    heads = []
    for j in range(n_diff):
        g = j // (n_diff // (config.num_kv_heads // 2))
        factor = 1 - gate[j] if fusion == "subtract" else 2 * gate[j] - 1
        v_g = v[:, 2 * d * g : 2 * d * (g + 1)]
        heads.append(s * rms_norm(factor * v_g, params[f"{P}.head_norm.weight"], 1e-5))
    expected = torch.cat(heads, dim=-1) @ params[f"{P}.o_proj.weight"].T
    assert rel(out, expected) < TIGHT


# --- shapes and options ----------------------------------------------------------------------


def test_parameter_shapes_and_count_over_baseline():
    config = make_config(4)
    shapes = gated_diff_parameter_shapes(config)
    d, dm, h = config.dim_per_head, config.d_model, config.n_heads // 2
    assert shapes == {
        "q_proj.weight": (8 * d, dm),
        "k_proj.weight": (4 * d, dm),
        "v_proj.weight": (4 * d, dm),
        "o_proj.weight": (dm, 8 * d),
        "head_norm.weight": (2 * d,),
        "gate_proj.weight": (h, dm),
        "gate_proj.bias": (h,),
    }
    baseline = 8 * d * dm + 2 * 4 * d * dm + dm * 8 * d
    total = sum(math.prod(s) for s in shapes.values())
    assert total - baseline == h * (dm + 1) + 2 * d
    no_norm = gated_diff_parameter_shapes(make_config(4, head_norm_learnable=False))
    assert "head_norm.weight" not in no_norm


def test_options_are_validated():
    assert resolve_options(None) == DEFAULT_OPTIONS
    with pytest.raises(ValueError, match="unknown option"):
        resolve_options({"gate_input": "query"})
    with pytest.raises(ValueError, match="fusion"):
        resolve_options({"fusion": "add"})
    with pytest.raises(ValueError, match="gate_bias"):
        resolve_options({"gate_bias": 1})


def test_output_scale_none_divides_out_one_minus_lambda_init():
    config = make_config(4)
    params = make_params(config)
    x = make_input(config, 6)
    rot, allowed = geometry(config, 6)
    scaled = gated_diff_attention(config, {}, params, P, LAYER, x, rot, allowed)
    plain = gated_diff_attention(
        config, {"output_scale": "none"}, params, P, LAYER, x, rot, allowed
    )
    s = 1.0 - config.lambda_init_for_layer(LAYER)
    assert rel(scaled, s * plain) < TIGHT
