"""Analyses built from captures that more than one part of diffattn uses."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from diffattn.probe.captures import HeadGates, token_nll
from diffattn.probe.core import Probe, eval_mode


def sequence_nll(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """Mean next-token NLL of each sequence, ``(B,)``; padding and its predictions ignored."""
    nll = token_nll(logits, input_ids, attention_mask)
    valid = ~torch.isnan(nll)
    return torch.where(valid, nll, 0.0).sum(-1) / valid.sum(-1).clamp_min(1)


def head_importance(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]]
) -> torch.Tensor:
    """Michel et al. (2019) head importance E_x |∂L(x)/∂ξ_h|, ``(n_layers, n_heads)`` float64
    (``n_heads``: the most heads of a layer; NaN beyond a layer's own, in a mixed stack).

    ξ are the identity gates of :class:`~diffattn.probe.HeadGates` on every head W_O reads
    (differential heads for DIFF V1), one per sequence, so one backward pass gives each
    sequence's derivative; L(x) is the sequence's mean next-token loss. ``batches`` yields
    ``(input_ids, attention_mask)`` on the model's device. Model weights get no gradients.
    """
    gates = HeadGates()
    total, count = None, 0
    with eval_mode(model), torch.enable_grad(), Probe(model, [gates]):
        for ids, mask in batches:
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = sequence_nll(logits, ids, mask).sum()
            grads = torch.autograd.grad(loss, gates.ordered())
            step = _rows([g.abs().sum(0) for g in grads]).cpu()
            total = step if total is None else total + step
            count += ids.shape[0]
    if total is None:
        raise ValueError("no calibration batches given")
    return total / count


def _rows(values: list[torch.Tensor]) -> torch.Tensor:
    """``values`` (one 1-D tensor per layer) as rows of a float64 matrix, NaN-padded to the
    longest (the layers of a mixed stack may have different numbers of heads)."""
    width = max(v.numel() for v in values)
    if all(v.numel() == width for v in values):
        return torch.stack(values).double()
    out = torch.full((len(values), width), torch.nan, dtype=torch.float64, device=values[0].device)
    for i, v in enumerate(values):
        out[i, : v.numel()] = v.double()
    return out
