"""Watching Hugging Face attention: an ``AttentionInterface`` function of ours.

While a probe watches a Hugging Face model, the model's ``attn_implementation`` is switched to
``"diffattn_probe"`` (and back afterwards). Its mask function builds boolean masks (``True`` =
may attend); its attention function runs the observed reference computation of
:mod:`diffattn.attention.observe` for the layers the probe watches and hands every other call to
the implementation the model had (``sdpa`` or ``eager``), so unwatched layers keep their speed
and their numbers.

DiffLlama calls attention twice per layer with the same Q and K (once per half of V) and pairs
head ``h`` with ``h + H/2``; the first call is observed and reported as a DIFF V1 event
(``a1``, ``a2``, λ and ``A1 − λ·A2``), the second is delegated.

Padding: query rows that are padding read only themselves here (the diffattn rule), where HF's
kernels may give them other values; real tokens are unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from diffattn.attention.diff_v1 import reparameterised_lambda
from diffattn.attention.mask import AttentionMask
from diffattn.attention.observe import (
    AttentionEvent,
    AttentionObserver,
    ObservedCall,
    observed_softmax,
)
from diffattn.attention.registry import ENTRY_DIFF, ENTRY_SOFTMAX

IMPLEMENTATION = "diffattn_probe"

_WATCHERS: list[HFWatch] = []


class HFWatch:
    """The state of one probe on one Hugging Face model."""

    def __init__(self, model: nn.Module, observer: AttentionObserver) -> None:
        self.model = model
        self.observer = observer
        self.original = model.config._attn_implementation or "eager"
        self.calls: dict[int, int] = {}

    def owns(self, module: nn.Module) -> bool:
        return any(m is module for m in self.model.modules())


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if IMPLEMENTATION in AttentionInterface._global_mapping:
        return

    def bool_mask(*args, **kwargs):
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, bool_mask)
    AttentionInterface.register(IMPLEMENTATION, probe_attention)


def _delegate(original: str, module, query, key, value, mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if original == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        if mask is not None and mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            mask = torch.where(mask, zero, torch.finfo(query.dtype).min)
        return eager_attention_forward(module, query, key, value, mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[original](module, query, key, value, mask, **kwargs)


def _allowed(mask: torch.Tensor | None, n: int, s: int, device) -> torch.Tensor:
    if mask is None:
        return AttentionMask(query_offset=s - n).dense(n, s, device)
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    allowed = allowed[..., -s:]
    # A row with nothing to read (a padding query) reads itself, as in diffattn.
    empty = ~allowed.any(-1, keepdim=True)
    q_pos = torch.arange(n, device=device)[:, None] + (s - n)
    diagonal = torch.arange(s, device=device)[None, :] == q_pos
    return allowed | (empty & diagonal)


class _DiffLlamaEvents(AttentionObserver):
    """Re-express a DiffLlama softmax event over H heads as a DIFF V1 event over H/2 pairs."""

    def __init__(self, module: nn.Module, observer: AttentionObserver) -> None:
        self.module, self.observer = module, observer
        self.block_rows = observer.block_rows
        with torch.no_grad():
            self.lam = reparameterised_lambda(module)

    def transform_logits(self, layer, logits, allowed):
        return self.observer.transform_logits(layer, logits, allowed)

    def on_attention(self, event: AttentionEvent) -> None:
        h = event.probs["a"].shape[1] // 2
        probs, logits = event.probs["a"], event.logits["a"]
        event.kind = ENTRY_DIFF
        event.probs = {"a1": probs[:, :h], "a2": probs[:, h:]}
        event.logits = {"a1": logits[:, :h], "a2": logits[:, h:]}
        event.lam = self.lam.to(probs.device)
        event.applied = event.probs["a1"] - event.lam * event.probs["a2"]
        self.observer.on_attention(event)


def probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """The ``diffattn_probe`` attention function (signature of HF's attention functions)."""
    watch = next((w for w in reversed(_WATCHERS) if w.owns(module)), None)
    layer = getattr(module, "layer_idx", None)
    kwargs = dict(scaling=scaling, dropout=dropout, **kw)
    if watch is None:
        return _delegate("sdpa", module, query, key, value, attention_mask, **kwargs)
    if layer is None or not watch.observer.observes(layer):
        return _delegate(watch.original, module, query, key, value, attention_mask, **kwargs)
    observer = watch.observer
    if hasattr(module, "lambda_q1"):  # DiffLlama: observe the first of its two calls
        count = watch.calls.get(id(module), 0)
        watch.calls[id(module)] = count + 1
        if count % 2 == 1:
            return _delegate(watch.original, module, query, key, value, attention_mask, **kwargs)
        observer = _DiffLlamaEvents(module, observer)
    n, s = query.shape[2], key.shape[2]
    allowed = _allowed(attention_mask, n, s, query.device)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    call = ObservedCall(
        ENTRY_SOFTMAX,
        layer,
        AttentionMask(query_offset=s - n),
        scale,
        (observer,),
        source=getattr(module.config, "model_type", "hf"),
        dense_mask=lambda start, rows: allowed[:, :, start : start + rows],
    )
    out = observed_softmax(call, query, key, value)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def watching(model: nn.Module, observer: AttentionObserver) -> Iterator[HFWatch]:
    """Route ``model``'s attention through :func:`probe_attention` inside the block."""
    _register()
    watch = HFWatch(model, observer)
    _WATCHERS.append(watch)
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        yield watch
    finally:
        _WATCHERS.remove(watch)
        model.set_attn_implementation(watch.original)
