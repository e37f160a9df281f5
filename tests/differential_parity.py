"""A tiny ``DiffTransformerLM`` of an attention type on DIFF V1's layout against its fp64 oracle
(``tests/oracle/``), for the types' own tests (``test_attention_dint.py``,
``test_attention_gated_diff.py``).

The model's parameters are moved away from their initial values (``build_model`` of
``test_oracle_parity.py``), then its logits and the gradient of every parameter of one scalar
loss, ``sum(logits · W)`` over real tokens with a fixed random W, are compared with the same
LM written from the equations: per batch row, the oracle's attention of the type in every layer
inside the LLaMA block of ``oracle.reference_lm``. Padding (2-D mask), packed documents
(``document_ids``) and full 4-D masks set the rows each query may attend and the RoPE positions
as the model's rule does (``diffattn.attention.mask``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import torch

import diffattn
from oracle.reference_lm import linear, rms_norm, rotary_table, swiglu
from test_oracle_parity import FP32_TOL, TINY, build_model, rel_max, rel_norm

__all__ = [
    "FP32_TOL",
    "build_model",
    "check_options_change_the_model",
    "check_parity",
    "check_tensor_parallel",
    "make_batch",
    "make_config",
    "oracle_logits",
    "rel_max",
]

Attend = Callable[..., torch.Tensor]
"""``attend(config, params, prefix, layer, x, rot, allowed) -> (N, D)``: one layer's attention
of one sequence in the oracle."""


def make_config(
    attention: str, options: dict | None = None, backend: str = "reference", **changes
) -> diffattn.ModelConfig:
    fields = {**TINY, "attention": attention, "backend": backend, **changes}
    if options:
        fields["attention_options"] = {attention: options}
    return diffattn.ModelConfig(**fields)


def make_batch(n: int, vocab: int, left_pad: int = 0, seed: int = 0):
    """``(input_ids (2, n), attention_mask or None)``: row 1 with ``left_pad`` pad tokens."""
    gen = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(1, vocab, (2, n), generator=gen)
    if not left_pad:
        return ids, None
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :left_pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def row_layout(n: int, real: Sequence[bool], docs: Sequence[int]):
    """RoPE positions and the ``(N, N)`` allowed keys of one row (``diffattn.attention.mask``):
    key j ≤ i of the same document, both real or j = i; positions count real tokens of the
    document, from 0."""
    positions, seen = [], 0
    for t in range(n):
        if t == 0 or docs[t] != docs[t - 1]:
            seen = 0
        seen += int(real[t])
        positions.append(max(seen - 1, 0))
    rows = [
        [j <= i and docs[i] == docs[j] and ((real[i] and real[j]) or i == j) for j in range(n)]
        for i in range(n)
    ]
    return positions, torch.tensor(rows, dtype=torch.bool)


def oracle_logits(
    config,
    params: dict[str, torch.Tensor],
    ids: torch.Tensor,
    attend: Attend,
    mask: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``(B, N, V)`` of the LM with ``attend`` in every layer (V1 Eq.4-5), one batch row
    at a time. ``allowed`` ``(B, N, N)``: a full mask (positions 0..N-1) instead of the rule."""
    eps = config.norm_eps
    embed = params["embed_tokens.weight"]
    lm_head = embed if config.tie_embeddings else params["lm_head.weight"]
    batch, n = ids.shape
    rows = []
    for b in range(batch):
        real = [True] * n if mask is None else [bool(m) for m in mask[b]]
        docs = [0] * n if documents is None else [int(d) for d in documents[b]]
        positions, row_allowed = row_layout(n, real, docs)
        if allowed is not None:
            positions, row_allowed = list(range(n)), allowed[b]
        rot = rotary_table(positions, config.dim_per_head, config.rope_theta, config.rope_style)
        x = embed[ids[b]]
        for layer in range(config.n_layers):
            p = f"layers.{layer}"
            h = rms_norm(x, params[f"{p}.attn_norm.weight"], eps)
            x = x + attend(config, params, f"{p}.attn", layer, h, rot, row_allowed)
            x = x + swiglu(rms_norm(x, params[f"{p}.ffn_norm.weight"], eps), params, f"{p}.ffn")
        rows.append(linear(rms_norm(x, params["norm.weight"], eps), lm_head))
    return torch.stack(rows)


def check_parity(
    model: diffattn.DiffTransformerLM,
    ids: torch.Tensor,
    attend: Attend,
    mask: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    vanishing: Mapping[str, float] | None = None,
    tol: float = FP32_TOL,
    conditions: Callable[[], dict[str, float]] | None = None,
) -> dict[str, float]:
    """Logits on real tokens (``max|a − b| / max|b|``) and every parameter's gradient
    (``‖g − g_ref‖ / ‖g_ref‖``) against the oracle in fp64, each ≤ ``tol``. Parameters whose
    names end with a key of ``vanishing`` must get a gradient that is zero in exact arithmetic,
    or of the order of a norm's eps: the oracle's at most the key's value times the largest
    gradient, the model's at most that or ``tol`` times it. Returns the errors.

    ``conditions()``, called after the oracle's backward, gives the condition number of the
    sum behind a parameter's gradient (``Σ|terms| / |Σ terms|``, measured in the oracle) for
    parameters that a per-layer scalar reaches (λ, a gate's bias): fp32 gets such a sum right
    only relative to the sum of its terms' magnitudes, so their bound is ``tol · cond``."""
    config = model.config
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    weight = torch.randn(*ids.shape, config.vocab_size, generator=torch.Generator().manual_seed(7))
    weight = weight * real[..., None]
    out = model(ids, attention_mask=mask, document_ids=documents)
    (out.logits * weight).sum().backward()
    named = dict(model.named_parameters())
    ref_params = {k: p.detach().double().requires_grad_() for k, p in named.items()}
    ref = oracle_logits(config, ref_params, ids, attend, mask, documents)
    (ref * weight.double()).sum().backward()
    bounds = {name: tol for name in named}
    for name, cond in (conditions() if conditions is not None else {}).items():
        bounds[name] = tol * max(1.0, cond)
    errors = {"logits": rel_max(out.logits.detach()[real].double(), ref.detach()[real])}
    assert errors["logits"] <= tol, f"logits: rel err {errors['logits']:.3e} > {tol:.0e}"
    scale = max(p.grad.norm().item() for p in ref_params.values())
    failures = []
    for name, p in named.items():
        assert p.grad is not None, f"{name}: no gradient"
        g, g_ref = p.grad.double(), ref_params[name].grad
        assert g_ref is not None, f"{name}: the oracle does not use it"
        bound = next((b for key, b in (vanishing or {}).items() if name.endswith(key)), None)
        if bound is not None:
            assert g_ref.norm() <= bound * scale, f"{name}: the oracle's gradient should vanish"
            limit = max(bound, tol) * scale
            assert g.norm() <= limit, f"{name}: gradient {g.norm():.3e} should vanish"
            continue
        assert g_ref.norm() > 0 and g.norm() > 0, f"{name}: zero gradient, the test is vacuous"
        errors[name] = rel_norm(g, g_ref)
        if not errors[name] <= bounds[name]:
            failures.append(f"{name}: rel err {errors[name]:.3e} > {bounds[name]:.1e}")
    assert not failures, "gradient mismatch:\n" + "\n".join(failures)
    return errors


def check_options_change_the_model(attention: str, cases: dict[str, tuple[dict, dict]]) -> None:
    """Each case's ``(options, config fields)`` changes the logits of the same weights, so a
    model that ignored it would fail the parity."""
    ids, mask = make_batch(12, TINY["vocab_size"], 3, seed=3)
    base = build_model(make_config(attention, n_kv_heads=4), 3)
    with torch.no_grad():
        reference = base(ids, attention_mask=mask).logits
        for case, (options, fields) in sorted(cases.items()):
            model = diffattn.DiffTransformerLM(
                make_config(attention, options, n_kv_heads=4, **fields)
            )
            model.load_state_dict(base.state_dict(), strict=False)
            logits = model(ids, attention_mask=mask).logits
            assert (logits - reference).abs().max() > 1e-3, case


def check_tensor_parallel(cases: Sequence[str], backend: str = "reference") -> None:
    """Two ranks (torchrun, gloo, CPU) against one process, ``tests/tp_paired_worker.py``:
    loss, logits, every gathered gradient and (types with a cache) cached decoding within 1e-5;
    every parameter gets a gradient. ``cases``: ``TYPE[:option=value,...]``."""
    from train_helpers import REPO, torchrun_target

    worker = str(REPO / "tests" / "tp_paired_worker.py")
    result = torchrun_target([worker, *cases, backend], nproc=2, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases), rows
    for row in rows:
        assert row["missing_grads"] == [] and row["sharded"] > 0, row
        for key in ("loss_diff", "logit_diff", "grad_diff", "cache_diff"):
            assert row[key] <= 1e-5, row
