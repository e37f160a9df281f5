"""The DINT oracle (``tests/oracle/dint.py``) against the properties its equations promise.

fp64, one tiny attention layer. Checked: (D6) rows of the final map sum to 1 when γ = λ (and
to 1 − λ + γ otherwise), under the causal mask and with padded rows; the map never reaches a key
the query may not attend; with a full mask the integral term is the paper's plain column mean;
under the causal mask it is the running mean over the prefix; γ = 0 gives DIFF V1 bit for bit;
the output is causal (and the non-causal ``integral_rows="all"`` is not); the parameters are
DIFF V1's; lengths 1, 7 and 129 with MHA and GQA, gradients reaching every parameter.
"""

from __future__ import annotations

import pytest
import torch

import diffattn
from diffattn.attention.diff_v1 import DiffAttentionV1
from oracle.dint import (
    dint_attention,
    dint_heads,
    dint_map,
    dint_parameter_shapes,
    resolve_options,
)
from oracle.reference_lm import (
    allowed_keys,
    attention_map,
    diff_v1_attention,
    diff_v1_lambda,
    head_slice,
    linear,
    rms_norm,
    rope,
    rotary_table,
    token_positions,
)

PREFIX = "attn"
LAYER = 2  # λ_init = 0.4707, so λ_init ≠ 1 − λ_init
PADDED = [1, 1, 0, 1, 1, 0, 0]  # a padded row inside the sequence and two at its end
DTYPE = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only add overhead


def make_config(n_kv_heads: int = 4, **changes) -> diffattn.ModelConfig:
    fields = dict(
        vocab_size=61,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        head_dim=8,
        ffn_hidden=48,
        max_seq_len=256,
        attention="diff_v1",
    )
    return diffattn.ModelConfig(**{**fields, **changes})


def make_params(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp64 parameters, λ vectors large enough that λ is far from λ_init."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in dint_parameter_shapes(config).items():
        if name.startswith("lambda_"):
            value = 0.4 * torch.randn(shape, generator=gen, dtype=DTYPE)
        elif name == "head_norm.weight":
            value = 1.0 + 0.2 * torch.randn(shape, generator=gen, dtype=DTYPE)
        else:
            value = torch.randn(shape, generator=gen, dtype=DTYPE) / shape[1] ** 0.5
        params[f"{PREFIX}.{name}"] = value.requires_grad_()
    return params


def inputs(config, n: int, mask: list[int] | None = None, seed: int = 1):
    """``(x, rot, allowed)`` for one sequence of length n: x RMS-normed, RoPE on positions."""
    gen = torch.Generator().manual_seed(seed)
    x = rms_norm(torch.randn(n, config.d_model, generator=gen, dtype=DTYPE), None, 1e-6)
    mask_row = None if mask is None else torch.tensor(mask)
    rot = rotary_table(
        token_positions(mask_row, n), config.dim_per_head, config.rope_theta, config.rope_style
    )
    return x, rot, allowed_keys(mask_row, n, x.device)


def lam_of(config, params) -> float:
    return diff_v1_lambda(config, params, PREFIX, LAYER).item()


# --- (a) row normalisation -------------------------------------------------------------------


@pytest.mark.parametrize("integral_map", ["first", "second", "both"])
@pytest.mark.parametrize("mask", [None, PADDED], ids=["causal", "padded"])
@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
def test_rows_sum_to_one_when_gamma_is_lambda(integral_map, mask, n_kv):
    config = make_config(n_kv)
    params = make_params(config)
    x, rot, allowed = inputs(config, 7, mask)
    options = {"integral_map": integral_map}
    maps = dint_map(config, options, params, PREFIX, LAYER, x, rot, allowed)
    assert maps.shape == (2, 7, 7)
    assert abs(lam_of(config, params) - config.lambda_init_for_layer(LAYER)) > 0.05
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 7, dtype=DTYPE), rtol=0, atol=1e-13)
    # no weight on a key the query may not attend (future keys, padded keys of other rows)
    assert (maps.abs() * ~allowed).max().item() == 0.0
    if mask:  # the padded row 2 sees keys 0, 1 and itself; the real row 3 does not see key 2
        assert maps[:, 2, :3].abs().min().item() > 0
        assert maps[:, 3, 2].abs().max().item() == 0.0
    # the first row sees only key 0: A1 = A2 = G = e0 there, so the map row is e0
    torch.testing.assert_close(maps[:, 0, 0], torch.ones(2, dtype=DTYPE), rtol=0, atol=1e-15)


@pytest.mark.parametrize("gamma", [0.0, 0.3])
def test_rows_sum_to_one_minus_lambda_plus_gamma_otherwise(gamma):
    config = make_config()
    params = make_params(config)
    x, rot, allowed = inputs(config, 7, PADDED)
    maps = dint_map(config, {"gamma": gamma}, params, PREFIX, LAYER, x, rot, allowed)
    expected = torch.full((2, 7), 1.0 - lam_of(config, params) + gamma, dtype=DTYPE)
    torch.testing.assert_close(maps.sum(-1), expected, rtol=0, atol=1e-13)
    assert (maps.sum(-1) - 1.0).abs().min().item() > 0.05  # so (D6) needs γ = λ


# --- the integral term -----------------------------------------------------------------------


@pytest.mark.parametrize("integral_map", ["first", "second", "both"])
def test_full_mask_gives_the_papers_column_mean(integral_map):
    """With a bidirectional mask every row sees every row: G is the column mean of the map,
    the same vector in every row, and "visible" equals the paper's "all"."""
    config = make_config(2)
    params = make_params(config)
    x, rot, _ = inputs(config, 7)
    full = torch.ones(7, 7, dtype=torch.bool)
    options = {"integral_map": integral_map}
    visible = dint_heads(config, options, params, PREFIX, x, rot, full)
    every = dint_heads(config, {**options, "integral_rows": "all"}, params, PREFIX, x, rot, full)
    lam = diff_v1_lambda(config, params, PREFIX, LAYER)
    d = config.dim_per_head
    wq, wk = params[f"{PREFIX}.q_proj.weight"], params[f"{PREFIX}.k_proj.weight"]
    for j, (h, h_all) in enumerate(zip(visible, every, strict=True)):
        torch.testing.assert_close(h.g, h_all.g, rtol=0, atol=0)
        # A1, A2 written out once more: one KV group (n_kv_heads=2), so K1, K2 are key heads 0, 1
        q1, q2 = (rope(linear(x, head_slice(wq, 2 * j + s, d)), rot) for s in (0, 1))
        k1, k2 = (rope(linear(x, head_slice(wk, s, d)), rot) for s in (0, 1))
        a1, a2 = attention_map(q1, k1, full), attention_map(q2, k2, full)
        source = {"first": a1, "second": a2, "both": (a1 + a2) / 2}[integral_map]
        column_mean = source.mean(dim=0, keepdim=True).expand(7, 7)
        torch.testing.assert_close(h.g, column_mean, rtol=1e-12, atol=1e-15)
    maps = dint_map(config, options, params, PREFIX, LAYER, x, rot, full)
    literal = torch.stack([h.a1 - lam * h.a2 + lam * h.g.mean(0) for h in visible])
    torch.testing.assert_close(maps, literal, rtol=1e-12, atol=1e-14)


def test_causal_integral_is_the_running_mean_of_the_prefix():
    """Under the plain causal mask row i of G is ``(1/(i+1)) Σ_{m≤i} A1[m]``: a cumulative sum,
    so an efficient kernel can compute G V as the running mean of A1 V."""
    config = make_config(2)
    params = make_params(config)
    x, rot, allowed = inputs(config, 9)
    counts = torch.arange(1, 10, dtype=DTYPE)[:, None]
    for h in dint_heads(config, None, params, PREFIX, x, rot, allowed):
        torch.testing.assert_close(h.g, h.a1.cumsum(0) / counts, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(h.g @ h.v, (h.a1 @ h.v).cumsum(0) / counts)


def test_padded_rows_leave_real_rows_alone():
    """A real row averages only real rows: the padded rows' maps do not enter its G."""
    config = make_config()
    params = make_params(config)
    x, rot, allowed = inputs(config, 7, PADDED)
    real = [0, 1, 3, 4]
    for h in dint_heads(config, None, params, PREFIX, x, rot, allowed):
        for i in real:
            rows = [m for m in real if m <= i]
            torch.testing.assert_close(h.g[i], h.a1[rows].mean(0), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(h.g[2], h.a1[[0, 1, 2]].mean(0), rtol=1e-12, atol=1e-15)


def test_a_mask_that_is_not_transitive_is_refused():
    config = make_config()
    params = make_params(config)
    x, rot, _ = inputs(config, 5)
    window = torch.tensor([[0 <= i - j < 2 for j in range(5)] for i in range(5)])
    with pytest.raises(ValueError, match="not transitive"):
        dint_attention(config, None, params, PREFIX, LAYER, x, rot, window)


# --- (b) DIFF V1 -----------------------------------------------------------------------------


@pytest.mark.parametrize("head_norm", [True, False])
@pytest.mark.parametrize("mask", [None, PADDED], ids=["causal", "padded"])
@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
def test_gamma_zero_is_diff_v1_exactly(head_norm, mask, n_kv):
    config = make_config(n_kv, head_norm=head_norm)
    params = make_params(config)
    x, rot, allowed = inputs(config, 7, mask)
    dint = dint_attention(config, {"gamma": 0.0}, params, PREFIX, LAYER, x, rot, allowed)
    diff = diff_v1_attention(config, params, PREFIX, LAYER, x, rot, allowed)
    assert torch.equal(dint, diff)
    # and the integral term matters by default
    default = dint_attention(config, None, params, PREFIX, LAYER, x, rot, allowed)
    assert (default - diff)[1:].abs().max().item() > 1e-3


def test_parameters_are_diff_v1s():
    """Same names and shapes as diffattn's DIFF V1 layer: DINT adds no parameter."""
    for n_kv, head_norm, learnable in [(4, True, True), (2, True, False), (2, False, True)]:
        config = make_config(n_kv, head_norm=head_norm, head_norm_learnable=learnable)
        module = DiffAttentionV1(config, LAYER)
        expected = {name: tuple(p.shape) for name, p in module.named_parameters()}
        assert dint_parameter_shapes(config) == expected


# --- causality -------------------------------------------------------------------------------


def test_visible_rows_keep_the_output_causal_and_all_rows_do_not():
    config = make_config(2)
    params = make_params(config)
    x, rot, allowed = inputs(config, 8)
    x2 = x.clone()
    x2[5:] = rms_norm(torch.randn(3, config.d_model, dtype=DTYPE), None, 1e-6)
    for rows, causal in (("visible", True), ("all", False)):
        opts = {"integral_rows": rows}
        a = dint_attention(config, opts, params, PREFIX, LAYER, x, rot, allowed)
        b = dint_attention(config, opts, params, PREFIX, LAYER, x2, rot, allowed)
        change = (a[:5] - b[:5]).abs().max().item()
        assert (change == 0.0) if causal else (change > 1e-3), (rows, change)


# --- (c) lengths, heads, gradients -----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 129])
@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
def test_lengths_and_gradients(n, n_kv):
    config = make_config(n_kv)
    params = make_params(config)
    x, rot, allowed = inputs(config, n)
    out = dint_attention(config, None, params, PREFIX, LAYER, x, rot, allowed)
    assert out.shape == (n, config.d_model)
    assert torch.isfinite(out).all()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=DTYPE)
    (out * weights).sum().backward()
    # one token: every map is [[1]] whatever the scores and λ (A1 − λ A2 + λ G = 1 − λ + λ),
    # so W_Q, W_K and the λ vectors get exactly no gradient
    vanishing = {"q_proj.weight", "k_proj.weight", "lambda_q1", "lambda_k1", "lambda_q2"}
    vanishing |= {"lambda_k2"}
    for name, p in params.items():
        short = name.removeprefix(f"{PREFIX}.")
        assert p.grad is not None, f"{name}: the oracle does not use it"
        assert torch.isfinite(p.grad).all(), name
        if n == 1 and short in vanishing:
            assert p.grad.abs().max().item() == 0.0, name
        else:
            assert p.grad.norm().item() > 0, f"{name}: gradient is zero"


def test_options_are_checked():
    assert resolve_options(None) == {
        "integral_rows": "visible",
        "integral_map": "first",
        "gamma": "lambda",
    }
    for bad in ({"integral": 1}, {"integral_rows": "prefix"}, {"integral_map": "a1"}):
        with pytest.raises(ValueError):
            resolve_options(bad)
    with pytest.raises(ValueError):
        resolve_options({"gamma": True})
