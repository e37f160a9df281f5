"""Fold Dex into W_O: an exact plain checkpoint with zero inference overhead (paper §3, App. E).

For the row vector x_h of head h at the ``o_proj`` input, Dex computes
x'_h = x_h − λ·x_h W_D,h = x_h M_h with M_h = I − λ W_D,h (Eq.5, f_D linear). ``o_proj``
computes x' W_Oᵀ = Σ_h x'_h W_O[:, h]ᵀ, writing W_O[:, h] for the d columns of W_O that read
head h. Then

    x'_h W_O[:, h]ᵀ = x_h M_h W_O[:, h]ᵀ = x_h (W_O[:, h] M_hᵀ)ᵀ,

so replacing W_O[:, h] by W_O[:, h] · M_hᵀ = W_O[:, h] (I − λ W_D,h)ᵀ and dropping the hook
gives the same function. λ is the schedule's value at the model's current step t. The fold
is computed in float64 and stored in W_O's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from diffattn.dex.adapter import dex_sites, remove_hooks


def fold_into_o_proj(weight: torch.Tensor, heads: list[int], w_d: torch.Tensor, lam: float):
    """W_O with every selected head's columns replaced by W_O[:, h] (I − λ W_D,h)ᵀ.

    ``weight``: (out, n_heads·d); ``w_d``: (k, d, d) in the order of ``heads``. Returns a new
    tensor in ``weight``'s dtype.
    """
    d = w_d.shape[-1]
    merged = weight.detach().to(torch.float64).clone()
    eye = torch.eye(d, dtype=torch.float64, device=weight.device)
    for i, h in enumerate(heads):
        m = eye - lam * w_d[i].detach().to(torch.float64)
        cols = slice(h * d, (h + 1) * d)
        merged[:, cols] = merged[:, cols] @ m.T
    return merged.to(weight.dtype)


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every Dex layer into its W_O, remove the hooks and Dex modules, return ``model``.

    The result is a plain model of the original class with the original parameter names
    and no extra modules or parameters (a Hugging Face model saves with ``save_pretrained``
    and loads with stock ``transformers``); every parameter has ``requires_grad=True`` again.

    Raises:
        ValueError: the model has no Dex layers, or a W_O is not a plain floating-point
            ``nn.Linear`` (e.g. quantized): nothing is changed then.
    """
    pairs = dex_sites(model)
    for site, _ in pairs:
        o_proj = site.o_proj
        if type(o_proj) is not nn.Linear:
            raise ValueError(
                f"cannot merge Dex into {site.name}.o_proj: it is a {type(o_proj).__name__}, "
                "not a plain nn.Linear (quantized or wrapped W_O); dequantise it first"
            )
        weight = o_proj.weight
        if not weight.dtype.is_floating_point or weight.is_meta:
            raise ValueError(
                f"cannot merge Dex into {site.name}.o_proj: its weight is "
                f"{'on the meta device' if weight.is_meta else weight.dtype}, "
                "not a floating-point tensor"
            )
    for site, dex in pairs:
        weight = site.o_proj.weight
        weight.copy_(fold_into_o_proj(weight, dex.selected, dex.w_d, float(dex.lam())))
    remove_hooks(model)
    for param in model.parameters():
        param.requires_grad_(True)
    return model
