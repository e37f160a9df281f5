"""A tiny pretrained HF Llama saved with its tokenizer, and the training overrides that point
the Dex runs of the pinning tests (``test_dex_*_pins``, ``test_dex_compare_report``) at a small
word corpus."""

from __future__ import annotations

from pathlib import Path

from helpers import tiny_hf, word_corpus


def tiny_llama_run(root: Path, paragraphs: int = 120) -> dict:
    """``{"root", "model", "sets"}``: ``model`` is the saved model's folder, ``sets`` the
    ``key=value`` training-config entries (data, sequence length, evaluation, CPU)."""
    corpus, tokenizer = word_corpus(root, paragraphs)
    model_dir = root / "llama"
    tiny_hf("llama", vocab_size=tokenizer.vocab_size, max_position_embeddings=128).save_pretrained(
        model_dir
    )
    tokenizer.save(model_dir)
    sets = [
        f"data.sources=[{corpus}]", "data.document_split=paragraph", "data.valid_fraction=0.2",
        f"data.cache_dir={root / 'cache'}", "seq_len=32", "eval_batches=2", "device=cpu",
    ]  # fmt: skip
    return {"root": root, "model": str(model_dir), "sets": sets}
