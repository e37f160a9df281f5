"""Constrained decoding over a label set through a token-level trie, after a shared prompt
prefix whose KV cache is computed once (the many-shot ICL protocol of DIFF V1 §3.5, which
follows Bertsch et al. 2024 and the constrained decoding of Ratner et al. 2023).

* :class:`LabelTrie`: the tokenized labels (each ending with a terminator token, so that no
  label is a prefix of another) as a trie; a path from the root to a leaf is exactly one label.
* :class:`SharedPrefix`: the demonstrations, run once; every batch of test items continues from
  a copy of its cache (``past_key_values``: diffattn's and Hugging Face's caches). With
  ``use_cache=False`` (or a model that returns no cache) every call re-runs prefix + item in
  full: the reference the cached path is tested against.
* :func:`greedy_labels`: greedy decoding where each step may only pick a token that continues
  some label (argmax of the logits restricted to the trie node's children) until a leaf.
* :func:`label_logprobs`: the full log-probability of every label (terminator included), for
  the ``scored`` rule (argmax over labels of Σ log p).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class LabelTrie:
    """A trie over token sequences, one per label; leaves are labels."""

    def __init__(self, sequences: Mapping[str, Sequence[int]]) -> None:
        if not sequences:
            raise ValueError("the label set is empty")
        self.children: list[dict[int, int]] = [{}]
        self.label_at: list[str | None] = [None]
        self.sequences = {label: [int(t) for t in seq] for label, seq in sequences.items()}
        for label, seq in self.sequences.items():
            if not seq:
                raise ValueError(f"label {label!r} has no tokens")
            node = 0
            for token in seq:
                if self.label_at[node] is not None:
                    raise ValueError(
                        f"label {self.label_at[node]!r} is a token prefix of {label!r}"
                    )
                nxt = self.children[node].get(token)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][token] = nxt
                    self.children.append({})
                    self.label_at.append(None)
                node = nxt
            if self.children[node] or self.label_at[node] is not None:
                other = self.label_at[node] or "another label"
                raise ValueError(f"label {label!r} is a token prefix of, or equal to, {other!r}")
            self.label_at[node] = label
        self.depth = max(len(seq) for seq in self.sequences.values())

    def allowed(self, node: int) -> list[int]:
        return list(self.children[node])

    def step(self, node: int, token: int) -> int:
        return self.children[node][token]

    def label(self, node: int) -> str | None:
        return self.label_at[node]


def fork_cache(cache: Any, rows: int) -> Any:
    """A copy of a one-row KV cache repeated to ``rows`` rows; ``cache`` is left unchanged."""
    if hasattr(cache, "batch_repeat_interleave"):  # Hugging Face caches
        forked = copy.deepcopy(cache)
        forked.batch_repeat_interleave(rows)
        return forked
    if hasattr(cache, "reorder") and hasattr(cache, "keys"):  # diffattn.cache.DynamicCache
        forked = type(cache)()
        forked.keys, forked.values = list(cache.keys), list(cache.values)
        forked.reorder(torch.zeros(rows, dtype=torch.long, device=cache.keys[0].device))
        return forked
    raise ValueError(f"cannot copy a KV cache of type {type(cache).__name__}")


@dataclass
class Extension:
    """Items continued from a prefix: their last real logits and what the next step needs."""

    last_logits: torch.Tensor  # (B, V), fp32
    lengths: list[int]  # tokens after the prefix, per row
    mask: torch.Tensor | None  # (B, prefix + width) for the cached path
    cache: Any
    rows: list[list[int]]  # the tokens after the prefix, per row (uncached path)


class SharedPrefix:
    """A prompt prefix run once; :meth:`logits` continues it with a batch of token rows and
    :meth:`step` appends one token per row."""

    def __init__(self, model: nn.Module, ids: Sequence[int], use_cache: bool = True) -> None:
        self.model = model
        self.ids = [int(i) for i in ids]
        self.device = next(model.parameters()).device
        self.cache = None
        if use_cache and self.ids:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([self.ids], device=self.device), use_cache=True)
            self.cache = getattr(out, "past_key_values", None)

    @property
    def cached(self) -> bool:
        return self.cache is not None

    @torch.no_grad()
    def logits(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Extension]:
        """Logits ``(B, width, V)`` (fp32) at every token of each row after the prefix (right
        padding; positions past a row's end are meaningless) and the :class:`Extension`."""
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("every row needs at least one token")
        lengths = [len(r) for r in rows]
        width, batch, n_prefix = max(lengths), len(rows), len(self.ids)
        ids = torch.zeros(batch, width, dtype=torch.long)
        row_mask = torch.zeros(batch, width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(list(row))
            row_mask[i, : len(row)] = 1
        if self.cached:
            cache = fork_cache(self.cache, batch)
            mask = torch.cat([torch.ones(batch, n_prefix, dtype=torch.long), row_mask], 1)
            positions = torch.arange(n_prefix, n_prefix + width).expand(batch, width)
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits.float()
            cache = out.past_key_values if out.past_key_values is not None else cache
        else:
            full = torch.cat([torch.tensor([self.ids] * batch, dtype=torch.long), ids], 1)
            mask = torch.cat([torch.ones(batch, n_prefix, dtype=torch.long), row_mask], 1)
            out = self.model(input_ids=full.to(self.device), attention_mask=mask.to(self.device))
            logits = out.logits[:, n_prefix:].float()
            cache, mask = None, None
        last = logits[torch.arange(batch), torch.tensor(lengths) - 1]
        extension = Extension(last, lengths, mask, cache, [list(r) for r in rows])
        return logits, extension

    @torch.no_grad()
    def step(self, extension: Extension, tokens: Sequence[int]) -> Extension:
        """Append one token per row; the new last logits."""
        batch = len(tokens)
        if not self.cached:
            rows = [[*row, int(t)] for row, t in zip(extension.rows, tokens, strict=True)]
            _, nxt = self.logits(rows)
            return nxt
        mask = torch.cat([extension.mask, torch.ones(batch, 1, dtype=torch.long)], 1)
        # The new token follows the prefix and the row's tokens so far (padding has no place).
        positions = torch.tensor([[len(self.ids) + n] for n in extension.lengths])
        out = self.model(
            input_ids=torch.tensor([[int(t)] for t in tokens], device=self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=extension.cache,
            use_cache=True,
        )
        cache = out.past_key_values if out.past_key_values is not None else extension.cache
        rows = [[*row, int(t)] for row, t in zip(extension.rows, tokens, strict=True)]
        lengths = [n + 1 for n in extension.lengths]
        return Extension(out.logits[:, -1].float(), lengths, mask, cache, rows)


def greedy_labels(
    prefix: SharedPrefix, items: Sequence[Sequence[int]], trie: LabelTrie
) -> list[str]:
    """Constrained greedy decoding of one label per item (see the module docstring)."""
    _, extension = prefix.logits(items)
    nodes = [0] * len(items)
    labels: list[str | None] = [None] * len(items)
    for _ in range(trie.depth):
        tokens = []
        for i, node in enumerate(nodes):
            if labels[i] is not None:
                tokens.append(0)
                continue
            allowed = trie.allowed(node)
            scores = extension.last_logits[i, allowed]
            token = allowed[int(scores.argmax())]
            nodes[i] = trie.step(node, token)
            labels[i] = trie.label(nodes[i])
            tokens.append(token)
        if all(label is not None for label in labels):
            break
        extension = prefix.step(extension, tokens)
    return [str(label) for label in labels]


def label_logprobs(
    prefix: SharedPrefix,
    item: Sequence[int],
    trie: LabelTrie,
    batch_size: int = 16,
) -> dict[str, float]:
    """Σ log p of each label's tokens after ``prefix`` + ``item``."""
    names = list(trie.sequences)
    scores: dict[str, float] = {}
    for start in range(0, len(names), batch_size):
        chunk = names[start : start + batch_size]
        rows = [[*item, *trie.sequences[name]] for name in chunk]
        logits, _ = prefix.logits(rows)
        logprobs = torch.log_softmax(logits, -1)
        for r, name in enumerate(chunk):
            seq = trie.sequences[name]
            at = torch.arange(len(item) - 1, len(item) - 1 + len(seq))
            scores[name] = float(logprobs[r, at, torch.tensor(seq)].double().sum())
    return scores
