"""The ``gated_diff`` attention type (:mod:`diffattn.attention.gated_diff`) against its oracle
(``tests/oracle/gated_diff.py``, M-DGSA of arXiv 2505.24054 reconstructed).

``DiffTransformerLM(attention="gated_diff")`` in fp32 against the oracle's LM in fp64: logits
and the gradient of every parameter, lengths 1, 7, 129, MHA and GQA, a left-padded row, packed
documents, the reference and sdpa backends, every option. Then the type's claims: a constant
gate c is DIFF V1 with λ = c, the bias starts at the logit its option names, the model's maps
are G3's, a cache gives the outputs of the full forward, bad options are one error naming them,
and ``extra_parameters`` is the real parameter difference to the baseline.
"""

from __future__ import annotations

import math

import pytest
import torch

import diffattn
import oracle.gated_diff as oracle_gated
from diffattn.attention.types import attention_type
from diffattn.cache import DynamicCache, StaticCache
from diffattn.model import count_parameters
from differential_parity import (
    build_model,
    check_options_change_the_model,
    check_parity,
    check_tensor_parallel,
    make_batch,
    make_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ("reference", "sdpa")


class GateTerms:
    """Keeps the oracle's gate ``(N, H)`` of each layer and row, so the terms of the bias's
    gradient (one per token: ``dL/dg · g(1 − g)``) give the condition number of that sum."""

    def __init__(self, monkeypatch, options: dict | None = None) -> None:
        self.options = options or {}
        self.gates: dict[str, list[torch.Tensor]] = {}
        original = oracle_gated.gated_diff_gate

        def gate(config, options, params, prefix, x):
            value = original(config, options, params, prefix, x)
            value.retain_grad()
            self.gates.setdefault(prefix, []).append(value)
            return value

        monkeypatch.setattr(oracle_gated, "gated_diff_gate", gate)

    def attend(self, config, params, prefix, layer, x, rot, allowed):
        return oracle_gated.gated_diff_attention(
            config, self.options, params, prefix, layer, x, rot, allowed
        )

    def conditions(self) -> dict[str, float]:
        out = {}
        for prefix, gates in self.gates.items():
            terms = torch.cat([g.grad * g.detach() * (1 - g.detach()) for g in gates])  # (T, H)
            cond = terms.abs().sum(0).norm() / terms.sum(0).norm().clamp_min(1e-300)
            out[f"{prefix}.gate_proj.bias"] = cond.item()
        return out


def parity(monkeypatch, config, n, left_pad=0, documents=None, seed=0):
    terms = GateTerms(monkeypatch, config.attention_options.get("gated_diff"))
    model = build_model(config, seed)
    ids, mask = make_batch(n, config.vocab_size, left_pad, seed)
    vanishing: dict[str, float] = {}
    conditions = terms.conditions
    if n == 1:  # A⁺ = A⁻ = [[1]] whatever Q and K: head = (1 − g)·v, or (2g − 1)·v (convex)
        vanishing = {"attn.q_proj.weight": 1e-9, "attn.k_proj.weight": 1e-9}
        gate = [f"layers.{i}.attn.gate_proj.{p}" for i in range(2) for p in ("weight", "bias")]
        if config.head_norm and terms.options.get("fusion") == "convex":
            # the norm undoes the factor up to its eps, which matters where 2g − 1 is small;
            # fp32 forms that factor as g·(1 − (1 − g)/g), which cancels there
            conditions = lambda: dict.fromkeys(gate, 100.0)  # noqa: E731
        elif config.head_norm:  # the norm undoes (1 − g) up to its eps
            vanishing.update(dict.fromkeys(("attn.gate_proj.weight", "attn.gate_proj.bias"), 1e-4))
    return check_parity(model, ids, terms.attend, mask, documents, vanishing, conditions=conditions)


# --- the model against the oracle --------------------------------------------------------------


@pytest.mark.parametrize(("n", "left_pad"), [(1, 0), (7, 3), (129, 3)], ids=lambda v: str(v))
@pytest.mark.parametrize("n_kv_heads", (8, 4, 2), ids=("mha", "gqa2", "gqa4"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_gradients_equal_the_oracle(monkeypatch, backend, n_kv_heads, n, left_pad):
    config = make_config("gated_diff", backend=backend, n_kv_heads=n_kv_heads)
    parity(monkeypatch, config, n, left_pad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_equal_the_oracle(monkeypatch, backend):
    documents = torch.tensor([[0] * 6 + [1] * 5 + [2] * 7, [0] * 9 + [1] * 9])
    config = make_config("gated_diff", backend=backend, n_kv_heads=4)
    parity(monkeypatch, config, 18, left_pad=2, documents=documents, seed=1)


OPTIONS = {
    "convex": ({"fusion": "convex"}, {}),
    "no-bias": ({"gate_bias": False}, {}),
    "no-output-scale": ({"output_scale": "none"}, {}),
    "convex-no-head-norm": ({"fusion": "convex"}, {"head_norm": False}),
    "fixed-head-norm": ({"output_scale": "none"}, {"head_norm_learnable": False}),
}


@pytest.mark.parametrize("n", (1, 12))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_options_equal_the_oracle(monkeypatch, case, backend, n):
    options, fields = OPTIONS[case]
    config = make_config("gated_diff", options, backend=backend, n_kv_heads=4, **fields)
    parity(monkeypatch, config, n, left_pad=3 if n > 3 else 0, seed=3)


def test_options_change_the_model():
    check_options_change_the_model("gated_diff", OPTIONS)


# --- the type's claims ---------------------------------------------------------------------


def as_diff_v1(model: diffattn.DiffTransformerLM, c: float) -> diffattn.DiffTransformerLM:
    """A DIFF V1 model with ``model``'s projections and norms and λ = c in every layer:
    λ_q2 = λ_k2 = 0 and λ_q1·λ_k1 = log(c − λ_init + 1) (Eq.2)."""
    config = model.config.replace(attention="diff_v1", attention_options={})
    v1 = diffattn.DiffTransformerLM(config)
    state = {k: v for k, v in model.state_dict().items() if ".attn.gate_proj." not in k}
    missing = v1.load_state_dict(state, strict=False).missing_keys
    assert all(".lambda_" in name for name in missing)
    with torch.no_grad():
        for layer, block in enumerate(v1.layers):
            attn = block.attn
            for vector in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2):
                vector.zero_()
            attn.lambda_k1[0] = 1.0
            attn.lambda_q1[0] = math.log(c - config.lambda_init_for_layer(layer) + 1.0)
    return v1


@pytest.mark.parametrize("head_norm", (True, False))
@pytest.mark.parametrize("n_kv_heads", (8, 4), ids=("mha", "gqa"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_constant_gate_is_diff_v1_with_lambda_c(backend, n_kv_heads, head_norm):
    """gate_proj.weight = 0 and bias = logit(c): every token's gate is c, DIFF V1's λ."""
    c = 0.3
    config = make_config("gated_diff", backend=backend, n_kv_heads=n_kv_heads, head_norm=head_norm)
    model = build_model(config)
    with torch.no_grad():
        for block in model.layers:
            block.attn.gate_proj.weight.zero_()
            block.attn.gate_proj.bias.fill_(math.log(c / (1 - c)))
    v1 = as_diff_v1(model, c)
    ids, mask = make_batch(20, config.vocab_size, 3)
    with torch.no_grad():
        assert abs(v1.layers[1].attn.lambda_full().item() - c) < 1e-6
        got, expected = model(ids, attention_mask=mask).logits, v1(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    other = as_diff_v1(model, 0.6)
    with torch.no_grad():
        assert (other(ids, attention_mask=mask).logits - got).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("options", "gate"),
    [
        ({}, lambda li: li),
        ({"fusion": "convex"}, lambda li: 1 / (1 + li)),
        ({"gate_bias_init": "zero"}, lambda li: 0.5),
    ],
    ids=("subtract", "convex", "zero"),
)
def test_the_gate_starts_where_its_option_says(options, gate):
    """``gate_bias_init='lambda_init'``: at a zero input the effective λ is DIFF V1's
    λ_init(l) (g = λ_init for subtract, (1 − g)/g = λ_init for convex); 'zero': g = 1/2. The
    weight starts ~ N(0, init_std) as every Linear."""
    config = make_config("gated_diff", options, n_layers=3)
    model = diffattn.DiffTransformerLM(config)
    for layer, block in enumerate(model.layers):
        bias = block.attn.gate_proj.bias
        expected = gate(config.lambda_init_for_layer(layer))
        torch.testing.assert_close(torch.sigmoid(bias), torch.full_like(bias, expected))
        assert abs(block.attn.gate_proj.weight.std().item() - config.init_std) < 0.005


@pytest.mark.parametrize("fusion", ("subtract", "convex"))
def test_the_models_maps_are_the_fused_maps(fusion):
    """``output_attentions``: ``diff`` is G3's map (``A⁺ − g·A⁻`` or ``g·A⁺ − (1 − g)·A⁻``
    with ``lam`` = g or (1 − g)/g), and the output is the one computed without maps."""
    config = make_config("gated_diff", {"fusion": fusion}, n_kv_heads=4)
    model = build_model(config, 5)
    ids, mask = make_batch(10, config.vocab_size, 3, seed=5)
    out = model(ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(
        out.logits, model(ids, attention_mask=mask).logits, atol=1e-5, rtol=0
    )
    x = model.embed_tokens(ids)
    block = model.layers[0]
    gate = torch.sigmoid(block.attn.gate_logits(block.attn_norm(x)))  # (B, H, N, 1)
    maps = out.attention_maps[0]
    assert maps.lam.shape == (2, 4, 10, 1)
    if fusion == "subtract":
        torch.testing.assert_close(maps.lam, gate.detach())
        expected = maps.a1 - gate * maps.a2
    else:
        torch.testing.assert_close(maps.lam, ((1 - gate) / gate).detach())
        expected = gate * maps.a1 - (1 - gate) * maps.a2
    torch.testing.assert_close(maps.diff, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_kind", ("dynamic", "static"))
def test_chunked_prefill_then_decode_equals_the_full_forward(backend, cache_kind):
    model = build_model(make_config("gated_diff", backend=backend, n_kv_heads=4))
    ids, mask = make_batch(21, 61, 4)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = DynamicCache() if cache_kind == "dynamic" else StaticCache(model.config, 2, 32)
        pieces, start = [], 0
        for stop in (9, 14, *range(15, 22)):  # two prefill chunks, then one token at a time
            out = model(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache)
            pieces.append(out.logits)
            start = stop
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_equals_one_process():
    """Two ranks holding whole KV groups each, ``gate_proj`` split by head (g_j with head j),
    the norm weight replicated; forward, backward and cached decoding."""
    check_tensor_parallel(["gated_diff", "gated_diff:fusion=convex,gate_bias=False"])


# --- options, parameters -----------------------------------------------------------------------

BAD_OPTIONS = [
    ({"fusion": "add"}, "fusion", "must be one of 'subtract', 'convex'"),
    ({"gate_bias": "yes"}, "gate_bias", "must be a bool"),
    ({"gate_bias_init": "one"}, "gate_bias_init", "must be one of 'lambda_init', 'zero'"),
    ({"output_scale": 1.0}, "output_scale", "must be a str"),
    ({"gate": "sigmoid"}, "gate", "unknown option of gated_diff"),
]


@pytest.mark.parametrize(("options", "option", "why"), BAD_OPTIONS)
def test_a_bad_option_is_one_error_naming_it(options, option, why):
    pattern = rf"ModelConfig\.attention_options\.gated_diff\.{option}: "
    with pytest.raises(ValueError, match=pattern) as e:
        make_config("gated_diff", options)
    assert why in str(e.value)


@pytest.mark.parametrize(
    ("options", "fields"),
    [({}, {}), ({"gate_bias": False}, {}), ({}, {"head_norm_learnable": False})],
    ids=("default", "no-bias", "fixed-norm"),
)
def test_extra_parameters_are_the_real_difference_to_the_baseline(options, fields):
    config = make_config("gated_diff", options, n_kv_heads=4, **fields)
    baseline = make_config("baseline", n_kv_heads=4)
    extra = attention_type("gated_diff").extra_parameters(config)
    assert count_parameters(config) - count_parameters(baseline) == config.n_layers * extra
    heads, d_model = 4, 64
    bias = 0 if options else heads
    assert extra == heads * d_model + bias + (0 if fields else 16)


def test_odd_heads_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"ModelConfig\.n_heads: gated_diff pairs query heads"):
        make_config("gated_diff", n_heads=3, n_kv_heads=1, head_dim=8)
