"""Apply Dex to a pretrained decoder, and choose what trains (Dex paper §3, Eq.3–5).

``apply(model, heads, anneal_steps=T)`` adds, to every layer with selected heads, a
:class:`~diffattn.dex.layer.DexHeads` holding W_D (one head_dim × head_dim matrix per selected
head, identity-initialised, see :mod:`diffattn.dex.layer`), λ_learn and the Eq.4 schedule
state, and a forward pre-hook on the layer's ``o_proj`` that turns its input into
O'_h = O_h − λ(t)·O_h W_D,h for the selected heads. At t = 0, λ = 0 and the model computes
exactly what the pretrained one computes.

Trainable set (§3.4): "we update W_K, W_V and W_O along with W_D and λ_learn within
self-attention, keeping all other parameters frozen". The paper selects heads in every layer,
so every layer's K, V and O train; here, by default, the K, V and O projections (weights and
biases) of the *adapted* layers train (``attention="all"`` trains those of every layer),
together with W_D and λ_learn. W_Q, the MLPs, norms, embeddings and the LM head are frozen.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from diffattn.dex.layer import DexHeads, initial_w_d
from diffattn.dex.schedule import resolve_lambda_init
from diffattn.dex.selection import HeadSelection, resolve_heads
from diffattn.dex.sites import AttentionSite, find_attention

DEX_CHILD = "dex"
TRAIN_ATTENTION = ("adapted", "all")


def is_dex(model: nn.Module) -> bool:
    """Whether ``model`` carries Dex layers (``apply`` was called and not yet merged)."""
    return any(isinstance(m, DexHeads) for m in model.modules())


def dex_sites(model: nn.Module) -> list[tuple[AttentionSite, DexHeads]]:
    """The adapted attention layers of a Dex model with their :class:`DexHeads`."""
    pairs = [
        (site, site.module._modules[DEX_CHILD])
        for site in find_attention(model)
        if isinstance(site.module._modules.get(DEX_CHILD), DexHeads)
    ]
    if not pairs:
        raise ValueError(
            f"{type(model).__name__} has no Dex layers; call diffattn.dex.apply(model, ...) first"
        )
    return pairs


def dex_layers(model: nn.Module) -> dict[int, DexHeads]:
    """Layer index → :class:`DexHeads` of every adapted layer."""
    return {site.index: dex for site, dex in dex_sites(model)}


def selected_heads(model: nn.Module) -> HeadSelection:
    """The :class:`HeadSelection` a Dex model was built with."""
    sites = find_attention(model)
    heads = {site.index: tuple(dex.selected) for site, dex in dex_sites(model)}
    return HeadSelection(heads, [s.n_heads for s in sites], "explicit")


def apply(
    model: nn.Module,
    heads: Any,
    *,
    anneal_steps: int,
    lambda_init: str | float = "exp",
    w_d_init: str | float = "identity",
    lambda_learn_init: float = 0.0,
    freeze: bool = True,
    attention: str = "adapted",
) -> nn.Module:
    """Add Dex to ``model`` in place and return it.

    Args:
        model: a Hugging Face Llama/Qwen2/Mistral-style ``*ForCausalLM`` or a
            :class:`diffattn.DiffTransformerLM` with baseline attention.
        heads: ``"all"``, a :class:`~diffattn.dex.selection.HeadSelection`
            (:func:`~diffattn.dex.selection.select_heads`), or ``{layer: [heads]}``.
        anneal_steps: T of Eq.4 (optimizer steps); 0 disables annealing (λ = λ_learn).
        lambda_init: ``"exp"`` (DIFF's depth schedule, the paper's choice) or a constant.
        w_d_init: ``"identity"`` (default), ``"zeros"`` or a float s for s·I.
        lambda_learn_init: initial λ_learn ("around zero", §3.3).
        freeze: freeze everything outside the Dex trainable set (:func:`freeze`).
        attention: whose K/V/O train when freezing: ``"adapted"`` layers or ``"all"``.

    Raises:
        ValueError: unsupported model, Dex already applied, or an invalid head selection,
            schedule or initialisation (nothing is changed then).
    """
    sites = find_attention(model)
    if is_dex(model):
        raise ValueError(
            f"{type(model).__name__} already has Dex applied; merge it "
            "(diffattn.dex.merge) or start from a fresh model"
        )
    chosen = resolve_heads(sites, heads)
    if isinstance(anneal_steps, bool) or not isinstance(anneal_steps, int) or anneal_steps < 0:
        raise ValueError(f"anneal_steps must be a non-negative integer, got {anneal_steps!r}")
    if (
        isinstance(lambda_learn_init, bool)
        or not isinstance(lambda_learn_init, int | float)
        or not math.isfinite(lambda_learn_init)
    ):
        raise ValueError(f"lambda_learn_init must be a finite number, got {lambda_learn_init!r}")
    if attention not in TRAIN_ATTENTION:
        raise ValueError(f"attention must be 'adapted' or 'all', got {attention!r}")
    initial_w_d(w_d_init, 1, 1, None, None)  # validate before touching the model
    inits = {layer: resolve_lambda_init(lambda_init, layer) for layer in chosen.heads}
    for site in sites:
        if site.index in chosen.heads and DEX_CHILD in site.module._modules:
            raise ValueError(f"{site.name} already has a child named {DEX_CHILD!r}")

    for site in sites:
        if site.index not in chosen.heads:
            continue
        weight = site.o_proj.weight
        dex = DexHeads(
            layer_index=site.index,
            n_heads=site.n_heads,
            head_dim=site.head_dim,
            heads=list(chosen.heads[site.index]),
            lambda_init=inits[site.index],
            anneal_steps=anneal_steps,
            w_d_init=w_d_init,
            lambda_learn_init=lambda_learn_init,
            dtype=weight.dtype,
            device=weight.device,
        )
        site.module.add_module(DEX_CHILD, dex)
        site.o_proj.register_forward_pre_hook(dex.pre_hook, with_kwargs=True)
    if freeze:
        _set_trainable(model, attention)
    return model


def remove_hooks(model: nn.Module) -> None:
    """Detach every Dex pre-hook and ``dex`` child (no weights are changed)."""
    for site, dex in dex_sites(model):
        hooks = site.o_proj._forward_pre_hooks
        ours = [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is dex]
        for key in ours:
            del hooks[key]
            site.o_proj._forward_pre_hooks_with_kwargs.pop(key, None)
        del site.module._modules[DEX_CHILD]


def named_trainable_parameters(
    model: nn.Module, attention: str = "adapted"
) -> list[tuple[str, nn.Parameter]]:
    """The Dex trainable set (§3.4) as ``(name, parameter)`` in model order: k_proj, v_proj
    and o_proj of the adapted layers (``attention="all"``: of every layer), W_D, λ_learn."""
    if attention not in TRAIN_ATTENTION:
        raise ValueError(f"attention must be 'adapted' or 'all', got {attention!r}")
    pairs = dex_sites(model)
    modules: list[nn.Module] = []
    sites = find_attention(model) if attention == "all" else [site for site, _ in pairs]
    for site in sites:
        modules += [site.module.k_proj, site.module.v_proj, site.module.o_proj]
    wanted = {id(p) for m in modules for p in m.parameters()}
    for _, dex in pairs:
        wanted |= {id(dex.w_d), id(dex.lambda_learn)}
    return [(n, p) for n, p in model.named_parameters() if id(p) in wanted]


def trainable_parameters(model: nn.Module, attention: str = "adapted") -> list[nn.Parameter]:
    """The parameters of :func:`named_trainable_parameters` (e.g. for an optimizer)."""
    return [p for _, p in named_trainable_parameters(model, attention)]


def freeze(model: nn.Module, attention: str = "adapted") -> list[str]:
    """``requires_grad=True`` on the Dex trainable set, ``False`` on everything else
    (W_Q, MLPs, norms, embeddings, LM head). Returns the trainable names."""
    return _set_trainable(model, attention)


def _set_trainable(model: nn.Module, attention: str) -> list[str]:
    names = [n for n, _ in named_trainable_parameters(model, attention)]
    keep = set(names)
    for name, param in model.named_parameters():
        param.requires_grad_(name in keep)
    return names
