"""``diffattn eval outliers``: the absmax quantizer, top-k figures against full maps, the 16-bit
loss against eval loss, and the command on diffattn and Hugging Face models."""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers import tiny_diffattn, tiny_hf

from diffattn.eval import loss as eval_loss
from diffattn.eval import outliers
from diffattn.eval.common import batches, load_models
from extras import require_extra

pytestmark = require_extra("hf")

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def _documents(n: int = 24) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(n):
        idx = torch.randint(len(WORDS), (60,), generator=gen).tolist()
        docs.append("def f():\n    return " + " ".join(WORDS[i] for i in idx) + "\n")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of text documents and a BPE trained on them."""
    from diffattn.data import train_bpe

    root = tmp_path_factory.mktemp("corpus")
    data = root / "docs"
    data.mkdir()
    docs = _documents()
    for i, doc in enumerate(docs):
        (data / f"doc{i:02d}.txt").write_text(doc)
    tok = train_bpe(docs, 300, cache_dir=root / "cache")
    return data, tok


def _save_diffattn(directory, tok, attention="diff_v1", seed=0):
    from diffattn.checkpoint import save_model

    model = tiny_diffattn(attention, seed=seed, vocab_size=tok.vocab_size)
    save_model(model, directory, tokenizer=tok)
    return directory


def _save_hf(directory, tok):
    import transformers

    model = tiny_hf("llama", vocab_size=tok.vocab_size)
    model.save_pretrained(str(directory), safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend, eos_token="<|endoftext|>"
    )
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def model_dirs(corpus, tmp_path_factory):
    _, tok = corpus
    root = tmp_path_factory.mktemp("models")
    return {
        "diff_v1": _save_diffattn(root / "diff_v1", tok, "diff_v1"),
        "baseline": _save_diffattn(root / "baseline", tok, "baseline"),
        "llama": _save_hf(root / "llama", tok),
    }


DATA = dict(split="all", seq_len=32, max_tokens=200, batch_size=3)


def test_sixteen_bits_is_identity():
    logits = torch.randn(2, 3, 5, 7)
    allowed = torch.rand(1, 1, 5, 7) > 0.3
    assert outliers.quantize_absmax(logits, allowed, 16) is logits


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_quantizer_error_bound_and_mask(bits):
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 9, 11) * 5
    allowed = torch.ones(9, 11, dtype=torch.bool).tril()[None, None]
    out = outliers.quantize_absmax(logits, allowed, bits)
    levels = 2 ** (bits - 1) - 1
    absmax = logits.abs().masked_fill(~allowed, 0).amax(-1, keepdim=True)
    error = (out - logits).abs()
    bound = absmax / (2 * levels) + 1e-6
    assert bool((error <= bound).masked_fill(~allowed, True).all())
    assert torch.equal(out.masked_select(~allowed.expand_as(out)), logits[~allowed.expand_as(out)])
    # every allowed entry lands on the grid of its row
    steps = (out / (absmax / levels)).masked_fill(~allowed, 0)
    assert torch.allclose(steps, steps.round(), atol=1e-4)
    assert bool((steps.abs() <= levels + 1e-4).all())


def test_quantizer_bad_bits():
    with pytest.raises(ValueError):
        outliers.quantize_absmax(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 1)
    with pytest.raises(ValueError):
        outliers.check_bits([16, 17])


def test_topk_equals_full_maps(model_dirs, corpus):
    from diffattn.probe import AttentionMaps, HiddenStates, Probe

    data, _ = corpus
    (model,) = load_models([str(model_dirs["diff_v1"])])
    docs = eval_loss.documents([str(data)], "all", 0.02, 0)
    pieces = outliers.model_windows(model, docs, 32, 200)
    got = outliers.outlier_stats(model, pieces, batch_size=3)
    maps, states = AttentionMaps(what=("logits",)), HiddenStates()
    logit_values, hidden_values = [], []
    with torch.no_grad(), Probe(model.model, [maps, states]):
        for group in batches(pieces, 3):
            ids, mask = outliers.padded(group, "cpu")
            model.model(input_ids=ids, attention_mask=mask)
    real_tokens = []
    for group in batches(pieces, 3):
        _, mask = outliers.padded(group, "cpu")
        real_tokens.append(mask.bool())
    for layer, calls in maps.result().items():
        for call, real in zip(calls, real_tokens, strict=True):
            for name in ("logits.a1", "logits.a2"):
                x = call[name]
                keep = torch.isfinite(x) & real[:, None, :, None]
                logit_values.append(x[keep].abs())
        for h, real in zip(states.result()[layer], real_tokens, strict=True):
            hidden_values.append(h[real].abs().reshape(-1))
    for key, values in (("logits", logit_values), ("hidden", hidden_values)):
        flat = torch.cat(values).double()
        top = torch.topk(flat, 100).values
        for name, rank in (("top1", 1), ("top2", 2), ("top3", 3), ("top10", 10), ("top100", 100)):
            assert got[key][name] == pytest.approx(float(top[rank - 1]), rel=1e-6)
        assert got[key]["count"] == flat.numel()
        assert got[key]["median"] == pytest.approx(float(flat.median()), rel=0.02)


def test_sixteen_bit_loss_equals_eval_loss(model_dirs, corpus):
    data, _ = corpus
    (model,) = load_models([str(model_dirs["baseline"])])
    got = outliers.run([model], data=[str(data)], bits=[16, 4], **DATA)
    ref = eval_loss.run([model], data=[str(data)], **DATA)
    entry = got["models"][model.name]
    assert entry["quantized_loss"][16] == pytest.approx(ref["models"][model.name]["loss"], abs=1e-9)
    assert entry["quantized_loss"][4] != entry["quantized_loss"][16]
    assert entry["counts"]["targets"] == ref["models"][model.name]["counts"]["tokens"]


def test_cli_writes_outputs(model_dirs, corpus, tmp_path):
    from diffattn.cli import main

    data, _ = corpus
    out = tmp_path / "out"
    code = main(
        [
            "eval",
            "outliers",
            str(model_dirs["diff_v1"]),
            "--compare",
            str(model_dirs["llama"]),
            "--out",
            str(out),
            "--data",
            str(data),
            "--split",
            "all",
            "--seq-len",
            "32",
            "--max-tokens",
            "150",
            "--bits",
            "16",
            "6",
            "4",
            "--quiet",
        ]
    )
    assert code == 0
    record = json.loads((out / "results.json").read_text())
    assert record["experiment"] == "outliers"
    assert len(record["results"]["models"]) == 2
    for entry in record["results"]["models"].values():
        assert set(entry["quantized_loss"]) == {"16", "6", "4"}
        assert entry["logits"]["top1"] >= entry["logits"]["top100"] > 0
        assert entry["hidden"]["top1"] >= entry["hidden"]["median"] > 0
        assert set(entry["logits_layers"]) == {"0", "1"}
    assert (out / "outliers_topk.png").stat().st_size > 0
    assert (out / "quantized_loss.png").stat().st_size > 0
    assert "Table 5" in (out / "report.md").read_text()


def test_cli_bad_bits_is_one_line(model_dirs, corpus, tmp_path, capsys):
    from diffattn.cli import main

    data, _ = corpus
    argv = ["eval", "outliers", str(model_dirs["baseline"]), "--out", str(tmp_path / "o")]
    code = main([*argv, "--data", str(data), "--split", "all", "--bits", "1", "--quiet"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--bits" in err
