"""Whether a model's saved tokenizer is the one its training shards were tokenised with.

A model directory (a checkpoint, an ``init_from`` model) holds the tokenizer it was trained
with (``tokenizer.json``, ``tokenizer_config.json``). Shards from another tokenizer give the
model ids that mean other text; :func:`tokenizer_mismatch` tells the two apart by what matters:
the vocabulary size, the EOS id, and the ids both give for a fixed probe text followed by the
text of the shards' first training documents (decoded with the shards' tokenizer). A tiktoken
encoding and its saved HF form encode alike, so they match.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from diffattn.data.shards import ShardSet
from diffattn.data.tokenizers import Tokenizer, load_hf_tokenizer
from diffattn.fileio import read_json

PROBE = (
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{} "
    "def f(x):\n    return x ** 2  # café, naïve, Ελληνικά, 日本語, emoji 🙂\n\n"
)
PROBE_TOKENS = 512
"""Tokens of the shards' first training documents added to the probe."""


def _probe(tokenizer: Tokenizer, shards: ShardSet) -> str:
    if shards.num_tokens == 0:
        return PROBE
    ids = shards.read(0, min(PROBE_TOKENS, shards.num_tokens))
    ids = ids[ids != shards.eos_id]
    return PROBE + tokenizer.decode(np.asarray(ids).tolist())


def _describe(name: str, tokenizer: Tokenizer) -> str:
    return f"{name} (vocab {tokenizer.vocab_size}, EOS {tokenizer.eos_id})"


def tokenizer_mismatch(tokenizer: Tokenizer, shards: ShardSet, model_dir: Path) -> str | None:
    """``None`` when ``model_dir`` has no saved tokenizer or one that encodes like
    ``tokenizer`` (the shards'); else one line naming both."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        return None
    saved = load_hf_tokenizer(model_dir)
    config = model_dir / "tokenizer_config.json"
    name = read_json(config).get("name") if config.is_file() else None
    saved_name = name if isinstance(name, str) else str(model_dir / "tokenizer.json")
    text = _probe(tokenizer, shards)
    same_sizes = (saved.vocab_size, saved.eos_id) == (tokenizer.vocab_size, tokenizer.eos_id)
    if same_sizes and saved.encode(text) == tokenizer.encode(text):
        return None
    why = "" if not same_sizes else "; they encode the same text differently"
    return (
        f"the shards' tokenizer {_describe(tokenizer.name, tokenizer)} differs from the "
        f"model's in {model_dir}: {_describe(saved_name, saved)}{why}; train with the "
        "model's tokenizer (data.tokenizer: hf:DIR)"
    )
