"""The capture probe: observe any supported model's forward pass.

See :mod:`diffattn.probe.core` for how it works and :mod:`diffattn.probe.captures` for what
it captures.
"""

from diffattn.probe import captures
from diffattn.probe.captures import (
    AttentionEntropy,
    AttentionMaps,
    HeadGates,
    HeadOutputs,
    HiddenStates,
    HiddenStats,
    Lambda,
    LogitStats,
    LogitTransform,
    SpanMass,
    TokenLoss,
    token_nll,
)
from diffattn.probe.core import Capture, Probe, eval_mode
from diffattn.probe.reducers import RunningStats

__all__ = [
    "AttentionEntropy",
    "AttentionMaps",
    "Capture",
    "HeadGates",
    "HeadOutputs",
    "HiddenStates",
    "HiddenStats",
    "Lambda",
    "LogitStats",
    "LogitTransform",
    "Probe",
    "RunningStats",
    "SpanMass",
    "TokenLoss",
    "captures",
    "eval_mode",
    "token_nll",
]
