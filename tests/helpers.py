"""Tiny models shared by the tests: diffattn models of every attention type and small Hugging
Face Llama-family models, all with 128 tokens, width 64, 2 layers, 4 query and 2 key/value
heads, built from a fixed seed in eval mode."""

from __future__ import annotations

import socket
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from diffattn import DiffTransformerLM, ModelConfig

ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
HF_KINDS = ("llama", "qwen2", "mistral")
TINY_VOCAB = 128
TINY_FIELDS = dict(vocab_size=TINY_VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
"""The shape of every tiny model (``ModelConfig`` fields)."""


def tiny_config(attention: str = "baseline", **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a tiny diffattn model (``overrides`` replace fields)."""
    return ModelConfig(**{**TINY_FIELDS, "attention": attention, **overrides})


def tiny_diffattn(
    attention: str = "baseline", seed: int = 0, **overrides: Any
) -> DiffTransformerLM:
    """A tiny diffattn model in eval mode, initialised from ``seed``."""
    torch.manual_seed(seed)
    return DiffTransformerLM(tiny_config(attention, **overrides)).eval()


def tiny_hf(kind: str = "llama", seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny Hugging Face ``LlamaForCausalLM`` (or ``qwen2`` / ``mistral`` / ``diffllama``) in
    eval mode;
    ``overrides`` replace config fields (e.g. ``num_attention_heads=8``)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "diffllama": (transformers.DiffLlamaConfig, transformers.DiffLlamaForCausalLM),
    }[kind]
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        intermediate_size=128,
    )
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**fields, **overrides})).eval()


def tiny_model(kind: str, seed: int = 0) -> nn.Module:
    """A tiny model by name: an HF kind (:data:`HF_KINDS`), an attention type, or
    ``"diffattn"`` for the diffattn baseline."""
    if kind in HF_KINDS:
        return tiny_hf(kind, seed)
    return tiny_diffattn("baseline" if kind == "diffattn" else kind, seed)


WORDS = "alpha beta gamma delta epsilon zeta theta kappa sigma omega def return class".split()  # noqa: SIM905


def word_corpus(root, paragraphs: int):
    """A seeded corpus of ``paragraphs`` word paragraphs in ``root/corpus.txt`` and a 300-token
    BPE trained on it: ``(corpus path, tokenizer)``."""
    import random

    from diffattn.data import train_bpe

    rng = random.Random(0)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 90))) for _ in range(paragraphs)
    ]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(texts))
    return corpus, train_bpe(texts, 300, cache_dir=root / "bpe")


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` (loopback) now, for a server or a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def record_documents(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Make every ``DiffTransformerLM`` forward of the test append ``(input_ids,
    document_ids)`` to the returned list (the documents as given, ``None`` when none are)."""
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    forward = DiffTransformerLM.forward

    def recording(self, input_ids=None, *args, document_ids=None, **kwargs):
        seen.append((input_ids, document_ids))
        return forward(self, input_ids, *args, document_ids=document_ids, **kwargs)

    monkeypatch.setattr(DiffTransformerLM, "forward", recording)
    return seen
