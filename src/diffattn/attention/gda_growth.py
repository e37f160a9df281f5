"""Group-differentiated growth of GDA models (arXiv 2510.06949): more signal heads, the same
noise heads, and at the moment of growth the same function.

The paper grows a trained GDA model for continued training by replicating *only the signal
heads*; its method section could not be read, so the procedure below is reconstructed, and
what it leaves open is an argument (see :mod:`diffattn.attention.gda` for the layer):

* every signal head is copied ``factor`` times: its ``q_proj`` rows, in the ``(r·f + 1)``-head
  query group of the same noise head (so the copies read the same noise map and KV group);
  noise heads, K, V, λ and the head norm are kept as they are, ``ratio`` becomes ``r·f`` and
  ``n_noise_heads`` is set to the unchanged ``H_n`` (the config's ``n_heads`` is not touched);
* every copy computes exactly the old head's output, and W_O sums them, so each copy gets the
  old head's W_O columns divided by ``factor`` (``split_output``, default): the grown model
  computes the *same function* (as Net2Net widening does); without the split each head is
  counted ``factor`` times;
* ``symmetry_noise`` adds to the copies' W_O columns a perturbation that sums to zero over the
  copies of a head: the function is unchanged (to rounding), but the copies receive different
  gradients. Without it they stay identical under any training.

Whether the paper rescales W_O, perturbs the copies or also widens d_model and the FFN is not
known to us; hence the two switches.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from diffattn.attention.gda import GDA, Gda
from diffattn.config import ModelConfig


def gda_layers(config: ModelConfig) -> list[int]:
    """The layers of ``config`` whose attention is GDA."""
    return [i for i in range(config.n_layers) if isinstance(config.type_of_layer(i), Gda)]


def grown_config(config: ModelConfig, factor: int) -> ModelConfig:
    """``config`` with every GDA layer's signal heads multiplied by ``factor``: ``ratio`` ×
    ``factor`` and ``n_noise_heads`` fixed at today's ``H_n``."""
    _check_factor(factor)
    if not gda_layers(config):
        names = ", ".join(declaration.name for declaration in config.attention_types)
        raise ValueError(
            f"growing signal heads applies to GDA layers (attention type 'gda'); this model's "
            f"layers are {names}"
        )
    heads = GDA.heads(config)
    stored = dict(config.attention_options.get(GDA.name, {}))
    stored.update(ratio=heads.ratio * factor, n_noise_heads=heads.n_noise)
    return config.replace(attention_options={**config.attention_options, GDA.name: stored})


def _check_factor(factor: object) -> None:
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"the growth factor must be an integer >= 1, got {factor!r}")


def grow_layer(
    wq: torch.Tensor,
    wo: torch.Tensor,
    ratio: int,
    head_dim: int,
    factor: int,
    split_output: bool = True,
    symmetry_noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's grown ``(q_proj.weight, o_proj.weight)`` from its ``(Q·d, D)`` and
    ``(D, H_s·2d)`` weights (module docstring): new signal head ``i'`` is old signal head
    ``i' // factor``; the noise perturbation is drawn in fp64 from ``generator``."""
    d, r = head_dim, ratio
    d_model = wq.shape[1]
    groups = wq.detach().reshape(-1, r + 1, d, d_model)  # (H_n, r + 1, d, D)
    signal = groups[:, :r].repeat_interleave(factor, dim=1)
    new_q = torch.cat((signal, groups[:, r:]), dim=1).reshape(-1, d_model)
    columns = wo.detach().reshape(wo.shape[0], -1, 1, 2 * d)  # (D, H_s, 1, 2d)
    scale = 1.0 / factor if split_output else 1.0
    new_o = columns.expand(-1, -1, factor, -1) * scale
    if symmetry_noise > 0.0 and factor > 1:
        noise = torch.randn(new_o.shape, generator=generator, dtype=torch.float64)
        noise = symmetry_noise * (noise - noise.mean(dim=2, keepdim=True))
        new_o = (new_o.double() + noise).to(wo.dtype)
    return new_q.contiguous(), new_o.reshape(wo.shape[0], -1).contiguous()


def grow_signal_heads(
    model_or_state: nn.Module | Mapping[str, torch.Tensor],
    config: ModelConfig,
    factor: int,
    *,
    split_output: bool = True,
    symmetry_noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Group-differentiated growth of a GDA model (module docstring).

    Args:
        model_or_state: a :class:`~diffattn.model.DiffTransformerLM` of ``config`` or its
            state dict (names without a ``model.`` prefix).
        config: the model's config; every GDA layer grows, other layers are kept.
        factor: how many copies of each signal head (an integer ≥ 1).
        split_output: divide each head's W_O columns over its copies (the same function).
        symmetry_noise: std of the zero-sum perturbation of the copies' W_O columns.
        generator: the perturbation's random numbers.

    Returns:
        ``(grown config, grown state dict)``; tensors other than the GDA layers' ``q_proj``
        and ``o_proj`` are the input's own (not copies). Raises ``ValueError`` when the
        model has no GDA layer, ``factor`` is not a positive integer, or a tensor is missing
        or mis-shaped.
    """
    if isinstance(symmetry_noise, bool) or not isinstance(symmetry_noise, int | float):
        raise ValueError(f"symmetry_noise must be a number >= 0, got {symmetry_noise!r}")
    if symmetry_noise < 0:
        raise ValueError(f"symmetry_noise must be a number >= 0, got {symmetry_noise!r}")
    new_config = grown_config(config, factor)
    state = dict(
        model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    )
    heads, d = GDA.heads(config), config.dim_per_head
    for layer in gda_layers(config):
        prefix = f"layers.{layer}.attn"
        wq, wo = (
            _weight(state, f"{prefix}.q_proj.weight"),
            _weight(state, f"{prefix}.o_proj.weight"),
        )
        expected_q = (heads.n_query * d, config.d_model)
        expected_o = (config.d_model, heads.n_signal * 2 * d)
        for name, tensor, shape in (("q_proj", wq, expected_q), ("o_proj", wo, expected_o)):
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{prefix}.{name}.weight has shape {tuple(tensor.shape)}, but the config's "
                    f"GDA layer has {shape}"
                )
        state[f"{prefix}.q_proj.weight"], state[f"{prefix}.o_proj.weight"] = grow_layer(
            wq, wo, heads.ratio, d, factor, split_output, symmetry_noise, generator
        )
    return new_config, state


def _weight(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"the state dict has no {name}")
    return state[name]
