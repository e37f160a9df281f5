"""The ``gda`` attention type (Grouped Differential Attention) against its oracle.

* ``DiffTransformerLM`` with ``attention="gda"`` against ``tests/oracle/gda.py`` in a full LM
  twin evaluated in fp64: logits and the gradient of every parameter, on lengths 1, 7 and
  129, one noise head per KV group and several, both head budgets and an explicit
  ``n_noise_heads``, a left-padded batch and packed documents, on the ``reference``,
  ``sdpa`` and ``fused`` backends;
* ratio 1 is DIFF V1: the same weights give ``torch.equal`` logits and gradients;
* a KV cache (dynamic and static) computes what the full forward computes;
* the declaration's parameter and FLOPs counts, FFN matching, and option validation.
"""

from __future__ import annotations

import math

import pytest
import torch

from diffattn import DiffTransformerLM, ModelConfig, presets
from diffattn.attention.observe import MapRecorder, observing
from diffattn.attention.registry import ENTRY_DIFF, ENTRY_SOFTMAX
from diffattn.attention.types import attention_type
from diffattn.cache import DynamicCache, StaticCache
from diffattn.probe import AttentionMaps, HeadOutputs, Lambda, Probe
from oracle.gda import gda_attention, gda_parameter_budget, gda_parameter_shapes
from oracle.reference_lm import (
    allowed_keys,
    linear,
    rms_norm,
    rotary_table,
    swiglu,
    token_positions,
)

TINY = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=8, head_dim=8, ffn_hidden=48)
FP32_TOL = 1e-5
LAMBDA_TOL = 1e-3
"""λ is one scalar per layer (DIFF V1 Eq.2), so the gradient of its four vectors is one sum
over every query, head and channel of terms of both signs; fp32 gets such a sum right relative
to the sum of its terms' magnitudes, not to its value (tests/test_oracle_parity.py measures
that condition number; here up to 3e-5 is seen in fp32). Using λ wrongly moves it by O(1)."""
PAD = 3

CASES = {
    # name: (options, n_kv_heads); H_s, H_n, G in the comments
    "r3-one-noise-per-group": ({"ratio": 3}, 4),  # 6, 2, 2
    "r3-one-group": ({"ratio": 3}, 2),  # 6, 2, 1
    "r2-outputs": ({"ratio": 2, "head_budget": "outputs"}, 4),  # 4, 2, 2
    "r2-explicit-noise": ({"ratio": 2, "n_noise_heads": 4}, 4),  # 8, 4, 2 (12 query heads)
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: intra-op threading only adds overhead (and stalls on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gda_config(options: dict, n_kv_heads: int, backend: str = "reference", **changes):
    fields = {**TINY, "n_kv_heads": n_kv_heads, "backend": backend, **changes}
    return ModelConfig(attention="gda", attention_options={"gda": dict(options)}, **fields)


def build_model(config: ModelConfig, seed: int = 0) -> DiffTransformerLM:
    """The model in fp32 with every parameter moved away from its init (so identities that
    hold only there, such as unit norm weights or λ = λ_init, hide nothing)."""
    torch.manual_seed(seed)
    model = DiffTransformerLM(config).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.add_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


def oracle_logits(config: ModelConfig, params, ids, mask=None) -> torch.Tensor:
    """Logits ``(B, N, V)`` of the LM around ``oracle.gda.gda_attention`` (V1 Eq.4-5: pre-norm
    blocks, SwiGLU, final norm, untied head), one row at a time."""
    options, eps = config.options_of("gda"), config.norm_eps
    rows = []
    for b in range(ids.shape[0]):
        row = None if mask is None else mask[b]
        positions = token_positions(row, ids.shape[1])
        rot = rotary_table(positions, config.dim_per_head, config.rope_theta, config.rope_style)
        allowed = allowed_keys(row, ids.shape[1], ids.device)
        x = params["embed_tokens.weight"][ids[b]]
        for layer in range(config.n_layers):
            p = f"layers.{layer}"
            h = rms_norm(x, params[f"{p}.attn_norm.weight"], eps)
            x = x + gda_attention(config, options, params, f"{p}.attn", layer, h, rot, allowed)
            x = x + swiglu(rms_norm(x, params[f"{p}.ffn_norm.weight"], eps), params, f"{p}.ffn")
        rows.append(linear(rms_norm(x, params["norm.weight"], eps), params["lm_head.weight"]))
    return torch.stack(rows)


def batch(n: int, vocab: int, padded: bool, seed: int = 0):
    """``(ids (2, n), mask or None)``: row 1 left-padded by up to ``PAD`` tokens."""
    ids = torch.randint(1, vocab, (2, n), generator=torch.Generator().manual_seed(100 + seed))
    if not padded:
        return ids, None
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, : min(PAD, n - 1)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def loss_weights(shape, real) -> torch.Tensor:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return w * real[..., None]


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def rel_norm(g: torch.Tensor, ref: torch.Tensor) -> float:
    return ((g - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def model_run(model, ids, weights, dtype, **inputs):
    """Logits and every parameter's gradient of ``sum(logits · weights)``, in ``dtype``."""
    model = model.to(dtype)
    model.zero_grad()
    logits = model(ids, **inputs).logits
    (logits * weights.to(dtype)).sum().backward()
    grads = {name: p.grad.detach().double() for name, p in model.named_parameters()}
    return logits.detach().double(), grads


def oracle_run(config, model, ids, mask, weights):
    params = {k: p.detach().double().requires_grad_() for k, p in model.named_parameters()}
    logits = oracle_logits(config, params, ids, mask)
    (logits * weights).sum().backward()
    return logits.detach(), {k: p.grad for k, p in params.items()}


def check_gradients(grads, ref, single_token: bool) -> None:
    """Every gradient to ``FP32_TOL`` relative to its norm, λ's vectors to ``LAMBDA_TOL``."""
    failures = []
    for name, g_ref in ref.items():
        if single_token and (name.endswith(("q_proj.weight", "k_proj.weight")) or "lambda" in name):
            # one key per query: softmax is 1 whatever the score (no W_Q, W_K gradient), and
            # the head norm leaves λ only its eps; both vanish up to rounding
            assert grads[name].norm() <= 1e-4 * max(r.norm() for r in ref.values()), name
            continue
        assert g_ref.norm() > 0, f"{name}: the oracle's gradient is zero, the check is vacuous"
        tol = LAMBDA_TOL if "lambda" in name else FP32_TOL
        if rel_norm(grads[name], g_ref) > tol:
            failures.append(f"{name}: {rel_norm(grads[name], g_ref):.2e} > {tol:.0e}")
    assert not failures, "\n".join(failures)


def check_against_oracle(config, n: int, padded: bool, seed: int = 0) -> None:
    """The fp32 model against the fp64 oracle: logits on real tokens to ``FP32_TOL``, the
    gradient of every parameter to ``FP32_TOL`` (λ's vectors to ``LAMBDA_TOL``)."""
    model = build_model(config, seed)
    ids, mask = batch(n, config.vocab_size, padded, seed)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    weights = loss_weights((*ids.shape, config.vocab_size), real)
    ref_logits, ref_grads = oracle_run(config, model, ids, mask, weights)
    logits, grads = model_run(model, ids, weights, torch.float32, attention_mask=mask)
    assert rel_max(logits[real], ref_logits[real]) <= FP32_TOL
    check_gradients(grads, ref_grads, single_token=n == 1)


# --- the oracle -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 129])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_gradients_equal_the_oracle(case, n):
    options, kv = CASES[case]
    check_against_oracle(gda_config(options, kv), n, padded=n > 1)


@pytest.mark.parametrize("backend", ["sdpa", "fused"])
@pytest.mark.parametrize("case", ["r3-one-group", "r2-explicit-noise"])
def test_backends_equal_the_oracle(case, backend):
    options, kv = CASES[case]
    check_against_oracle(gda_config(options, kv, backend), 33, padded=True, seed=2)


@pytest.mark.parametrize(
    "changes",
    [
        {"head_norm": False},
        {"head_norm_learnable": False, "lambda_init": 0.4},
        {"rope_style": "interleaved"},
    ],
    ids=str,
)
def test_diff_v1_fields_reach_the_layer(changes):
    check_against_oracle(gda_config({"ratio": 3}, 2, **changes), 9, padded=True, seed=3)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "fused"])
def test_packed_documents_equal_the_oracle_on_each_document(backend):
    config = gda_config({"ratio": 3}, 2, backend)
    model = build_model(config, seed=4)
    lengths = [7, 1, 20]
    ids = torch.randint(1, config.vocab_size, (1, sum(lengths)))
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    weights = loss_weights((*ids.shape, config.vocab_size), torch.ones_like(ids, dtype=torch.bool))
    logits, grads = model_run(model, ids, weights, torch.float32, document_ids=document_ids)
    params = {k: p.detach().double().requires_grad_() for k, p in model.named_parameters()}
    pieces = [oracle_logits(config, params, doc) for doc in ids.split(lengths, dim=1)]
    ref = torch.cat(pieces, dim=1)
    (ref * weights).sum().backward()
    assert rel_max(logits, ref.detach()) <= FP32_TOL
    check_gradients(grads, {k: p.grad for k, p in params.items()}, single_token=False)


# --- ratio 1 is DIFF V1 -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "sdpa", "fused"])
@pytest.mark.parametrize(
    "options",
    [{"ratio": 1}, {"ratio": 1, "head_budget": "outputs"}, {"ratio": 1, "n_noise_heads": 4}],
    ids=["queries", "outputs", "explicit"],
)
def test_ratio_one_is_diff_v1_bit_for_bit(options, backend):
    config = gda_config(options, 4, backend)
    gda = build_model(config, seed=5)
    v1 = DiffTransformerLM(config.replace(attention="diff_v1", attention_options={}))
    v1.load_state_dict(gda.state_dict())
    ids, mask = batch(17, config.vocab_size, True, seed=5)
    weights = loss_weights((*ids.shape, config.vocab_size), mask.bool()).float()
    outputs = []
    for model in (gda, v1):
        logits = model(ids, attention_mask=mask).logits
        (logits * weights).sum().backward()
        outputs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (a, grads_a), (b, grads_b) = outputs
    assert torch.equal(a, b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_maps_of_a_group_share_the_noise_map():
    """``output_attentions``: one applied map per signal head, ``A1_i − λ·A2_{i // r}``, where
    the signal heads of a group read the same noise map (D2); the observed forward computes
    the model's logits."""
    config = gda_config({"ratio": 3}, 2)
    model = build_model(config, seed=7).eval()
    ids, mask = batch(11, config.vocab_size, True, seed=7)
    recorder = MapRecorder({0})
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        out = model(ids, attention_mask=mask, output_attentions=True)
        with observing(recorder):
            model(ids, attention_mask=mask)
    assert rel_max(out.logits, plain) <= FP32_TOL
    (event,) = recorder.take(0)
    a1, a2 = event.probs["a1"], event.probs["a2"]
    assert out.attentions[0].shape == a2.shape == (2, 6, 11, 11)  # H_s = 6 signal heads
    for i in range(6):
        assert torch.equal(a2[:, i], a2[:, 3 * (i // 3)]), i  # noise head i // 3
    assert (a2[:, 0] - a2[:, 3]).abs().max() > 1e-3  # two noise heads, two maps
    lam = model.layers[0].attn.lambda_full()
    torch.testing.assert_close(out.attentions[0], a1 - lam * a2)


def test_the_probe_watches_gda_layers_as_declared():
    """The capture probe: H_s output heads of width 2d, DIFF V1's entry point, one λ per
    layer (Eq.2) in ``lambda``, head outputs split as W_O reads them."""
    config = gda_config({"ratio": 3}, 2, "auto", layer_types="gda,baseline")
    model = build_model(config, seed=8)
    ids = torch.randint(0, config.vocab_size, (1, 9))
    lam, outputs, maps = Lambda(), HeadOutputs(), AttentionMaps(what=("applied", "lam"))
    with Probe(model, [lam, outputs, maps]) as probe, torch.no_grad():
        model(ids)
        views = [(v.kind, v.differential, v.out_heads, v.out_head_dim) for v in probe.layers]
    d = config.dim_per_head
    assert views == [(ENTRY_DIFF, True, 6, 2 * d), (ENTRY_SOFTMAX, False, 8, d)]
    assert outputs.result()[0][0]["output"].shape == (1, 6, 9, 2 * d)
    want = float(model.layers[0].attn.lambda_full().detach())
    assert lam.result()["lambda"][0] == pytest.approx(want, abs=1e-7)
    assert math.isnan(lam.result()["lambda"][1])
    assert maps.result()[0][0]["applied"].shape == (1, 6, 9, 9)


# --- the cache ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_chunked_prefill_then_decode_equals_the_full_forward(cache_kind, backend):
    config = gda_config({"ratio": 3}, 2, backend, max_seq_len=40)
    model = build_model(config, seed=6).eval()
    ids, mask = batch(21, config.vocab_size, True, seed=6)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = DynamicCache() if cache_kind == "dynamic" else StaticCache(config, 2, 32)
        pieces, start = [], 0
        for stop in (9, 14, *range(15, 22)):  # two prefill chunks, then one token at a time
            out = model(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache)
            pieces.append(out.logits)
            start = stop
    real = mask.bool()
    assert rel_max(torch.cat(pieces, dim=1)[real], full[real]) <= FP32_TOL


# --- the declaration ----------------------------------------------------------------------------


def total(config: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in DiffTransformerLM(config).parameters())


PARAMETER_CASES = [
    *CASES.values(),
    ({"ratio": 1}, 4),
    ({"ratio": 3}, 2, {"head_norm_learnable": False}),
    ({"ratio": 7}, 2, {"n_heads": 16, "head_dim": 4}),
]


@pytest.mark.parametrize("case", PARAMETER_CASES, ids=str)
def test_extra_parameters_are_the_real_difference(case):
    options, kv, *changes = case
    config = gda_config(options, kv, **(changes[0] if changes else {}))
    baseline = config.replace(attention="baseline", attention_options={})
    declaration = attention_type("gda")
    assert declaration.extra_parameters(config) * config.n_layers == total(config) - total(baseline)
    assert presets.extra_parameters(config) == total(config) - total(baseline)
    budget = gda_parameter_budget(config, config.options_of("gda"))
    v1_extra = attention_type("diff_v1").extra_parameters(config)
    assert declaration.extra_parameters(config) == budget["extra"] + v1_extra
    shapes = gda_parameter_shapes(config, config.options_of("gda"))
    layer = DiffTransformerLM(config).layers[0].attn
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == shapes
    assert declaration.query_heads(config) == budget["n_query"]
    assert (
        declaration.output_heads(config) * declaration.output_width(config)
        == (shapes["o_proj.weight"][1])
    )


@pytest.mark.parametrize("multiple_of", [1, 8])
def test_match_params_gives_the_baseline_total(multiple_of):
    """W_O grows by ``D·d·n_heads·(r − 1)/(r + 1)`` a layer; the narrowed FFN gives it back
    to within ``1.5·multiple_of·d_model·n_layers`` (``presets.match_v2_params``)."""
    config = gda_config({"ratio": 3}, 2)
    baseline = config.replace(attention="baseline", attention_options={})
    matched = presets.match_v2_params(config, multiple_of)
    assert matched.ffn_dim < config.ffn_dim
    assert matched.attention_options == config.attention_options
    gap = abs(total(matched) - total(baseline))
    assert gap <= 1.5 * multiple_of * config.d_model * config.n_layers
    if multiple_of == 1:  # the oracle's rule, to the unit (it leaves λ and the norm out)
        assert (
            abs(matched.ffn_dim - gda_parameter_budget(config, {"ratio": 3})["matched_ffn_hidden"])
            <= 1
        )


def test_ratio_one_matches_like_diff_v1_and_counts_its_flops():
    config = gda_config({"ratio": 1}, 4)
    v1 = config.replace(attention="diff_v1", attention_options={})
    gda, diff_v1 = attention_type("gda"), attention_type("diff_v1")
    assert not gda.matches_by_ffn(config)
    with pytest.raises(ValueError, match="matched by construction"):
        presets.match_v2_params(config)
    for form in ("qk_once", "v_once", "split_v"):
        assert gda.attention_flops_for_keys(config, 100.0, form) == (
            diff_v1.attention_flops_for_keys(v1, 100.0, form)
        )
    assert gda.cache_layout(config) == diff_v1.cache_layout(v1)
    r3 = gda_config({"ratio": 3}, 2)  # as computed: DIFF V1 over 6 differential heads
    twin = r3.replace(attention="diff_v1", attention_options={}, n_heads=12, head_dim=8)
    for form in ("qk_once", "v_once", "split_v"):
        assert gda.attention_flops_for_keys(r3, 100.0, form) == (
            diff_v1.attention_flops_for_keys(twin, 100.0, form)
        )
    assert "6 signal and 2 noise heads" in gda.describe(r3)


@pytest.mark.parametrize(
    ("options", "n_kv", "field"),
    [
        ({"ratio": 0}, 4, "attention_options.gda.ratio"),
        ({"ratio": "3"}, 4, "attention_options.gda.ratio"),
        ({"ratio": True}, 4, "attention_options.gda.ratio"),
        ({"ratio": 2}, 4, "attention_options.gda.ratio"),  # 3 does not divide 8 query heads
        ({"ratio": 3}, 8, "attention_options.gda.ratio"),  # 2 noise heads, 4 KV groups
        ({"head_budget": "maps"}, 4, "attention_options.gda.head_budget"),
        ({"n_noise_heads": 0}, 4, "attention_options.gda.n_noise_heads"),
        ({"n_noise_heads": 3}, 4, "attention_options.gda.n_noise_heads"),  # over 2 groups
        ({"ratoi": 3}, 4, "attention_options.gda.ratoi"),
        ({"ratio": 1}, 3, "n_kv_heads"),
    ],
    ids=str,
)
def test_bad_options_name_the_option(options, n_kv, field):
    with pytest.raises(ValueError, match=rf"^ModelConfig\.{field}: ") as error:
        gda_config(options, n_kv, n_heads=12 if n_kv == 3 else 8)
    assert "\n" not in str(error.value)


def test_options_parse_from_text_and_survive_the_config_round_trip():
    declaration = attention_type("gda")
    ratio, budget, noise = declaration.options
    assert (ratio.parse("4"), budget.parse("outputs"), noise.parse("none"), noise.parse("2")) == (
        4,
        "outputs",
        None,
        2,
    )
    config = gda_config({"ratio": 3, "n_noise_heads": 2, "head_budget": "queries"}, 2)
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert config.options_of("gda") == {"ratio": 3, "head_budget": "queries", "n_noise_heads": 2}
