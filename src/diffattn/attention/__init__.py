"""Attention modules, the attention-type registry (:mod:`diffattn.attention.types`) and the
backend switch they share."""

from diffattn.attention.baseline import BaselineAttention
from diffattn.attention.common import AttentionMaps
from diffattn.attention.diff_v1 import DiffAttentionV1
from diffattn.attention.diff_v2 import DiffAttentionV2
from diffattn.attention.kernels import AttentionMask
from diffattn.attention.types import (
    AttentionType,
    TypeOption,
    attention_type,
    attention_type_names,
    register_attention_type,
)


def build_attention(config, layer_index: int):
    """The attention module of layer ``layer_index``: its type's declared module."""
    return config.type_of_layer(layer_index).module(config, layer_index)


__all__ = [
    "AttentionMaps",
    "AttentionMask",
    "AttentionType",
    "BaselineAttention",
    "DiffAttentionV1",
    "DiffAttentionV2",
    "TypeOption",
    "attention_type",
    "attention_type_names",
    "build_attention",
    "register_attention_type",
]
