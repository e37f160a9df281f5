"""Key/value caches for incremental decoding, shared by all three attention types.

Each attention module stores its keys after RoPE and its values exactly as its kernel reads
them: baseline and DIFF V2 keep ``n_kv_heads`` heads of width d for K and V; DIFF V1 keeps
its ``n_kv_heads`` key half-heads (K1, K2 interleaved) of width d and ``n_kv_heads / 2``
value heads of width 2d. At matched size the cache therefore holds
``2 · n_layers · n_kv_heads · head_dim`` numbers per token for every type
(:func:`cache_bytes_per_token`): DIFF V2 doubles the query heads, not the KV heads.

``DynamicCache`` grows by concatenation. ``StaticCache`` is allocated once for a maximum
length and written in place, so shapes never change (what ``torch.compile`` wants); slots past
the current length are never read because the causal rule hides keys after the query.

A ``StaticCache`` has two ways of being told where to write. By default it keeps its length
as a Python int and appends. When the model is called with ``cache_position`` (a 1-D tensor of
consecutive slot indices), the model hands those slots to the cache with
:meth:`StaticCache.set_cache_position` and the writes become ``index_copy_`` at tensor indices:
no Python int changes from one decode step to the next, so a compiled decode step is neither
re-specialised nor recompiled per token. The length is then only known on the device and is
read back lazily by :meth:`StaticCache.get_seq_length`.
"""

from __future__ import annotations

import torch

from diffattn.config import ModelConfig


def cache_bytes_per_token(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of K and V cached per token over all layers."""
    numbers = sum(
        config.type_of_layer(i).cache_layout(config).elements_per_token
        for i in range(config.n_layers)
    )
    return numbers * torch.empty((), dtype=dtype).element_size()


class DynamicCache:
    """A cache that grows with every call: ``update`` appends and returns everything so far."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self) -> int:
        """Tokens already cached (read from layer 0)."""
        return self.keys[0].shape[2] if self.keys else 0

    def update(
        self, layer_index: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` of shape ``(B, H, n, w)`` and return all of this layer's."""
        if layer_index == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        elif layer_index < len(self.keys):
            self.keys[layer_index] = torch.cat((self.keys[layer_index], k), dim=2)
            self.values[layer_index] = torch.cat((self.values[layer_index], v), dim=2)
        else:
            raise IndexError(f"layer {layer_index} updated before layer {len(self.keys)}")
        return self.keys[layer_index], self.values[layer_index]

    def advance(self) -> None:
        """Nothing to commit: ``update`` already appended (same interface as StaticCache)."""

    def reorder(self, beam_index: torch.Tensor) -> None:
        """Select batch rows (e.g. after a beam step)."""
        self.keys = [k.index_select(0, beam_index) for k in self.keys]
        self.values = [v.index_select(0, beam_index) for v in self.values]


class StaticCache:
    """A cache pre-allocated for ``max_len`` tokens; ``update`` writes in place.

    ``update`` returns the full ``max_len`` buffers: keys beyond the current length hold zeros
    and are hidden by the causal rule, so attention reads the same keys as with a
    :class:`DynamicCache`. Call :meth:`advance` once per forward (the model does this).
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_len > config.max_seq_len:
            raise ValueError(
                f"StaticCache max_len={max_len} exceeds the model's max_seq_len="
                f"{config.max_seq_len}"
            )
        layouts = [config.type_of_layer(i).cache_layout(config) for i in range(config.n_layers)]
        self.max_len = max_len
        self.keys = [
            torch.zeros(
                (batch_size, lay.key_heads, max_len, lay.key_width), device=device, dtype=dtype
            )
            for lay in layouts
        ]
        self.values = [
            torch.zeros(
                (batch_size, lay.value_heads, max_len, lay.value_width), device=device, dtype=dtype
            )
            for lay in layouts
        ]
        self._length: int | None = 0
        self._pending = 0
        self._slots: torch.Tensor | None = None  # slots of the current forward (tensor mode)
        self._end: torch.Tensor | None = None  # the length on the device (after tensor mode)

    def get_seq_length(self) -> int:
        """Tokens already cached. After a forward with ``cache_position`` the length lives on
        the device and is read back here (one synchronisation), only when asked."""
        if self._length is None:
            self._length = int(self._end)
            self._end = None
        return self._length

    def set_cache_position(self, cache_position: torch.Tensor) -> None:
        """Make the next forward write its ``n`` tokens at the slots ``cache_position`` (a 1-D
        tensor of ``n`` indices in ``[0, max_len)``) instead of appending; the model calls
        this when it is given ``cache_position``. :meth:`advance` clears it again."""
        self._slots = cache_position

    def update(
        self, layer_index: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` of shape ``(B, H, n, w)`` and return the full buffers."""
        keys, values = self.keys[layer_index], self.values[layer_index]
        if k.shape[:2] != keys.shape[:2] or v.shape[:2] != values.shape[:2]:
            # a slice assignment would broadcast one head into all (e.g. a tensor-parallel
            # rank's local heads): refuse instead
            raise ValueError(
                f"StaticCache holds (batch, heads) = {tuple(keys.shape[:2])}, got keys "
                f"{tuple(k.shape[:2])} and values {tuple(v.shape[:2])}"
            )
        if self._slots is not None:  # tensor slots: no host value is read (compile-friendly)
            keys.index_copy_(2, self._slots, k.to(keys.dtype))
            values.index_copy_(2, self._slots, v.to(values.dtype))
            return keys, values
        n = k.shape[2]
        start = self.get_seq_length()
        if start + n > self.max_len:
            raise ValueError(
                f"StaticCache is full: {start} cached + {n} new > max_len={self.max_len}"
            )
        keys[:, :, start : start + n] = k
        values[:, :, start : start + n] = v
        self._pending = n
        return keys, values

    def advance(self) -> None:
        """Commit the tokens written by the last forward (all layers)."""
        if self._slots is not None:
            # The new length is the slot after the last one written; keep it on the device.
            self._end = self._slots[-1] + 1
            self._length = None
            self._slots = None
            return
        self._length += self._pending
        self._pending = 0

    def reset(self) -> None:
        """Forget every cached token (the buffers are overwritten by later writes)."""
        self._length = 0
        self._pending = 0
        self._slots = None
        self._end = None
