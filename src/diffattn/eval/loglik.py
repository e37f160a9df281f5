"""Log-likelihood of continuations given contexts, tokenized and summed as lm-evaluation-harness
does it, batched, with shared prefixes computed once.

For a request ``(context, continuation)`` (:func:`encode_request`):

1. trailing whitespace of the context moves to the start of the continuation;
2. ``context + continuation`` and ``context`` are tokenized with the tokenizer's special
   tokens (a BOS where the tokenizer adds one; none when the text already starts with it);
   the continuation's tokens are those of the whole past the context's length;
3. an empty context is the BOS token (EOS when there is no BOS).

The model reads ``(context + continuation)[:-1]``, cut from the left to its context length
``+ 1`` (the harness's ``max_length``); the log-likelihood is the sum of
``log softmax(logits)`` at the continuation's tokens, and ``greedy`` says whether each of
them is the argmax (:func:`score`).

**Shared prefixes.** Under a causal mask the logits of a sequence's first ``n`` positions do
not depend on what follows, so an input that is a prefix of another (e.g. the two one-token
answers of BoolQ share ``context`` as input) is read from the longer one's forward pass. The
reference :func:`score_one_by_one` runs every request alone; tests compare the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from diffattn.eval.common import EvalModel, require_tokenizer
from diffattn.eval.text import context_limit, padded_batches

DEFAULT_MAX_LENGTH = 2048
"""The context length used when a model's config names none (the harness's default)."""


@dataclass(frozen=True)
class Score:
    """The log-likelihood of one continuation and whether greedy decoding produces it."""

    loglikelihood: float
    greedy: bool


def _encode(model: EvalModel, text: str) -> list[int]:
    tokenizer = require_tokenizer(model)
    bos = getattr(tokenizer.backend, "bos_token", None)
    special = not (isinstance(bos, str) and bos and text.startswith(bos))
    return tokenizer.encode(text, special=special)


def prefix_token_id(model: EvalModel) -> int:
    """What an empty context becomes: the BOS token, else EOS."""
    tokenizer = require_tokenizer(model)
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer.backend, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{model.name}: an empty context needs a BOS or EOS token")


def encode_request(model: EvalModel, context: str, continuation: str) -> tuple[list, list]:
    """``(context ids, continuation ids)`` of a request (see the module docstring)."""
    if context == "":
        ids = require_tokenizer(model).encode(continuation, special=False)
        prefix = prefix_token_id(model)
        return ([prefix], ids) if ids[:1] != [prefix] else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = _encode(model, context + continuation)
    context_ids = _encode(model, context)
    return context_ids, whole[len(context_ids) :]


def model_inputs(
    model: EvalModel, requests: Sequence[tuple[str, str]]
) -> list[tuple[tuple[int, ...], list[int]]]:
    """Per request, the token ids the model reads (its last ones predict the continuation)
    and the continuation's ids."""
    limit = context_limit(model) or DEFAULT_MAX_LENGTH
    out = []
    for context, continuation in requests:
        context_ids, continuation_ids = encode_request(model, context, continuation)
        if not continuation_ids:
            raise ValueError(f"continuation {continuation!r} has no tokens after {context!r}")
        if len(continuation_ids) > limit:
            raise ValueError(
                f"a continuation of {len(continuation_ids)} tokens exceeds {model.name}'s "
                f"context of {limit} tokens"
            )
        ids = (context_ids + continuation_ids)[-(limit + 1) :][:-1]
        out.append((tuple(ids), continuation_ids))
    return out


def _read(log_probs: torch.Tensor, length: int, targets: list[int]) -> Score:
    """The score of ``targets`` predicted by the last ``len(targets)`` of the first
    ``length`` positions of ``log_probs`` (``(positions, vocab)``)."""
    rows = log_probs[length - len(targets) : length]
    target = torch.tensor(targets, device=rows.device)
    picked = rows.gather(1, target[:, None])[:, 0]
    return Score(float(picked.sum()), bool((rows.argmax(-1) == target).all()))


@torch.no_grad()
def score(
    model: EvalModel,
    requests: Sequence[tuple[str, str]],
    batch_size: int = 8,
    quiet: bool = True,
    desc: str = "",
) -> list[Score]:
    """The :class:`Score` of every ``(context, continuation)`` request, batched (longest
    first, right padding); inputs that are prefixes of others are not run again."""
    encoded = model_inputs(model, requests)
    unique = sorted({ids for ids, _ in encoded})
    owner: dict[tuple[int, ...], tuple[int, ...]] = {}
    for i in range(len(unique) - 1, -1, -1):  # a prefix sorts right before its extensions
        nxt = unique[i + 1] if i + 1 < len(unique) else None
        extends = nxt is not None and nxt[: len(unique[i])] == unique[i]
        owner[unique[i]] = owner[nxt] if extends else unique[i]
    leaves = sorted({owner[u] for u in unique}, key=lambda s: (-len(s), s))
    waiting: dict[tuple[int, ...], list[int]] = {}
    for index, (ids, _) in enumerate(encoded):
        waiting.setdefault(owner[ids], []).append(index)
    results: list[Score | None] = [None] * len(requests)
    label = desc or f"score {model.name}"
    for group, ids, mask in padded_batches(model, leaves, batch_size, label, quiet):
        logits = model.model(input_ids=ids, attention_mask=mask).logits
        for row, leaf in enumerate(group):
            log_probs = F.log_softmax(logits[row, : len(leaf)].float(), dim=-1)
            for index in waiting[leaf]:
                inp, targets = encoded[index]
                results[index] = _read(log_probs, len(inp), targets)
    return [r for r in results if r is not None]


@torch.no_grad()
def score_one_by_one(model: EvalModel, requests: Sequence[tuple[str, str]]) -> list[Score]:
    """Reference for :func:`score`: every request in its own unpadded forward pass."""
    out = []
    limit = context_limit(model) or DEFAULT_MAX_LENGTH
    for context, continuation in requests:
        context_ids, continuation_ids = encode_request(model, context, continuation)
        full = (context_ids + continuation_ids)[-(limit + 1) :]
        ids = torch.tensor([full[:-1]], device=model.device)
        logits = model.model(input_ids=ids).logits[0].float()
        log_probs = F.log_softmax(logits, dim=-1)
        out.append(_read(log_probs, len(full) - 1, continuation_ids))
    return out
