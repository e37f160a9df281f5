"""Attention modules (baseline, DIFF V1, DIFF V2) and the backend switch they share."""

from diffattn.attention.baseline import BaselineAttention
from diffattn.attention.common import AttentionMaps
from diffattn.attention.diff_v1 import DiffAttentionV1
from diffattn.attention.diff_v2 import DiffAttentionV2
from diffattn.attention.kernels import AttentionMask

ATTENTION_CLASSES = {
    "baseline": BaselineAttention,
    "diff_v1": DiffAttentionV1,
    "diff_v2": DiffAttentionV2,
}


def build_attention(config, layer_index: int):
    """The attention module selected by ``config.attention`` for layer ``layer_index``."""
    return ATTENTION_CLASSES[config.attention](config, layer_index)


__all__ = [
    "ATTENTION_CLASSES",
    "AttentionMaps",
    "AttentionMask",
    "BaselineAttention",
    "DiffAttentionV1",
    "DiffAttentionV2",
    "build_attention",
]
