"""Effective attention of a Dex head (paper App. F.3) and the attention-to-answer share (Tab. 2).

Dex changes a head's output, not its softmax map: with A = softmax(QKᵀ/√d) (N × S), the values
V (S × d) and M = I − λ W_D, the head emits O' = A V M. The *effective attention* is a map X
with X V ≈ O', i.e. the attention that would produce Dex's output from the original values.
App. F.3 estimates it in two ways:

* least squares (Eq.6): X = O' V⁺ = A V (I − λ W_D) V⁺, V⁺ the Moore–Penrose pseudo-inverse;
  the minimum-norm least-squares solution (the estimate behind Tab. 2);
* optimisation: X initialised at A and updated for 100 steps at learning rate 1e-3 on
  ||X V − O'||². The paper says "gradient descent" without naming the optimizer; Adam is the
  default here and plain gradient descent (``optimizer="sgd"``) is available.

How far the two agree depends on the shape of V (S keys × d channels):

* S ≤ d (short context, V of full row rank): min ||X V − O'|| has one minimiser, which both
  estimates target; X V = O' need not hold exactly, since O' = A V M can leave V's row space.
* S > d (the usual case): V has rank ≤ d < S and X V = O' has infinitely many solutions
  X = O' V⁺ + Z (I − V V⁺). The pseudo-inverse takes the minimum-norm one (Z = 0); plain
  gradient descent from A never changes A (I − V V⁺) and converges to the solution nearest to A,
  ``X* = A + (O' − A V) V⁺`` (:func:`effective_attention_nearest`). The two differ by
  A (I − V V⁺), the part of A that V cannot see, which does not affect the output.

:func:`agreement` reports the relative Frobenius difference and the row-wise cosine of two
estimates.

λ(t) is used as a separate factor here (the paper folds it into W_D for this analysis).
Neither estimate is constrained to be causal or to sum to one per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffattn.dex.adapter import DEX_CHILD
from diffattn.dex.layer import DexHeads
from diffattn.dex.sites import find_attention
from diffattn.probe import AttentionMaps, HeadOutputs, Probe, eval_mode


def _dex_output(
    attn: torch.Tensor, values: torch.Tensor, w_d: torch.Tensor | None, lam: float
) -> torch.Tensor:
    """O' = A V (I − λ W_D) in float64 (O' = A V without W_D)."""
    out = attn.double() @ values.double()
    if w_d is None:
        return out
    return out - lam * (out @ w_d.double())


def effective_attention_pinv(
    attn: torch.Tensor,
    values: torch.Tensor,
    w_d: torch.Tensor | None,
    lam: float,
    rtol: float | None = None,
) -> torch.Tensor:
    """Eq.6 of App. F.3: X = A V (I − λ W_D) V⁺, float64.

    Args:
        attn: A, ``(..., N, S)``; values: V, ``(..., S, d)``; w_d: W_D ``(d, d)`` or ``None``
            (a head without Dex, X = A V V⁺); lam: λ(t); rtol: passed to
            ``torch.linalg.pinv``.
    """
    return _dex_output(attn, values, w_d, lam) @ torch.linalg.pinv(values.double(), rtol=rtol)


def effective_attention_nearest(
    attn: torch.Tensor, values: torch.Tensor, w_d: torch.Tensor | None, lam: float
) -> torch.Tensor:
    """The solution of X V = O' nearest to A: A + (O' − A V) V⁺ (float64), i.e. the limit of
    gradient descent on ||X V − O'||² started at A."""
    a = attn.double()
    residual = _dex_output(attn, values, w_d, lam) - a @ values.double()
    return a + residual @ torch.linalg.pinv(values.double())


def effective_attention_optim(
    attn: torch.Tensor,
    values: torch.Tensor,
    w_d: torch.Tensor | None,
    lam: float,
    steps: int = 100,
    lr: float = 1e-3,
    optimizer: str = "adam",
) -> torch.Tensor:
    """App. F.3's optimisation estimate: X from A, ``steps`` updates of ``optimizer``
    (``"adam"`` or ``"sgd"``) at ``lr`` on ||X V − O'||² (summed; float64)."""
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    target = _dex_output(attn, values, w_d, lam)
    v = values.double()
    x = attn.detach().double().clone().requires_grad_(True)
    opt_class = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    opt = opt_class([x], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = (x @ v - target).pow(2).sum()
            loss.backward()
            opt.step()
    return x.detach()


def agreement(estimate: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """How well two effective-attention estimates agree.

    Returns ``rel_frobenius`` ||estimate − reference||_F / ||reference||_F, the mean and
    minimum row-wise cosine similarity, and the largest absolute difference.
    """
    a, b = estimate.double(), reference.double()
    rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    cosine = torch.nn.functional.cosine_similarity(rows_a, rows_b, dim=-1, eps=1e-12)
    return {
        "rel_frobenius": float((a - b).norm() / b.norm().clamp_min(1e-300)),
        "row_cosine_mean": float(cosine.mean()),
        "row_cosine_min": float(cosine.min()),
        "max_abs_diff": float((a - b).abs().max()),
    }


def _key_mask(answer_positions: Any, n_keys: int, device) -> torch.Tensor:
    if isinstance(answer_positions, torch.Tensor) and answer_positions.dtype == torch.bool:
        if answer_positions.shape != (n_keys,):
            raise ValueError(
                f"a boolean answer mask must have shape ({n_keys},), "
                f"got {tuple(answer_positions.shape)}"
            )
        return answer_positions.to(device)
    mask = torch.zeros(n_keys, dtype=torch.bool, device=device)
    if isinstance(answer_positions, slice):
        mask[answer_positions] = True
    else:
        index = torch.as_tensor(list(answer_positions), dtype=torch.long)
        if index.numel() and (index.min() < -n_keys or index.max() >= n_keys):
            raise ValueError(f"answer positions {index.tolist()} out of range for {n_keys} keys")
        mask[index.to(device)] = True
    if not mask.any():
        raise ValueError("the answer span is empty")
    return mask


def attention_to_answer(
    effective_attention: torch.Tensor,
    answer_positions: slice | Sequence[int] | torch.Tensor,
    query: str | int = "last",
    normalize: str = "abs",
) -> torch.Tensor:
    """Share of (effective) attention that falls on the answer span (the paper's Tab. 2).

    Args:
        effective_attention: X or A, ``(..., N, S)``.
        answer_positions: key positions of the answer: a slice, indices or a ``(S,)`` mask.
        query: ``"last"`` (the query that produces the answer), ``"all"`` or a query index.
        normalize: ``"abs"``: Σ_answer X / Σ_all |X| (negative attention to the answer counts
            against it; equals the plain share for a softmax row); ``"sum"``: / Σ_all X;
            ``"none"``: Σ_answer X.

    Returns:
        ``(...)`` for one query, ``(..., N)`` for ``"all"``.
    """
    x = effective_attention.double()
    mask = _key_mask(answer_positions, x.shape[-1], x.device)
    if query == "last":
        rows = x[..., -1, :]
    elif query == "all":
        rows = x
    elif isinstance(query, int) and not isinstance(query, bool):
        rows = x[..., query, :]
    else:
        raise ValueError(f"query must be 'last', 'all' or an int, got {query!r}")
    share = rows[..., mask].sum(-1)
    if normalize == "abs":
        return share / rows.abs().sum(-1).clamp_min(1e-300)
    if normalize == "sum":
        return share / rows.sum(-1)
    if normalize == "none":
        return share
    raise ValueError(f"normalize must be 'abs', 'sum' or 'none', got {normalize!r}")


@dataclass
class HeadTensors:
    """What the effective attention of one head needs, captured from a forward pass.

    Attributes:
        attn: A, ``(B, N, S)``, the head's softmax map.
        values: V of the head's key/value group, ``(B, S, d)``.
        w_d: the head's W_D ``(d, d)``, or ``None`` when Dex does not adapt it.
        lam: λ(t) of the layer (0.0 without Dex).
        output: the head's output O = A V before Dex, ``(B, N, d)``.
        dex_output: the head's output O' after Dex (what W_O reads), ``(B, N, d)``.
    """

    attn: torch.Tensor
    values: torch.Tensor
    w_d: torch.Tensor | None
    lam: float
    output: torch.Tensor
    dex_output: torch.Tensor


@torch.no_grad()
def head_tensors(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer: int,
    head: int,
    attention_mask: torch.Tensor | None = None,
) -> HeadTensors:
    """Run ``model`` once and capture A, V, W_D, λ and the outputs of ``head`` in ``layer``,
    through the capture probe (the layer's softmax map, its V, and the ``o_proj`` input before
    and after Dex)."""
    sites = find_attention(model)
    if not 0 <= layer < len(sites):
        raise ValueError(f"layer {layer} does not exist: the model has {len(sites)} layers")
    site = sites[layer]
    if not 0 <= head < site.n_heads:
        raise ValueError(f"layer {layer}: head {head} out of range; it has {site.n_heads} heads")
    group = head // (site.n_heads // site.n_kv_heads)
    maps = AttentionMaps(what=("probs", "values"), layers=[layer], heads=[head])
    outputs = HeadOutputs(stages=("output", "dex_output"), layers=[layer], heads=[head])
    with eval_mode(model), Probe(model, [maps, outputs]):
        model(input_ids=input_ids, attention_mask=attention_mask)
    attention = maps.result()[layer][-1]
    heads = outputs.result()[layer][-1]
    dex = site.module._modules.get(DEX_CHILD)
    w_d, lam = None, 0.0
    if isinstance(dex, DexHeads) and head in dex.selected:
        w_d = dex.w_d[dex.selected.index(head)].detach()
        lam = float(dex.lam())
    return HeadTensors(
        attn=attention["probs.a"][:, 0],
        values=attention["values"][:, group],
        w_d=w_d,
        lam=lam,
        output=heads["output"][:, 0],
        dex_output=heads["dex_output"][:, 0],
    )


def effective_attention(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer: int,
    head: int,
    method: str = "pinv",
    attention_mask: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor:
    """Effective attention ``(B, N, S)`` of one head of a (Dex) model on ``input_ids``.

    ``method``: ``"pinv"`` (Eq.6, the paper's main estimate), ``"optim"`` (App. F.3's
    optimisation; ``options`` go to :func:`effective_attention_optim`) or ``"nearest"``.
    """
    t = head_tensors(model, input_ids, layer, head, attention_mask)
    if method == "pinv":
        return effective_attention_pinv(t.attn, t.values, t.w_d, t.lam, **options)
    if method == "optim":
        return effective_attention_optim(t.attn, t.values, t.w_d, t.lam, **options)
    if method == "nearest":
        return effective_attention_nearest(t.attn, t.values, t.w_d, t.lam)
    raise ValueError(f"method must be 'pinv', 'optim' or 'nearest', got {method!r}")


@torch.no_grad()
def effective_rows(
    model: nn.Module, input_ids: torch.Tensor, position: int = -1
) -> list[torch.Tensor]:
    """Per layer, the map row every head applies at query ``position`` of ``input_ids``
    (batch of one): the softmax row for heads without Dex, the pinv effective-attention row
    ``O'_row V⁺`` (Eq. 6) for heads Dex adapted. Each entry is ``(n_heads, S)`` float64.

    One forward through the capture probe; the rows are what DIFF's Table 3 and Dex's Table 2
    sum over key spans.
    """
    if input_ids.shape[0] != 1:
        raise ValueError("effective_rows takes a batch of one sequence")
    sites = find_attention(model)
    n = input_ids.shape[1]
    position = position % n
    maps = AttentionMaps(what=("probs", "values"), query_positions=[position])
    outputs = HeadOutputs(stages=("dex_output",))
    with eval_mode(model), Probe(model, [maps, outputs]):
        model(input_ids=input_ids)
    rows = []
    for site in sites:
        attention = maps.result()[site.index][-1]
        probs = attention["probs.a"][0, :, -1].double()  # (H, S)
        values = attention["values"][0].double()  # (H_kv, S, d)
        dex = site.module._modules.get(DEX_CHILD)
        if isinstance(dex, DexHeads):
            group_size = site.n_heads // site.n_kv_heads
            out = outputs.result()[site.index][-1]["dex_output"][0, :, position].double()
            pinvs = {}
            for head in dex.selected:
                group = head // group_size
                if group not in pinvs:
                    pinvs[group] = torch.linalg.pinv(values[group])  # (d, S)
                probs[head] = out[head] @ pinvs[group]
        rows.append(probs)
    return rows
