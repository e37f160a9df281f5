"""Every ``diffattn eval`` experiment on every kind of model: the three diffattn attention
types, a Hugging Face Llama, and that Llama with a Dex adapter (loaded with ``--dex``)."""

from __future__ import annotations

import pytest
import torch

from diffattn import dex
from diffattn.checkpoint import save_model
from diffattn.data import train_bpe
from diffattn.eval import effective, heads, hessian, loss, needle, outliers
from diffattn.eval.common import load_models
from extras import require_extra
from helpers import ATTENTIONS, tiny_diffattn, tiny_hf

pytestmark = require_extra("hf")

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 1\n    y = 2\n"
    "The magic number of Paris is 1234567.\n"
) * 20
DATA = dict(split="all", seq_len=32, max_tokens=128)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("zoo")
    bpe = train_bpe([TEXT] * 5, 300, cache_dir=root / "bpe")
    specs = {}
    for attention in ATTENTIONS:
        model = tiny_diffattn(attention, vocab_size=bpe.vocab_size, max_seq_len=512)
        specs[attention] = str(save_model(model, root / attention, tokenizer=bpe))
    bpe.save(root / "tok")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(root / "tok" / "tokenizer.json"))
    llama = tiny_hf("llama", vocab_size=bpe.vocab_size, max_position_embeddings=512)
    llama.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    specs["llama"] = str(root / "llama")
    dex.apply(llama, heads={0: [1], 1: [0, 3]}, anneal_steps=0, lambda_learn_init=0.5)
    dex.save_adapter(llama, root / "adapter")
    (root / "data.txt").write_text(TEXT)
    return specs, root


KINDS = [*ATTENTIONS, "llama", "llama+dex"]


def _model(zoo, kind):
    specs, root = zoo
    if kind == "llama+dex":
        return load_models([specs["llama"]], dex=str(root / "adapter"))
    return load_models([specs[kind]])


@pytest.mark.parametrize("kind", KINDS)
def test_every_experiment_runs(zoo, kind):
    _, root = zoo
    models = _model(zoo, kind)
    data = dict(data=[str(root / "data.txt")], **DATA)
    name = models[0].name
    results = [
        loss.run(models, batch_size=2, **data),
        outliers.run(models, bits=(16, 4), batch_size=2, **data),
        heads.run(models, batch_size=2, **data),
        hessian.run(models, batches=1, iters=3, batch_size=2, **data),
        needle.run(models, needles=2, queries=1, lengths=[200], depths=[50], samples=1),
    ]
    for result in results:
        assert name in result["models"], result.keys()
    assert torch.isfinite(torch.tensor(results[0]["models"][name]["loss"]))
    if kind == "llama+dex":
        rows = effective.run(models, windows=1, max_heads=2, steps=5, **data)["models"][name]
        assert [(h["layer"], h["head"]) for h in rows["heads"]] == [(0, 1), (1, 0)]
