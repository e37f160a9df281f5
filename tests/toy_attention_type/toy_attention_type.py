"""An attention type defined outside diffattn, in one file: softmax attention whose scores
are multiplied by a learned temperature per query head, ``softmax(τ_h·QKᵀ/√d) V`` with
``τ_h = exp(t_h)`` and ``t_h`` initialised to ``log(init_temperature)``.

It reuses the baseline's projections and the ``softmax`` entry point, so it runs on every
backend diffattn has; the package registers it through the ``diffattn.attention_types``
entry point (pyproject.toml), so ``attention: tempered`` works in every command.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diffattn.attention.baseline import Baseline, BaselineAttention
from diffattn.attention.types import TypeOption


def _positive(value):
    return None if value > 0 else f"must be positive, got {value!r}"


class TemperedAttention(BaselineAttention):
    """The baseline's attention with query head ``h`` scaled by ``exp(t_h)``."""

    def __init__(self, config, layer_index):
        super().__init__(config, layer_index)
        self.log_temperature = nn.Parameter(torch.empty(config.n_heads))
        self.reset_own_parameters()

    def reset_own_parameters(self, generator=None):
        start = config_temperature(self.config)
        with torch.no_grad():
            self.log_temperature.fill_(math.log(start))

    def attend(self, x, q, k, v, mask, need_weights):
        tau = torch.exp(self.log_temperature).to(q.dtype).view(1, -1, 1, 1)
        return super().attend(x, q * tau, k, v, mask, need_weights)


def config_temperature(config) -> float:
    return config.options_of("tempered")["init_temperature"]


class Tempered(Baseline):
    name = "tempered"
    title = "Tempered softmax"
    colour = "tab:green"
    module = TemperedAttention
    source = "toy_attention_type: a learned temperature per head"
    options = (
        TypeOption("init_temperature", 1.0, "τ of every head at initialisation", float, _positive),
    )
    tensor_parallel = False
    vllm_reason = "its per-head temperature is not part of vLLM's stock attention call"

    def extra_parameters(self, config) -> int:
        return config.n_heads  # t_h

    def matches_by_ffn(self, config) -> bool:
        return False  # n_heads parameters a layer: matched by construction


TEMPERED = Tempered()
