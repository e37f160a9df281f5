"""Which keys each query may read: the one masking rule every attention backend follows.

Query ``i`` (at absolute position ``i + offset`` in the key sequence) may read key ``j`` iff
``j == i + offset``, or ``j < i + offset`` and both the query and key ``j`` are real tokens.
Real tokens never read padding, so their outputs equal those of the unpadded sequence; a
padding query reads only its own position, wherever the padding sits (left, right or holes),
so its output is the same on every backend and depends on nothing else in the sequence.

Documents packed in one row (``document_ids``) add one condition: query and key belong to the
same document. A packed row then computes what each document computes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMask:
    """Which keys each query may read.

    Attributes:
        key_padding: ``(B, S)`` bool, ``True`` for real tokens; ``None`` if nothing is padded.
        query_offset: absolute position of the first query in the key sequence (``S - N`` when
            the keys include a cache; 0 for a plain forward). A 0-d int64 tensor in fixed-shape
            (compiled, static-cache) decoding.
    """

    key_padding: torch.Tensor | None = None
    query_offset: int | torch.Tensor = 0
    allowed: torch.Tensor | None = None
    """A full boolean mask ``(B or 1, 1, N, S)`` (custom masks); when set it replaces the
    causal and padding rule."""
    document_ids: torch.Tensor | None = None
    """``(B, S)`` integer document of each key position (documents packed in a row): a query
    reads only keys of equal id, on top of the rule above. ``None``: one document. Give each
    run of tokens its own id (the model passes run indices, ``model.document_runs``): the Triton
    kernels number runs, the other backends compare ids."""

    @property
    def custom(self) -> bool:
        """Whether the mask goes beyond causal and padding (a full mask, or documents): the
        calls backends without ``custom_masks`` leave to ``sdpa``."""
        return self.allowed is not None or self.document_ids is not None

    def dense(
        self, n_queries: int, n_keys: int, device: torch.device, row_start: int = 0
    ) -> torch.Tensor:
        """Boolean ``(B or 1, 1, n_queries, S)`` tensor of allowed (query, key) pairs.

        ``row_start`` selects query rows ``row_start … row_start + n_queries − 1`` of the call,
        so blocked kernels build the mask of one block of rows at a time.
        """
        allowed = self._positional(n_queries, n_keys, device, row_start)
        if self.document_ids is None:
            return allowed
        docs = self.document_ids.to(device)
        rows = torch.arange(n_queries, device=device) + (self.query_offset + row_start)
        doc_q = docs[:, rows.clamp_max(n_keys - 1)]
        same = doc_q[:, :, None] == docs[:, None, :n_keys]
        return allowed & same[:, None]

    def _positional(
        self, n_queries: int, n_keys: int, device: torch.device, row_start: int
    ) -> torch.Tensor:
        """The full mask, or the causal and padding rule, as ``dense`` returns it without
        documents."""
        if self.allowed is not None:
            return self.allowed[:, :, row_start : row_start + n_queries].to(device)
        q_pos = torch.arange(n_queries, device=device)[:, None] + (self.query_offset + row_start)
        k_pos = torch.arange(n_keys, device=device)[None, :]
        causal = k_pos <= q_pos
        if self.key_padding is None:
            return causal[None, None]
        padding = self.key_padding.to(device=device, dtype=torch.bool)
        real_key = padding[:, None, None, :]
        real_query = padding.gather(1, q_pos[:, 0].clamp_max(n_keys - 1).expand(len(padding), -1))
        diagonal = (k_pos == q_pos)[None, None]
        return causal[None, None] & ((real_key & real_query[:, None, :, None]) | diagonal)


def expand_kv(x: torch.Tensor, n_query_heads: int) -> torch.Tensor:
    """Repeat KV heads so query head ``m`` reads KV head ``m // (Hq / Hkv)`` (the GQA rule)."""
    rep = n_query_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def read_self_on_padding(out: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Give padding query rows the output the masking rule defines: their own value.

    For kernels that let padding rows read other keys (the cheap causal paths); real rows are
    unchanged. ``out`` ``(B, Hq, N, dv)``, ``v`` ``(B, Hkv, S, dv)``, integer query offset.
    """
    n, offset = out.shape[2], int(mask.query_offset)
    real = mask.key_padding[:, offset : offset + n].to(device=out.device, dtype=torch.bool)
    own = expand_kv(v[:, :, offset : offset + n], out.shape[1])
    return torch.where(real[:, None, :, None], out, own.to(out.dtype))
