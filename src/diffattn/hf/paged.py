"""Continuous batching (paged attention) for :class:`~diffattn.hf.DiffAttnForCausalLM`.

transformers' continuous batching (``generate_batch``, ``init_continuous_batching``, ``transformers
serve --continuous-batching``) calls ``forward`` on a *packed* batch: the new tokens of every
scheduled request one after another in a ``(1, T)`` row, ``cu_seq_lens_q`` marking where each
request's tokens start, ``cu_seq_lens_k`` its key count (cached + new), and a
``PagedAttentionCache`` with the slots each request's keys are written to (``write_index``) and
read from (``read_index``).

How diffattn runs such a batch (:func:`paged_forward`): the requests are independent, so they
are grouped by their number of new tokens, and each group runs the unchanged model as one
ordinary batch ``(R, n)`` with a cache view (:class:`PagedRequests`) that writes the group's
keys and values into the paged cache and reads each request's keys back, left-padded to the
group's longest request. The attention of every layer is then the model's own causal attention
with a ``(R, longest)`` key-padding mask, on whichever backend the model uses: request ``r``'s
query at position ``p`` reads its keys ``0 … p`` and nothing of another request (the masking rule
of :mod:`diffattn.attention.mask`). No ``(T × total keys)`` mask is built: decode steps (one
new token per request) form one group whose masks are ``(R, 1, longest)``; a prefill chunk runs
as its own group with no padding at all. The 4-D mask transformers builds for ``sdpa``/``eager``
says the same as ``cu_seq_lens_q``/``cu_seq_lens_k`` and is not read.

DIFF V1's values (``n_kv_heads / 2`` heads of width 2d) are stored in the paged cache as
``n_kv_heads`` heads of width d (:mod:`diffattn.hf.value_heads`), as in HF's other caches;
DIFF V2 and the baseline store K and V as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffattn.hf.compat import full_attention_lengths, paged_cache_class, paged_cache_update
from diffattn.hf.value_heads import merge_value_heads, split_value_heads, value_parts


@dataclass(frozen=True)
class PagedBatchArguments:
    """The arguments continuous batching passes to ``forward`` besides ids, positions and cache.

    Attributes:
        cu_seq_lens_q: ``(R + 1,)`` cumulative new-token counts of the packed requests.
        cu_seq_lens_k: ``(R + 1,)`` cumulative key counts (cached + new), or a dict of them by
            layer type (5.x releases after 5.0).
        read_index: per layer group, the cache slots of every request's keys, in order.
        write_index: per layer group, the cache slots of every new token.
        block_table: the block table of the flash decode path (refused: see
            :func:`check_supported`).
    """

    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: Any
    read_index: list[torch.Tensor]
    write_index: list[torch.Tensor]
    block_table: torch.Tensor | None = None


def is_paged_cache(cache: Any) -> bool:
    """Whether ``cache`` is the paged cache of transformers' continuous batching."""
    return cache is not None and isinstance(cache, paged_cache_class())


def check_supported(arguments: PagedBatchArguments) -> None:
    """``ValueError`` for a batch this adapter cannot run, naming the setting that causes it."""
    if arguments.block_table is not None:
        raise ValueError(
            "continuous batching passed a block_table (the flash decode fast path); diffattn "
            "models read the paged cache through read_index/write_index: set "
            "ContinuousBatchingConfig(max_blocks_per_request=0)"
        )
    for name in ("read_index", "write_index"):
        if len(getattr(arguments, name)) != 1:
            raise ValueError(
                f"{name} holds {len(getattr(arguments, name))} layer groups; diffattn models "
                "have one (full attention in every layer)"
            )


def check_paged_call(
    arguments: PagedBatchArguments,
    cache: Any,
    attention_mask: torch.Tensor | None,
    unsupported: dict[str, bool],
) -> None:
    """``ValueError`` unless a continuous-batching call is complete and asks for nothing the
    paged path does not compute: ``unsupported`` maps the names of such requests (a loss,
    embeddings as input, maps, hidden states) to whether they were made.

    Its ``attention_mask`` is ``None`` or the 4-D mask HF builds for ``sdpa``/``eager``
    (block-diagonal causal over the packed requests): the same rule that ``cu_seq_lens_q`` and
    ``cu_seq_lens_k`` state, which :func:`paged_forward` applies per request instead."""
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError(
            "with continuous batching attention_mask is None or HF's 4-D packed mask; got "
            f"shape {tuple(attention_mask.shape)}"
        )
    if not is_paged_cache(cache):
        raise ValueError(
            "cu_seq_lens_q (continuous batching) needs the PagedAttentionCache as `cache`; "
            f"got {type(cache).__name__}"
        )
    missing = [
        name
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index")
        if getattr(arguments, name) is None
    ]
    if missing:
        raise ValueError(f"a continuous-batching call needs {', '.join(missing)} as well")
    refused = sorted(name for name, given in unsupported.items() if given)
    if refused:
        raise ValueError(
            f"continuous batching (a paged cache) does not support {', '.join(refused)}"
        )
    check_supported(arguments)


@dataclass(frozen=True)
class Request:
    """One request of the packed batch: its new tokens ``q_start … q_start + n − 1`` and its keys
    ``k_start … k_start + k_len − 1`` in the read order (cached tokens first)."""

    q_start: int
    n: int
    k_start: int
    k_len: int


def requests_of(arguments: PagedBatchArguments) -> list[Request]:
    """The requests with new tokens (padding requests of length 0 are left out)."""
    cu_q = arguments.cu_seq_lens_q.tolist()
    cu_k = full_attention_lengths(arguments.cu_seq_lens_k).tolist()
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seq_lens_q has {len(cu_q)} entries and cu_seq_lens_k {len(cu_k)}; they must "
            "describe the same requests"
        )
    requests = []
    for i in range(len(cu_q) - 1):
        n, k_len = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if n == 0:
            continue
        if k_len < n:
            raise ValueError(f"request {i} has {n} new tokens but only {k_len} keys")
        requests.append(Request(cu_q[i], n, cu_k[i], k_len))
    return requests


def group_by_length(requests: list[Request]) -> list[list[Request]]:
    """Requests with the same number of new tokens, in order of first appearance."""
    groups: dict[int, list[Request]] = {}
    for request in requests:
        groups.setdefault(request.n, []).append(request)
    return list(groups.values())


class PagedRequests:
    """A group of requests with ``n`` new tokens each, seen by the model as a batch ``(R, n)``
    whose cache holds ``longest − n`` tokens: the cache interface of
    :class:`~diffattn.model.DiffTransformerLM` over the paged cache.

    ``update`` writes the group's new keys and values at their slots and returns each request's
    keys ``(R, H, longest, d)``, left-padded; :attr:`key_mask` marks the real ones."""

    def __init__(
        self, cache: Any, group: list[Request], arguments: PagedBatchArguments, device
    ) -> None:
        self.cache = cache
        self.n = group[0].n
        self.longest = max(r.k_len for r in group)
        lengths = torch.tensor([r.k_len for r in group], device=device)
        slots = torch.arange(self.longest, device=device)
        self.key_mask = (slots[None, :] >= self.longest - lengths[:, None]).long()
        write = arguments.write_index[0]
        read = arguments.read_index[0]
        self.write_index = torch.cat([write[r.q_start : r.q_start + r.n] for r in group])
        if read.numel() == 0:  # nothing cached in the whole batch: keys = the new tokens
            self.read_index = read
            starts = [i * self.n for i in range(len(group))]
        else:
            self.read_index = torch.cat([read[r.k_start : r.k_start + r.k_len] for r in group])
            starts = [0, *torch.tensor([r.k_len for r in group]).cumsum(0)[:-1].tolist()]
        # position j of request r's padded keys reads packed key starts[r] + j − (longest − k_r)
        offsets = torch.tensor(
            [s - (self.longest - r.k_len) for s, r in zip(starts, group, strict=True)],
            device=device,
        )
        self.gather = (offsets[:, None] + slots[None, :]).clamp_min(0)  # pads read a real key
        self.padded = bool((lengths != self.longest).any())

    def get_seq_length(self) -> int:
        """Tokens before the new ones in the padded key layout."""
        return self.longest - self.n

    def update(
        self, layer_index: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        parts = value_parts(k, v)
        v = split_value_heads(v, parts)
        r, h, n, d = k.shape
        packed_k = k.transpose(0, 1).reshape(1, h, r * n, d)  # request-major, as write_index
        packed_v = v.transpose(0, 1).reshape(1, h, r * n, d)
        keys, values = paged_cache_update(
            self.cache, packed_k, packed_v, layer_index, self.read_index, self.write_index
        )
        keys, values = self._unpack(keys), self._unpack(values)
        return keys, merge_value_heads(values, parts)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``(1, H, Σ k_r, d)`` → ``(R, H, longest, d)``, each request's keys at the right end,
        contiguous (as HF's other caches return them)."""
        r = self.gather.shape[0]
        if r == 1 and not self.padded:
            return packed.contiguous()
        rows = packed[0][:, self.gather.reshape(-1)]  # (H, R·longest, d)
        return rows.reshape(rows.shape[0], r, self.longest, -1).transpose(0, 1).contiguous()

    def advance(self) -> None:
        """Nothing to do: the paged cache's lengths are kept by continuous batching."""


def paged_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
    arguments: PagedBatchArguments,
) -> torch.Tensor:
    """The logits ``(1, T, vocab)`` of a packed continuous-batching batch (module docstring);
    rows of padding tokens (past the last request) are zeros."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"continuous batching packs the requests into input_ids of shape (1, tokens); got "
            f"{tuple(input_ids.shape)}"
        )
    if position_ids is None or position_ids.shape != input_ids.shape:
        raise ValueError(
            "continuous batching must pass position_ids of the packed input_ids' shape "
            f"{tuple(input_ids.shape)}; got "
            f"{None if position_ids is None else tuple(position_ids.shape)}"
        )
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "diffattn models run continuous batching without CUDA graphs (requests are grouped "
            "by their lengths on the host): set use_cuda_graph=False"
        )
    device = input_ids.device
    logits = None
    for group in group_by_length(requests_of(arguments)):
        rows = torch.cat(
            [torch.arange(r.q_start, r.q_start + r.n, device=device) for r in group]
        ).view(len(group), -1)
        view = PagedRequests(cache, group, arguments, device)
        out = model(
            input_ids[0, rows],
            attention_mask=view.key_mask,
            past_key_values=view,
            position_ids=position_ids[0, rows].long(),
        )
        if logits is None:
            logits = out.logits.new_zeros(1, input_ids.shape[1], out.logits.shape[-1])
        logits[0, rows.reshape(-1)] = out.logits.reshape(-1, out.logits.shape[-1])
    if logits is None:  # no request has new tokens (a batch of padding only)
        weight = model.embed_tokens.weight
        logits = weight.new_zeros(1, input_ids.shape[1], model.config.vocab_size)
    return logits


__all__ = [
    "PagedBatchArguments",
    "PagedRequests",
    "check_paged_call",
    "check_supported",
    "is_paged_cache",
    "paged_forward",
]
