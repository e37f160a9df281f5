"""The Grouped Differential Attention oracle (``tests/oracle/gda.py``) checked on its own terms.

* ``ratio = 1`` is DIFF V1: the same parameters give exactly ``diff_v1_attention``'s output,
  and the parameter names and shapes are those of diffattn's DIFF V1 layer.
* ``ratio = r`` is DIFF V1 with each noise query head repeated over its r signal heads (the
  "controlled repetition, akin to GQA" of the paper), checked against ``diff_v1_attention`` on
  a DIFF V1 layer built by copying the noise rows.
* ratios 2 and 3 run on lengths 1, 7 and 129 with causal masking and padding; the output is
  finite and the gradient reaches every parameter.
* group-differentiated growth (replicating signal heads only) keeps the layer's function, or
  scales it by the growth factor without the W_O split.

Everything in fp64 on tiny sizes, seeds fixed.
"""

from __future__ import annotations

import pytest
import torch

import diffattn
from diffattn.config import ModelConfig
from oracle.gda import (
    gda_attention,
    gda_heads,
    gda_parameter_budget,
    gda_parameter_shapes,
    grow_signal_heads,
)
from oracle.reference_lm import allowed_keys, diff_v1_attention, rotary_table, token_positions

PREFIX = "layers.1.attn"
LAYER = 1
D_MODEL, HEAD_DIM = 24, 4


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: intra-op threading only adds overhead (and stalls on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_config(n_heads: int, n_kv_heads: int, **changes) -> ModelConfig:
    fields = dict(
        attention="diff_v1",
        vocab_size=32,
        d_model=D_MODEL,
        n_layers=3,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=HEAD_DIM,
        ffn_hidden=48,
    )
    fields.update(changes)
    return ModelConfig(**fields)


def random_params(config: ModelConfig, options: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp64 leaves of the shapes :func:`gda_parameter_shapes` names, away from any init value."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in sorted(gda_parameter_shapes(config, options).items()):
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        if name == "head_norm.weight":
            t = 1.0 + 0.2 * t
        elif len(shape) == 1:  # λ vectors
            t = 0.3 * t
        else:  # O(1) activations, peaked attention
            t = t / shape[-1] ** 0.5
        params[f"{PREFIX}.{name}"] = t.requires_grad_()
    return params


def sequence(config: ModelConfig, n: int, padded: bool, seed: int = 0):
    """``(x (N, D), rot, allowed, real)`` for one row; a padded row has three pads in front
    (fewer when shorter) and, from 7 tokens on, one in the middle."""
    gen = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(n, config.d_model, generator=gen, dtype=torch.float64)
    mask = None
    if padded:
        mask = torch.ones(n, dtype=torch.long)
        mask[: min(3, n)] = 0
        if n >= 7:
            mask[n // 2 + 1] = 0
    positions = token_positions(mask, n)
    rot = rotary_table(positions, config.dim_per_head, config.rope_theta, config.rope_style)
    allowed = allowed_keys(mask, n, x.device)
    real = torch.ones(n, dtype=torch.bool) if mask is None else mask.bool()
    return x, rot, allowed, real


def run(config, options, params, x, rot, allowed):
    return gda_attention(config, options, params, PREFIX, LAYER, x, rot, allowed)


# --- ratio 1 is DIFF V1 ----------------------------------------------------------------------

V1_CASES = [
    dict(n_heads=8, n_kv_heads=8),  # MHA
    dict(n_heads=8, n_kv_heads=4),  # GQA, 2 differential heads per KV group
    dict(n_heads=8, n_kv_heads=2),  # one KV group
    dict(n_heads=12, n_kv_heads=4, rope_style="interleaved", lambda_init=0.3),
    dict(n_heads=8, n_kv_heads=4, head_norm=False),
    dict(n_heads=8, n_kv_heads=4, head_norm_learnable=False),
]
V1_OPTIONS = [
    {"ratio": 1},
    {"ratio": 1, "head_budget": "outputs"},
]


@pytest.mark.parametrize("case", V1_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("options", V1_OPTIONS, ids=["queries", "outputs"])
@pytest.mark.parametrize("padded", [False, True])
def test_ratio_one_equals_diff_v1_exactly(case, options, padded):
    config = make_config(**case)
    params = random_params(config, options, seed=1)
    x, rot, allowed, _ = sequence(config, 9, padded, seed=1)
    ours = run(config, options, params, x, rot, allowed)
    theirs = diff_v1_attention(config, params, PREFIX, LAYER, x, rot, allowed)
    assert torch.equal(ours, theirs)
    explicit = {"ratio": 1, "n_noise_heads": config.n_heads // 2}
    assert torch.equal(run(config, explicit, params, x, rot, allowed), theirs)


@pytest.mark.parametrize("case", V1_CASES[:3] + V1_CASES[-1:])
def test_ratio_one_parameters_are_diffattn_diff_v1s(case):
    """Names and shapes of ``gda_parameter_shapes`` at ratio 1 are those of the library's
    DIFF V1 layer."""
    config = make_config(**case)
    model = diffattn.DiffTransformerLM(config)
    prefix = "layers.0.attn."
    library = {
        name[len(prefix) :]: tuple(p.shape)
        for name, p in model.named_parameters()
        if name.startswith(prefix)
    }
    assert gda_parameter_shapes(config, {"ratio": 1}) == library
    assert gda_parameter_budget(config, {"ratio": 1})["extra"] == 0


# --- ratio r is DIFF V1 with the noise heads repeated ------------------------------------------

GROUPED_CASES = [
    (dict(n_heads=12, n_kv_heads=2), {"ratio": 2}),
    (dict(n_heads=12, n_kv_heads=4), {"ratio": 2}),
    (dict(n_heads=12, n_kv_heads=2), {"ratio": 3}),
    (dict(n_heads=12, n_kv_heads=6), {"ratio": 3}),
    (dict(n_heads=12, n_kv_heads=6), {"ratio": 2, "head_budget": "outputs"}),
    (dict(n_heads=8, n_kv_heads=4), {"ratio": 3, "n_noise_heads": 2}),
]
CASE_IDS = [
    f"h{c['n_heads']}-kv{c['n_kv_heads']}-{'-'.join(map(str, o.values()))}"
    for c, o in GROUPED_CASES
]


def repeated_noise_params(config, options, params) -> dict[str, torch.Tensor]:
    """DIFF V1 parameters computing the same as GDA: differential head i = (signal head i,
    noise head i // r); written from the layout in the oracle's docstring, not its helpers."""
    r = gda_heads(config, options).ratio
    d = config.dim_per_head
    wq = params[f"{PREFIX}.q_proj.weight"]
    n_query = wq.shape[0] // d
    blocks = [wq[b * d : (b + 1) * d] for b in range(n_query)]
    signal = [blk for b, blk in enumerate(blocks) if b % (r + 1) != r]
    noise = [blk for b, blk in enumerate(blocks) if b % (r + 1) == r]
    rows = []
    for i, s in enumerate(signal):
        rows += [s, noise[i // r]]
    return {**params, f"{PREFIX}.q_proj.weight": torch.cat(rows)}


@pytest.mark.parametrize(("case", "options"), GROUPED_CASES, ids=CASE_IDS)
def test_ratio_r_is_diff_v1_with_repeated_noise_heads(case, options):
    config = make_config(**case)
    heads = gda_heads(config, options)
    params = random_params(config, options, seed=2)
    x, rot, allowed, _ = sequence(config, 11, True, seed=2)
    ours = run(config, options, params, x, rot, allowed)
    twin_config = config.replace(n_heads=2 * heads.n_signal)
    twin = repeated_noise_params(config, options, params)
    theirs = diff_v1_attention(twin_config, twin, PREFIX, LAYER, x, rot, allowed)
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(("case", "options"), GROUPED_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n", [1, 7, 129])
@pytest.mark.parametrize("padded", [False, True])
def test_grouped_runs_and_every_parameter_learns(case, options, n, padded):
    config = make_config(**case)
    params = random_params(config, options, seed=3)
    x, rot, allowed, real = sequence(config, n, padded, seed=3)
    out = run(config, options, params, x, rot, allowed)
    assert out.shape == (n, config.d_model)
    assert torch.isfinite(out).all()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    (out * weights * real[:, None]).sum().backward()
    for name, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        # One real token sees one key: its softmax is 1 whatever the score (no W_Q, W_K
        # gradient), and the head norm makes λ matter only through its eps.
        single = int(real.sum()) <= 1 or n == 1
        if not single:
            assert p.grad.abs().max() > 0, name


def test_head_counts_and_parameter_budget():
    config = make_config(n_heads=8, n_kv_heads=4)
    d, dm, n = HEAD_DIM, D_MODEL, 8
    heads = gda_heads(config, {"ratio": 3})
    assert (heads.n_signal, heads.n_noise, heads.n_query, heads.n_groups) == (6, 2, 8, 2)
    budget = gda_parameter_budget(config, {"ratio": 3})
    assert budget["extra"] == dm * d * n * (3 - 1) // (3 + 1)  # all in W_O
    assert gda_parameter_shapes(config, {"ratio": 3})["o_proj.weight"] == (dm, 6 * 2 * d)
    assert budget["matched_ffn_hidden"] == 48 - round(budget["extra"] / (3 * dm))
    outputs = gda_parameter_budget(config, {"ratio": 2, "head_budget": "outputs"})
    assert (outputs["n_signal"], outputs["n_noise"]) == (4, 2)
    assert outputs["extra"] == -dm * d * (n // 2) * (1 - 1 / 2)  # all in W_Q
    with pytest.raises(ValueError, match="ratio \\+ 1 = 3"):
        gda_heads(config, {"ratio": 2})
    with pytest.raises(ValueError, match="KV groups"):
        gda_heads(make_config(n_heads=12, n_kv_heads=4), {"ratio": 3})
    with pytest.raises(ValueError, match="unknown option"):
        gda_heads(config, {"ratio": 3, "lambda": 1})


# --- group-differentiated growth ---------------------------------------------------------------

GROWTH = [
    (dict(n_heads=8, n_kv_heads=4), {"ratio": 1}, 2),  # DIFF V1 -> GDA 2:1
    (dict(n_heads=12, n_kv_heads=4), {"ratio": 2}, 2),  # 2:1 -> 4:1
    (dict(n_heads=8, n_kv_heads=2), {"ratio": 3}, 3),  # 3:1 -> 9:1
]


@pytest.mark.parametrize(("case", "options", "factor"), GROWTH)
@pytest.mark.parametrize("symmetry_noise", [0.0, 0.5])
def test_growth_keeps_the_function(case, options, factor, symmetry_noise):
    config = make_config(**case)
    params = random_params(config, options, seed=5)
    gen = torch.Generator().manual_seed(6)
    new_options, grown = grow_signal_heads(
        config, options, params, PREFIX, factor, symmetry_noise=symmetry_noise, generator=gen
    )
    old, new = gda_heads(config, options), gda_heads(config, new_options)
    assert (new.ratio, new.n_noise, new.n_signal) == (
        old.ratio * factor,
        old.n_noise,
        old.n_signal * factor,
    )
    assert {k[len(PREFIX) + 1 :]: tuple(v.shape) for k, v in grown.items()} == (
        gda_parameter_shapes(config, new_options)
    )
    for name in ("k_proj.weight", "v_proj.weight", "lambda_q1", "lambda_k2"):
        assert torch.equal(grown[f"{PREFIX}.{name}"], params[f"{PREFIX}.{name}"])
    d = config.dim_per_head
    wq_old, wq_new = params[f"{PREFIX}.q_proj.weight"], grown[f"{PREFIX}.q_proj.weight"]
    for j in range(old.n_noise):  # noise heads: unchanged, not replicated
        assert torch.equal(
            wq_new[new.noise_block(j) * d : (new.noise_block(j) + 1) * d],
            wq_old[old.noise_block(j) * d : (old.noise_block(j) + 1) * d],
        )
    for n, padded in ((1, False), (7, True), (40, True)):
        x, rot, allowed, _ = sequence(config, n, padded, seed=7)
        before = run(config, options, params, x, rot, allowed)
        after = run(config, new_options, grown, x, rot, allowed)
        torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    if options["ratio"] == 1:  # grown straight from DIFF V1
        theirs = diff_v1_attention(config, params, PREFIX, LAYER, x, rot, allowed)
        torch.testing.assert_close(after, theirs, rtol=1e-12, atol=1e-12)


def test_growth_without_output_split_scales_the_output():
    config = make_config(n_heads=12, n_kv_heads=4)
    options, factor = {"ratio": 2}, 3
    params = random_params(config, options, seed=8)
    new_options, grown = grow_signal_heads(
        config, options, params, PREFIX, factor, split_output=False
    )
    x, rot, allowed, _ = sequence(config, 9, True, seed=8)
    before = run(config, options, params, x, rot, allowed)
    after = run(config, new_options, grown, x, rot, allowed)
    torch.testing.assert_close(after, factor * before, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("symmetry_noise", [0.0, 0.5])
def test_growth_copies_separate_only_with_symmetry_noise(symmetry_noise):
    """Copies of a head get identical gradients (so training never separates them) unless
    the zero-sum W_O perturbation makes them differ."""
    config = make_config(n_heads=8, n_kv_heads=4)
    options = {"ratio": 1}
    params = random_params(config, options, seed=9)
    gen = torch.Generator().manual_seed(10)
    new_options, grown = grow_signal_heads(
        config, options, params, PREFIX, 2, symmetry_noise=symmetry_noise, generator=gen
    )
    grown = {k: v.detach().requires_grad_() for k, v in grown.items()}
    x, rot, allowed, _ = sequence(config, 9, False, seed=9)
    out = run(config, new_options, grown, x, rot, allowed)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(11), dtype=out.dtype)
    (out * weights).sum().backward()
    new, d = gda_heads(config, new_options), config.dim_per_head
    grad = grown[f"{PREFIX}.q_proj.weight"].grad
    first, second = (grad[new.signal_block(i) * d : (new.signal_block(i) + 1) * d] for i in (0, 1))
    if symmetry_noise == 0.0:
        torch.testing.assert_close(first, second, rtol=1e-12, atol=1e-14)
    else:
        assert (first - second).abs().max() > 1e-3 * first.abs().max()
