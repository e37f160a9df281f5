"""The ``dint`` attention type (:mod:`diffattn.attention.dint`) against its oracle
(``tests/oracle/dint.py``, arXiv 2501.17486 reconstructed).

``DiffTransformerLM(attention="dint")`` in fp32 against the oracle's LM in fp64: logits and the
gradient of every parameter, lengths 1, 7, 129, MHA and GQA, a left-padded row, packed
documents, a full 4-D mask, the reference and sdpa backends, the options. Then the type's
claims: rows of the model's own map sum to 1 (γ = λ), γ = 0 is DIFF V1 bit for bit, a cache is
refused once it holds tokens, bad options are one error naming them, and ``extra_parameters``
is the real parameter difference to the baseline.
"""

from __future__ import annotations

import pytest
import torch

import diffattn
import oracle.dint as oracle_dint
from diffattn.attention.dint import VisibleRows, visible_mean, visible_rows
from diffattn.attention.mask import AttentionMask
from diffattn.attention.types import attention_type
from diffattn.cache import DynamicCache, StaticCache
from diffattn.model import count_parameters
from diffattn.probe import Lambda, Probe
from differential_parity import (
    build_model,
    check_options_change_the_model,
    check_parity,
    check_tensor_parallel,
    make_batch,
    make_config,
    oracle_logits,
    rel_max,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ("reference", "sdpa")
LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


class LambdaTerms:
    """The oracle's λ of each layer as ``λ + P`` with a zero ``P`` of shape ``(N, 2d)``, so
    ``P.grad`` holds the terms of ``dL/dλ`` per token and channel (summed over heads), whose
    condition number bounds what fp32 can get right of the λ vectors' gradients."""

    def __init__(self, monkeypatch, options: dict | None = None) -> None:
        self.options = options or {}
        self.terms: dict[int, list[torch.Tensor]] = {}
        self.rows = 0
        original = oracle_dint.dint_coefficients

        def coefficients(config, options, params, prefix, layer_index):
            lam, gamma = original(config, options, params, prefix, layer_index)
            probe = torch.zeros(
                self.rows, 2 * config.dim_per_head, dtype=lam.dtype, requires_grad=True
            )
            self.terms.setdefault(layer_index, []).append(probe)
            return lam + probe, (lam + probe if gamma is lam else gamma)

        monkeypatch.setattr(oracle_dint, "dint_coefficients", coefficients)

    def attend(self, config, params, prefix, layer, x, rot, allowed):
        self.rows = x.shape[0]
        return oracle_dint.dint_attention(
            config, self.options, params, prefix, layer, x, rot, allowed
        )

    def conditions(self) -> dict[str, float]:
        out = {}
        for layer, probes in self.terms.items():
            terms = torch.stack([p.grad for p in probes])
            cond = (terms.abs().sum() / terms.sum().abs().clamp_min(1e-300)).item()
            out.update({f"layers.{layer}.attn.{name}": cond for name in LAMBDA_VECTORS})
        return out


def parity(monkeypatch, config, n, left_pad=0, documents=None, seed=0):
    terms = LambdaTerms(monkeypatch, config.attention_options.get("dint"))
    model = build_model(config, seed)
    ids, mask = make_batch(n, config.vocab_size, left_pad, seed)
    # one token: A1 = A2 = G = [[1]], so the map is 1 − λ + λ whatever Q, K and λ
    exact_zero = ("attn.q_proj.weight", "attn.k_proj.weight", *LAMBDA_VECTORS)
    vanishing = dict.fromkeys(exact_zero, 1e-9) if n == 1 else {}
    return check_parity(
        model, ids, terms.attend, mask, documents, vanishing, conditions=terms.conditions
    )


# --- the model against the oracle --------------------------------------------------------------

CASES = [
    (1, 0),
    (7, 3),
    pytest.param(129, 3, marks=pytest.mark.slow),  # the oracle's loops take ~7 s
]


@pytest.mark.parametrize(("n", "left_pad"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("n_kv_heads", (8, 4), ids=("mha", "gqa"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_gradients_equal_the_oracle(monkeypatch, backend, n_kv_heads, n, left_pad):
    config = make_config("dint", backend=backend, n_kv_heads=n_kv_heads)
    parity(monkeypatch, config, n, left_pad)


def test_a_long_sequence_equals_the_oracle_without_padding(monkeypatch):
    """n = 40, no padding: the running mean's plain causal path (no real-row weights)."""
    parity(monkeypatch, make_config("dint", backend="sdpa", n_kv_heads=4), 40, seed=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_restart_the_mean(monkeypatch, backend):
    """Three documents in row 0, two in the left-padded row 1: every row's integral term
    averages only its own document's real rows (the oracle's mask says so)."""
    documents = torch.tensor([[0] * 6 + [1] * 5 + [2] * 7, [0] * 9 + [1] * 9])
    config = make_config("dint", backend=backend, n_kv_heads=4)
    parity(monkeypatch, config, 18, left_pad=2, documents=documents, seed=1)


OPTIONS = {
    "second-map": ({"integral_map": "second"}, {}),
    "both-maps": ({"integral_map": "both"}, {}),
    "fixed-gamma": ({"gamma": 0.3}, {}),
    "no-head-norm": ({}, {"head_norm": False}),
    "fixed-head-norm": ({"gamma": -0.5}, {"head_norm_learnable": False}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_options_equal_the_oracle(monkeypatch, case, backend):
    options, fields = OPTIONS[case]
    config = make_config("dint", options, backend=backend, n_kv_heads=4, **fields)
    parity(monkeypatch, config, 12, left_pad=3, seed=3)


def test_options_change_the_model():
    check_options_change_the_model("dint", OPTIONS)


def test_a_full_mask_gives_the_papers_column_mean(monkeypatch):
    """A bidirectional 4-D mask: every row sees every row, so G is the plain column mean of the
    map (the paper's unmasked formula), and the model equals the oracle under that mask."""
    config = make_config("dint", n_kv_heads=4)
    terms = LambdaTerms(monkeypatch)
    model = build_model(config, 4)
    ids, _ = make_batch(9, config.vocab_size, seed=4)
    full = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    logits = model(ids, attention_mask=full).logits
    params = {k: p.detach().double() for k, p in model.named_parameters()}
    ref = oracle_logits(config, params, ids, terms.attend, allowed=full[:, 0])
    assert rel_max(logits.detach().double(), ref) <= 1e-5


def test_a_mask_that_is_not_transitive_is_refused():
    """A sliding window of two keys: row 1 reads key 0, which row 2 may not read."""
    model = build_model(make_config("dint", n_kv_heads=4))
    window = torch.tril(torch.ones(5, 5, dtype=torch.bool)) & ~torch.tril(
        torch.ones(5, 5, dtype=torch.bool), -2
    )
    with pytest.raises(ValueError, match="not transitive"):
        model(torch.ones(1, 5, dtype=torch.long), attention_mask=window[None, None])


# --- the running mean ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_visible_mean_is_the_mean_over_the_rows_the_mask_shows(seed):
    """The cumulative-sum path (padding with holes, documents) against the mean over the rows
    ``AttentionMask.dense`` lets each query see, written out."""
    gen = torch.Generator().manual_seed(seed)
    n = 11
    real = torch.rand(3, n, generator=gen) > 0.3
    runs = torch.cumsum(torch.rand(3, n, generator=gen) > 0.7, dim=1)
    runs[:, 0] = 0
    src = torch.randn(3, 2, n, 5, generator=gen, dtype=torch.float64)
    mask = AttentionMask(key_padding=real, document_ids=runs)
    allowed = mask.dense(n, n, src.device)[:, 0]  # (B, N, N)
    expected = torch.stack(
        [
            torch.stack([src[b, :, allowed[b, i]].mean(dim=1) for i in range(n)], dim=1)
            for b in range(3)
        ]
    )
    rows = visible_rows(mask, n, n)
    assert rows.allowed is None  # the cumulative sums, not a dense mask
    torch.testing.assert_close(visible_mean(src, rows), expected, rtol=1e-12, atol=1e-12)
    dense = visible_mean(src, VisibleRows(allowed=allowed[:, None]))  # the 4-D masks' path
    torch.testing.assert_close(dense, expected, rtol=1e-12, atol=1e-12)


# --- the type's claims ---------------------------------------------------------------------


@pytest.mark.parametrize("gamma", ["lambda", 0.3])
def test_rows_of_the_models_map_sum_to_one_minus_lambda_plus_gamma(gamma):
    """(D6) on ``output_attentions``: rows sum to 1 when γ = λ (else to 1 − λ + γ), no weight
    on a key the query may not read, and the output is the one computed without maps."""
    config = make_config("dint", {"gamma": gamma}, n_kv_heads=4)
    model = build_model(config, 5)
    ids, mask = make_batch(10, config.vocab_size, 3, seed=5)
    out = model(ids, attention_mask=mask, output_attentions=True)
    plain = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=1e-5)
    allowed = AttentionMask(key_padding=mask.bool()).dense(10, 10, ids.device)
    for maps in out.attention_maps:
        lam = maps.lam.item()
        assert abs(lam) > 0.05  # without G, rows would sum to 1 − λ
        total = 1.0 if gamma == "lambda" else 1.0 - lam + gamma
        sums = maps.diff.sum(-1)
        torch.testing.assert_close(sums, torch.full_like(sums, total), rtol=0, atol=1e-5)
        assert (maps.diff.abs() * ~allowed).max().item() == 0.0
        assert maps.a1.shape == maps.diff.shape == (2, 4, 10, 10)


@pytest.mark.parametrize("n", (1, 7, 129))
@pytest.mark.parametrize("n_kv_heads", (8, 4), ids=("mha", "gqa"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gamma_zero_is_diff_v1_bit_for_bit(backend, n_kv_heads, n):
    dint = build_model(make_config("dint", {"gamma": 0.0}, backend=backend, n_kv_heads=n_kv_heads))
    v1 = diffattn.DiffTransformerLM(make_config("diff_v1", backend=backend, n_kv_heads=n_kv_heads))
    v1.load_state_dict(dint.state_dict())
    ids, mask = make_batch(n, 61, left_pad=3 if n > 3 else 0)
    with torch.no_grad():
        expected = v1(ids, attention_mask=mask).logits
        assert torch.equal(dint(ids, attention_mask=mask).logits, expected)
        if n > 1:  # and the integral term is what DINT adds
            unified = diffattn.DiffTransformerLM(
                make_config("dint", backend=backend, n_kv_heads=n_kv_heads)
            )
            unified.load_state_dict(dint.state_dict())
            assert (unified(ids, attention_mask=mask).logits - expected).abs().max() > 1e-3


def test_an_empty_cache_is_filled_exactly_and_a_filled_one_is_refused():
    """The integral term of a new token needs every earlier token's first-map output, which a
    key/value cache does not hold: a prefill into an empty cache equals the forward without one,
    a step after cached tokens (dynamic, static) is one clear error; ``generate`` decodes
    without a cache (tests/test_attention_types.py)."""
    model = build_model(make_config("dint", backend="sdpa", n_kv_heads=4))
    ids, mask = make_batch(9, 61, 3)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        for cache in (DynamicCache(), StaticCache(model.config, 2, 16)):
            filled = model(ids, attention_mask=mask, past_key_values=cache).logits
            torch.testing.assert_close(filled[mask.bool()], full[mask.bool()], rtol=0, atol=1e-5)
            step = torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), dim=1)
            with pytest.raises(ValueError, match="cannot attend from a KV cache that holds"):
                model(ids[:, :1], attention_mask=step, past_key_values=cache)


@pytest.mark.slow
def test_tensor_parallel_equals_one_process():
    """Two ranks holding whole KV groups each (λ and the norm weight replicated): the running
    mean is per head and token, so the sharded model computes the same."""
    check_tensor_parallel(["dint", "dint:integral_map=both,gamma=0.3"])


def test_the_probe_reads_the_layers_lambda():
    model = build_model(make_config("dint", n_kv_heads=4))
    ids, mask = make_batch(7, 61, 3)
    lam = Lambda()
    with Probe(model, [lam]):
        model(ids, attention_mask=mask)
    expected = [block.attn.lambda_full().item() for block in model.layers]
    assert lam.result() == {"lambda": pytest.approx(expected, abs=1e-7)}


# --- options, parameters -----------------------------------------------------------------------

BAD_OPTIONS = [
    ({"integral_rows": "all"}, "integral_rows", "lets a token read later tokens"),
    ({"integral_rows": "rows"}, "integral_rows", "must be one of 'visible', 'all'"),
    ({"integral_map": "last"}, "integral_map", "must be one of 'first', 'second', 'both'"),
    ({"gamma": "beta"}, "gamma", "must be 'lambda' or a number"),
    ({"gamma": True}, "gamma", "must be 'lambda' or a number"),
    ({"gamma": float("nan")}, "gamma", "must be finite"),
    ({"integral": "first"}, "integral", "unknown option of dint"),
]


@pytest.mark.parametrize(("options", "option", "why"), BAD_OPTIONS)
def test_a_bad_option_is_one_error_naming_it(options, option, why):
    with pytest.raises(ValueError, match=rf"ModelConfig\.attention_options\.dint\.{option}: ") as e:
        make_config("dint", options)
    assert why in str(e.value)


def test_gamma_is_read_from_text():
    gamma = {o.name: o for o in attention_type("dint").options}["gamma"]
    assert gamma.parse("lambda") == "lambda" and gamma.parse(" 0.25") == 0.25
    with pytest.raises(ValueError, match="expected 'lambda' or a number"):
        gamma.parse("beta")


@pytest.mark.parametrize("learnable", (True, False))
def test_extra_parameters_are_the_real_difference_to_the_baseline(learnable):
    config = make_config("dint", n_kv_heads=4, head_norm_learnable=learnable)
    baseline = make_config("baseline", n_kv_heads=4)
    extra = attention_type("dint").extra_parameters(config)
    assert count_parameters(config) - count_parameters(baseline) == config.n_layers * extra
    assert count_parameters(config) == count_parameters(config.replace(attention="diff_v1"))
    assert extra == 4 * 8 + (16 if learnable else 0)


def test_odd_heads_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"ModelConfig\.n_kv_heads: dint pairs key heads"):
        make_config("dint", n_heads=6, n_kv_heads=3)
