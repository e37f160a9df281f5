"""Parity of ``DiffTransformerLM`` with the slow oracle in ``tests/oracle/reference_lm.py``.

Each case builds a tiny model, moves every parameter away from its initial value (so identities
that hold only at init, such as unit norm weights or λ = λ_init, cannot hide a bug), and compares
with the oracle evaluated in fp64 on the same parameters:

* logits on real (non-pad) tokens: ``max|a - b| / max|b|``;
* the gradient of every named parameter of one scalar loss, ``sum(logits * W)`` over real tokens
  with a fixed random ``W``: ``||g - g_ref|| / ||g_ref||``.

DIFF V1's λ vectors are the one exception to a flat relative tolerance. λ is one scalar per layer
(Eq.2), so their gradients are ``dL/dλ · ∂λ/∂λ_*`` where ``dL/dλ`` sums one term per query, head
and channel (``−dL/dhead ⊙ A2 V``). Those terms often cancel (the per-head RMSNorm of Eq.3 is
scale invariant, so for a query that sees a single key they cancel exactly), and fp32 can only
be expected to get such a sum right relative to the sum of the magnitudes of its terms. The
oracle reports the terms (``lambda_probes``), and these gradients are checked against
``tol · Σ|terms| / |Σ terms|`` (the condition number of that sum, at least 1).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch

import diffattn
from oracle.reference_lm import oracle_forward

FP32_TOL = 1e-5
BF16_TOL = 2e-2
PAD = 3  # pad tokens in row 1 of a padded batch

TINY = dict(
    vocab_size=61,
    d_model=64,
    n_layers=2,
    n_heads=8,
    head_dim=8,
    ffn_hidden=96,
    max_seq_len=256,
)


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: intra-op threading only adds overhead (and stalls on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_config(attention: str, backend: str, ratio: int = 1, **changes) -> diffattn.ModelConfig:
    fields = {**TINY, "attention": attention, "backend": backend}
    fields["n_kv_heads"] = fields["n_heads"] // ratio
    fields.update(changes)
    return diffattn.ModelConfig(**fields)


def skip_unless_backend_runs(backend: str) -> None:
    if backend != "flash":
        return
    if not torch.cuda.is_available():
        pytest.skip("flash backend needs CUDA")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash backend needs the flash_attn package")


def device_and_dtype(backend: str) -> tuple[torch.device, torch.dtype, float]:
    """Flash runs on CUDA in bf16 only, so it gets the loose bf16 tolerance."""
    if backend == "flash":
        return torch.device("cuda"), torch.bfloat16, BF16_TOL
    return torch.device("cpu"), torch.float32, FP32_TOL


def build_model(cfg: diffattn.ModelConfig, seed: int = 0) -> diffattn.DiffTransformerLM:
    """The model in fp32 with every parameter perturbed away from its init."""
    torch.manual_seed(seed)
    model = diffattn.DiffTransformerLM(cfg).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.ndim == 1:  # norm weights, λ vectors
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            else:  # O(1) activations and peaked (non-uniform) attention
                p.add_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


def make_batch(n: int, padding: str, vocab: int, seed: int = 0):
    """``(input_ids (2, n), attention_mask or None)``; row 1 padded by ``PAD`` on one side.

    ``"gaps"``: row 0 has one pad token in front and one in the middle, row 1 two runs of pads
    inside the sequence (RoPE positions count real tokens only, so the gaps shift positions).
    """
    gen = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(1, vocab, (2, n), generator=gen)
    if padding == "none":
        return ids, None
    mask = torch.ones(2, n, dtype=torch.long)
    if padding == "left":
        mask[1, :PAD] = 0
    elif padding == "right":
        mask[1, n - PAD :] = 0
    elif padding == "gaps":
        mask[0, [0, n // 2]] = 0
        mask[1, 3:5] = 0
        mask[1, n - 6 : n - 5] = 0
    else:
        raise ValueError(padding)
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def real_tokens(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def rel_norm(g: torch.Tensor, g_ref: torch.Tensor) -> float:
    return ((g - g_ref).norm() / max(g_ref.norm().item(), 1e-12)).item()


def zero_grad_params(cfg: diffattn.ModelConfig, ids: torch.Tensor) -> dict[str, float]:
    """Parameters whose gradient vanishes for a single token, with the oracle's bound on it
    (relative to the largest gradient).

    With one token the only attention weight is softmax([s]) = 1 whatever the score, so W_Q
    and W_K get exactly no gradient. DIFF V1 with the per-head norm then outputs
    RMSNorm((1 − λ)·v), which depends on λ only through the norm's eps, so the λ vectors'
    gradient is O(eps): fp32 may round it to exactly zero.
    """
    if ids.shape[1] > 1:
        return {}
    bounds = {
        f"layers.{l}.attn.{name}_proj.weight": 1e-12
        for l in range(cfg.n_layers)
        for name in ("q", "k")
    }
    if cfg.attention == "diff_v1" and cfg.head_norm:
        for l in range(cfg.n_layers):
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                bounds[f"layers.{l}.attn.{name}"] = 10 * cfg.head_norm_eps
    return bounds


def lambda_tolerances(ref_params, probes, tol: float) -> dict[str, float]:
    """Tolerance of V1's λ-vector gradients: ``tol`` times the condition number of ``dL/dλ``.

    Also checks that the probe terms add up to the oracle's ``dL/dλ`` (via
    ``∂λ/∂λ_q1 = exp(λ_q1·λ_k1) λ_k1``), so the condition number is measured on the right sum.
    """
    out = {}
    for l, probe in probes.items():
        a = f"layers.{l}.attn"
        terms = probe.grad
        dl_dlam = terms.sum()
        lq1, lk1 = ref_params[f"{a}.lambda_q1"], ref_params[f"{a}.lambda_k1"]
        expected = dl_dlam * torch.exp((lq1 * lk1).sum()).detach() * lk1.detach()
        torch.testing.assert_close(lq1.grad, expected, rtol=1e-9, atol=1e-12)
        cond = (terms.abs().sum() / dl_dlam.abs().clamp_min(1e-300)).item()
        for v in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            out[f"{a}.{v}"] = tol * max(1.0, cond)
    return out


def check_parity(cfg: diffattn.ModelConfig, n: int, padding: str, seed: int = 0) -> None:
    """Logits and every parameter gradient of the model against the fp64 oracle."""
    device, dtype, tol = device_and_dtype(cfg.backend)
    model = build_model(cfg, seed).to(device=device, dtype=dtype)
    ids, mask = make_batch(n, padding, cfg.vocab_size, seed)
    real = real_tokens(ids, mask)
    loss_w = torch.randn(*ids.shape, cfg.vocab_size, generator=torch.Generator().manual_seed(7))
    loss_w = loss_w * real[..., None]

    # model
    out = model(ids.to(device), attention_mask=None if mask is None else mask.to(device))
    logits = out.logits.float().cpu()
    (out.logits.float() * loss_w.to(device)).sum().backward()
    named = dict(model.named_parameters())

    # oracle, fp64 on CPU, same parameter values
    ref_params = {k: p.detach().cpu().double().requires_grad_() for k, p in named.items()}
    probes = None
    if cfg.attention == "diff_v1":
        shape = (*ids.shape[:1], cfg.n_heads // 2, ids.shape[1], 2 * cfg.dim_per_head)
        probes = {
            l: torch.zeros(shape, dtype=torch.float64, requires_grad=True)
            for l in range(cfg.n_layers)
        }
    ref_logits = oracle_forward(cfg, ref_params, ids, mask, lambda_probes=probes)
    (ref_logits * loss_w.double()).sum().backward()
    grad_tol = {name: tol for name in named}
    if probes is not None:
        grad_tol.update(lambda_tolerances(ref_params, probes, tol))

    assert logits.shape == ref_logits.shape == (*ids.shape, cfg.vocab_size)
    err = rel_max(logits[real].double(), ref_logits.detach()[real])
    assert err <= tol, f"logits: rel err {err:.3e} > {tol:.0e}"

    vanishing = zero_grad_params(cfg, ids)
    failures = []
    for name, p in named.items():
        assert p.grad is not None, f"{name}: no gradient"
        assert ref_params[name].grad is not None, f"{name}: the oracle does not use it"
        g, g_ref = p.grad.detach().double().cpu(), ref_params[name].grad
        if name in vanishing:
            # exact zero in exact arithmetic: the model's gradient must be negligible
            scale = max(q.grad.norm().item() for q in ref_params.values())
            assert g_ref.norm() <= vanishing[name] * scale, f"{name}: oracle grad should vanish"
            assert g.norm() <= tol * scale, f"{name}: grad {g.norm():.3e} should vanish"
            continue
        assert g_ref.norm() > 0, f"{name}: oracle gradient is zero, test would be vacuous"
        assert g.norm() > 0, f"{name}: model gradient is zero"
        e = rel_norm(g, g_ref)
        if not e <= grad_tol[name]:
            failures.append(f"{name}: rel err {e:.3e} > {grad_tol[name]:.1e}")
    assert not failures, "gradient mismatch:\n" + "\n".join(failures)


# --- the grid --------------------------------------------------------------------------------

ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
BACKENDS = ("reference", "sdpa", pytest.param("flash", marks=pytest.mark.gpu))
CASES = [(1, "none")] + [(n, p) for n in (7, 64, 129) for p in ("none", "left", "right")]


@pytest.mark.parametrize(("n", "padding"), CASES, ids=[f"n{n}-{p}" for n, p in CASES])
@pytest.mark.parametrize("ratio", (1, 2, 4), ids=lambda r: f"gqa{r}")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_parity_grid(attention: str, backend: str, ratio: int, n: int, padding: str) -> None:
    """Every attention type and backend, at GQA ratios n_heads/n_kv_heads of 1, 2 and 4."""
    skip_unless_backend_runs(backend)
    check_parity(make_config(attention, backend, ratio), n, padding)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_parity_mask_with_gaps(attention: str, backend: str) -> None:
    """Pads inside the sequence: masked as keys, and skipped by the RoPE positions."""
    skip_unless_backend_runs(backend)
    check_parity(make_config(attention, backend, ratio=2), n=20, padding="gaps", seed=5)


# --- ablations and config switches (one length each) -----------------------------------------

VARIANTS = {
    "v2-unpaired": ("diff_v2", {"v2_paired_heads": False}),
    "v2-no-lambda": ("diff_v2", {"v2_use_lambda": False}),
    "v2-no-sigmoid": ("diff_v2", {"v2_lambda_sigmoid": False}),
    "v1-no-head-norm": ("diff_v1", {"head_norm": False}),
    "v1-fixed-head-norm": ("diff_v1", {"head_norm_learnable": False}),
    "v1-lambda-init-0.5": ("diff_v1", {"lambda_init": 0.5}),
    **{
        f"{a}-interleaved": (a, {"rope_style": "interleaved"})
        for a in ("baseline", "diff_v1", "diff_v2")
    },
    **{f"{a}-tied": (a, {"tie_embeddings": True}) for a in ("baseline", "diff_v1", "diff_v2")},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_variants(variant: str, backend: str) -> None:
    """The V1/V2 ablation switches, constant λ_init, interleaved RoPE and tied embeddings."""
    skip_unless_backend_runs(backend)
    attention, changes = VARIANTS[variant]
    cfg = make_config(attention, backend, ratio=2, **changes)
    check_parity(cfg, n=33, padding="left", seed=3)


def test_variants_change_the_model() -> None:
    """Each switch changes the logits, so a model that ignored it would fail parity."""
    ids, mask = make_batch(33, "left", TINY["vocab_size"], seed=3)
    for variant, (attention, changes) in sorted(VARIANTS.items()):
        if "tie_embeddings" in changes:
            continue  # different parameter set, not comparable
        base_cfg = make_config(attention, "reference", ratio=2)
        cfg = make_config(attention, "reference", ratio=2, **changes)
        params = {k: p.detach().double() for k, p in build_model(base_cfg, 3).named_parameters()}
        a = oracle_forward(base_cfg, params, ids, mask)
        b = oracle_forward(cfg, params, ids, mask)
        assert rel_max(a[mask.bool()], b[mask.bool()]) > 1e-3, variant


def test_lambda_init_schedule_values() -> None:
    """λ_init(l) = 0.8 − 0.6·exp(−0.3·(l−1)), 1-based l (V1 Eq.2): 0.2000, 0.3555, …"""
    cfg = make_config("diff_v1", "reference")
    got = [cfg.lambda_init_for_layer(l) for l in range(4)]
    assert got == pytest.approx([0.2, 0.35550, 0.47071, 0.55606], abs=1e-5)
    cfg = dataclasses.replace(cfg, lambda_init=0.5)
    assert cfg.lambda_init_for_layer(3) == 0.5


# --- padding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ("left", "right"))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_padded_row_matches_unpadded(attention: str, backend: str, padding: str) -> None:
    """Row 1's real tokens give the same logits as the same tokens run alone without a mask."""
    skip_unless_backend_runs(backend)
    device, dtype, tol = device_and_dtype(backend)
    cfg = make_config(attention, backend, ratio=2)
    model = build_model(cfg).to(device=device, dtype=dtype)
    ids, mask = make_batch(40, padding, cfg.vocab_size)
    real = mask[1].bool()
    with torch.no_grad():
        padded = model(ids.to(device), attention_mask=mask.to(device)).logits[1][real.to(device)]
        alone = model(ids[1:2, real].to(device)).logits[0]
        ones = model(ids.to(device), attention_mask=torch.ones_like(mask).to(device)).logits
        plain = model(ids.to(device)).logits
    assert rel_max(padded.float(), alone.float()) <= tol
    assert rel_max(ones.float(), plain.float()) <= tol
