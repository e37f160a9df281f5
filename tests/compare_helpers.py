"""The tiny ``diffattn compare`` the compare tests run: a corpus of small Python files and the
recipe overrides that train on it in seconds on one CPU thread."""

from __future__ import annotations

from pathlib import Path

TEXT = "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, item):\n"


def write_corpus(root: Path, documents: int = 24) -> Path:
    """``documents`` small Python files in ``root`` (created), each a few times :data:`TEXT`."""
    root.mkdir()
    for i in range(documents):
        (root / f"doc{i:02d}.py").write_text(f"# document {i}\n" + TEXT * (3 + i % 4))
    return root


def tiny_overrides(corpus: Path, cache: Path) -> list[str]:
    """Recipe overrides: a BPE-300 tokenizer on ``corpus`` (cached in ``cache``), a 2-layer
    d_model-32 model, batches of 4 × 32 tokens, validated and checkpointed every 2 steps."""
    return [
        f"data.sources=[{corpus}]", "data.tokenizer=bpe:300", "data.valid_fraction=0.2",
        "data.max_bytes=null", f"data.cache_dir={cache}", "model.vocab_size=300",
        "model.d_model=32", "model.n_heads=4", "model.n_layers=2", "global_batch_size=4",
        "micro_batch_size=4", "seq_len=32", "schedule.warmup_steps=1", "log_every=1",
        "eval_every=2", "eval_batches=1", "checkpoint_every=2", "device=cpu",
    ]  # fmt: skip
