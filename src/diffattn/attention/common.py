"""Pieces shared by the three attention modules: their projections, head reshapes and the maps
they return."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diffattn.attention.context_parallel import active_split
from diffattn.attention.mask import AttentionMask
from diffattn.attention.observe import MapRecorder, observing
from diffattn.config import ModelConfig
from diffattn.layers import apply_rotary


def split_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, N, H·width)`` → ``(B, H, N, width)``.

    The head count is read from the projection's output size, so a module whose projections
    hold only some of the heads (a tensor-parallel shard: whole KV groups per rank) works on
    its local heads unchanged."""
    bsz, n, channels = x.shape
    if channels % width:
        raise ValueError(f"{channels} projected channels are not whole heads of width {width}")
    return x.view(bsz, n, channels // width, width).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, w)`` → ``(B, N, H·w)``."""
    bsz, h, n, w = x.shape
    return x.transpose(1, 2).reshape(bsz, n, h * w)


@dataclass
class AttentionMaps:
    """Attention maps of one layer, returned when ``need_weights`` is set.

    Attributes:
        diff: the map actually applied to V, ``(B, H_out, N, S)``: softmax A for the baseline,
            ``A1 − λ·A2`` for DIFF V1 and V2.
        a1, a2: the two softmax maps (DIFF only), ``(B, H_out, N, S)``.
        lam: λ: a 0-d tensor for V1 (shared by heads), ``(B, H_out, N, 1)`` for V2 (per
            token and head); ``None`` for the baseline.
    """

    diff: torch.Tensor
    a1: torch.Tensor | None = None
    a2: torch.Tensor | None = None
    lam: torch.Tensor | None = None


class ProjectedAttention(nn.Module):
    """What the three attention modules share: the config, the layer index, the head width
    ``head_dim`` and its score scale ``head_dim**-0.5``, the backend, and the bias-free
    projections of width ``head_dim``: ``q_proj`` to ``q_heads`` heads (default: the config's
    ``n_heads``), ``k_proj`` and ``v_proj`` to ``num_kv_heads`` heads each and ``o_proj``
    from ``n_heads`` heads. ``n_heads`` and ``n_kv_heads`` are the config's; a module whose
    heads are counted otherwise sets them after this."""

    def __init__(self, config: ModelConfig, layer_index: int, q_heads: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        d, h, h_kv = config.dim_per_head, config.n_heads, config.num_kv_heads
        self.head_dim, self.n_heads, self.n_kv_heads = d, h, h_kv
        self.scale = d**-0.5
        self.backend = config.backend  # a run-time choice: DiffTransformerLM.set_backend
        self.q_proj = nn.Linear(config.d_model, (h if q_heads is None else q_heads) * d, bias=False)
        self.k_proj = nn.Linear(config.d_model, h_kv * d, bias=False)
        self.v_proj = nn.Linear(config.d_model, h_kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.d_model, bias=False)

    #: A V head's width in units of ``head_dim``: 1, or 2 for DIFF V1 (V heads of width 2d).
    value_width_factor = 1

    def reset_own_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initialise the type's own parameters (beyond the projections, which the model
        initialises as Linear layers); none here."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
        need_weights: bool = False,
        cache=None,
    ) -> tuple[torch.Tensor, AttentionMaps | None]:
        """One attention layer: Q, K and V (RoPE, the cache) by :func:`project_qkv`, the
        module's :meth:`attend`, and W_O over the merged heads. Returns ``(B, N, d_model)``
        and, with ``need_weights``, the layer's :class:`AttentionMaps`."""
        q, k, v = project_qkv(self, x, rope, cache, self.value_width_factor * self.head_dim)
        split = active_split()  # context parallelism: this rank's rows over every rank's K/V
        if split is None:
            out, maps = self.attend(x, q, k, v, mask, need_weights)
        else:
            out, maps = split.attend(self, x, q, k, v, need_weights, cache)
        return self.o_proj(merge_heads(out)), maps

    def attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: AttentionMask,
        need_weights: bool,
    ) -> tuple[torch.Tensor, AttentionMaps | None]:
        """The module's attention over its heads: ``(B, H, N, w)`` output heads before W_O,
        and the maps when ``need_weights`` asks for them. ``x`` is the layer's input (DIFF
        V2 projects λ from it)."""
        raise NotImplementedError(f"{type(self).__name__} defines no attend()")


def project_qkv(module, x, rope, cache, v_width: int):
    """Q, K, V of an attention module: split into heads, RoPE on Q and K, and the cache.

    ``module`` has ``q_proj``, ``k_proj``, ``v_proj``, ``head_dim``, ``config`` and
    ``layer_index``; Q and K heads have width ``head_dim``, V heads ``v_width``. K and V are
    returned with the cached keys and values in front when ``cache`` is given.
    """
    style, d = module.config.rope_style, module.head_dim
    q = apply_rotary(split_heads(module.q_proj(x), d), *rope, style)
    k = apply_rotary(split_heads(module.k_proj(x), d), *rope, style)
    v = split_heads(module.v_proj(x), v_width)
    if cache is not None:
        k, v = cache.update(module.layer_index, k, v)
    return q, k, v


def _rows_of(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Blocks of rows as one tensor; a single block is returned itself (the tensor the output
    was computed from, so gradients reach it)."""
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


def with_maps(layer: int, need_weights: bool, attend, /, *args, **kwargs):
    """``attend(*args, **kwargs)`` and, with ``need_weights``, the layer's maps.

    Returns ``(output, AttentionMaps or None)``. The maps come from the observed reference
    computation of :mod:`diffattn.attention.observe` (one block of rows) and keep their
    autograd graph. Without ``need_weights`` this is a plain call (nothing for
    ``torch.compile`` to trace through).
    """
    if not need_weights:
        return attend(*args, **kwargs), None
    recorder = MapRecorder({layer})
    with observing(recorder):
        out = attend(*args, **kwargs)
    events = recorder.take(layer)
    applied = _rows_of([e.applied for e in events])
    if "a" in events[0].probs:
        return out, AttentionMaps(diff=applied)
    a1 = _rows_of([e.probs["a1"] for e in events])
    a2 = _rows_of([e.probs["a2"] for e in events])
    lam = events[0].lam if events[0].lam.dim() == 0 else _rows_of([e.lam for e in events])
    return out, AttentionMaps(diff=applied, a1=a1, a2=a2, lam=lam.detach())
