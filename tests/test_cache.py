"""KV caches: chunked prefill then token-by-token decode equals the full forward."""

from __future__ import annotations

import pytest
import torch

from diffattn import DiffTransformerLM, ModelConfig, presets
from diffattn.cache import DynamicCache, StaticCache, cache_bytes_per_token

TYPES = ["baseline", "diff_v1", "diff_v2"]


def _model(attention: str, backend: str) -> DiffTransformerLM:
    cfg = ModelConfig(
        vocab_size=50,
        d_model=64,
        n_layers=3,
        n_heads=8,
        n_kv_heads=4,
        head_dim=8,
        max_seq_len=40,
        attention=attention,
        backend=backend,
    )
    model = DiffTransformerLM(cfg)
    with torch.no_grad():  # move λ and norms off their init values
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("attention", TYPES)
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_chunked_prefill_then_decode_equals_full_forward(attention, backend, cache_kind):
    model = _model(attention, backend)
    ids = torch.randint(0, 50, (2, 21))
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :4] = 0  # row 1 is left-padded
    full = model(ids, attention_mask=mask).logits

    cache = DynamicCache() if cache_kind == "dynamic" else StaticCache(model.config, 2, 32)
    pieces, start = [], 0
    for stop in (9, 14, *range(15, 22)):  # two prefill chunks, then one token at a time
        out = model(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache)
        assert out.past_key_values is cache and cache.get_seq_length() == stop
        pieces.append(out.logits)
        start = stop
    stepped = torch.cat(pieces, dim=1)
    real = mask.bool()
    assert _rel(stepped[real], full[real]) <= 1e-5


@pytest.mark.parametrize("attention", TYPES)
def test_decode_without_mask_and_use_cache(attention):
    model = _model(attention, "sdpa")
    ids = torch.randint(0, 50, (1, 12))
    full = model(ids).logits
    out = model(ids[:, :7], use_cache=True)
    logits = [out.logits]
    for t in range(7, 12):
        out = model(ids[:, t : t + 1], past_key_values=out.past_key_values)
        logits.append(out.logits)
    assert _rel(torch.cat(logits, 1), full) <= 1e-5


def test_cache_respects_max_seq_len():
    model = _model("baseline", "sdpa")
    out = model(torch.zeros(1, 40, dtype=torch.long), use_cache=True)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, 1, dtype=torch.long), past_key_values=out.past_key_values)
    with pytest.raises(ValueError, match="max_len"):
        StaticCache(model.config, 1, 41)
    cache = StaticCache(model.config, 1, 8)
    with pytest.raises(ValueError, match="full"):
        model(torch.zeros(1, 9, dtype=torch.long), past_key_values=cache)


def test_cache_holds_the_same_bytes_for_every_type_at_matched_size():
    sizes = set()
    for attention in TYPES:
        cfg = presets.get("1.4B", attention=attention)
        sizes.add(cache_bytes_per_token(cfg))
        model = _model(attention, "sdpa")
        out = model(torch.zeros(1, 5, dtype=torch.long), use_cache=True)
        cache = out.past_key_values
        stored = sum(t.numel() for t in cache.keys + cache.values) // 5
        assert stored * 4 == cache_bytes_per_token(model.config, torch.float32)
    assert sizes == {2 * 24 * 16 * 128 * 2}  # K and V, 24 layers, 16 KV heads, d=128, bf16
