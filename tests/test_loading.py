"""diffattn.loading: one entry point for diffattn, Hugging Face, GGUF and Dex sources."""

from __future__ import annotations

import json

import pytest
import torch

from diffattn import dex
from diffattn.checkpoint import save_model
from diffattn.dex.adapter import dex_sites
from diffattn.fileio import CheckpointError
from diffattn.loading import load_model_and_tokenizer, resolve_source
from extras import require_extra
from helpers import TINY_VOCAB, tiny_diffattn

pytestmark = require_extra("hf")

IDS = torch.randint(0, TINY_VOCAB, (2, 7), generator=torch.Generator().manual_seed(11))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_diffattn_directory(tmp_path, tiny_diff_v2, with_tokenizer):
    tokenizer = word_tokenizer() if with_tokenizer else None
    directory = save_model(tiny_diff_v2, tmp_path / "m", tokenizer=tokenizer)
    model, loaded_tokenizer, source = load_model_and_tokenizer(directory)
    assert (source.kind, source.path, source.model_type) == ("diffattn", directory, "diffattn")
    assert not model.training
    assert torch.equal(logits(model), logits(tiny_diff_v2))
    if with_tokenizer:
        assert loaded_tokenizer.encode("hello world")[-2:] == [2, 3]
    else:
        assert loaded_tokenizer is None


def test_hf_directory(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path / "hf")
    word_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    model, tokenizer, source = load_model_and_tokenizer(tmp_path / "hf")
    assert (source.kind, source.model_type) == ("hf", "llama")
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    torch.testing.assert_close(logits(model), logits(tiny_llama), rtol=0, atol=1e-6)
    assert tokenizer is not None
    with pytest.raises(CheckpointError, match="apply to diffattn model directories only"):
        load_model_and_tokenizer(tmp_path / "hf", backend="sdpa")


def dex_model(base_dir):
    model = load_model_and_tokenizer(base_dir).model
    dex.apply(model, {0: [0, 1], 1: [2]}, anneal_steps=4)
    dex.set_step(model, 3)
    with torch.no_grad():
        for _, layer in dex_sites(model):
            layer.w_d.add_(0.1 * torch.randn_like(layer.w_d))
    return model.eval()


def test_dex_adapter_and_run_directories(tmp_path):
    base = save_model(tiny_diffattn(), tmp_path / "base", tokenizer=word_tokenizer())
    trained = dex_model(base)
    run = tmp_path / "run"
    dex.save_adapter(trained, run / "adapter")
    (run / "dex_run.json").write_text(json.dumps({"model": str(base)}))
    # dex train's own training checkpoints beside the adapter: the run is no diffattn train run
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)

    model, tokenizer, source = load_model_and_tokenizer(run)  # base from dex_run.json
    assert (source.kind, source.path, source.base.path) == ("dex", run / "adapter", base)
    assert dex.is_dex(model) and not model.training and tokenizer is not None
    torch.testing.assert_close(logits(model), logits(trained), rtol=0, atol=0)

    alone = tmp_path / "alone"
    dex.save_adapter(trained, alone)
    with pytest.raises(CheckpointError, match=r"pass base=MODEL"):
        load_model_and_tokenizer(alone)
    model = load_model_and_tokenizer(alone, base=base).model
    torch.testing.assert_close(logits(model), logits(trained), rtol=0, atol=0)

    (alone / "dex_config.json").write_text('{"format": "diffattn-dex",\n "version": 1,,}')
    with pytest.raises(ValueError, match=r"dex_config\.json: not valid JSON \(line 2"):
        load_model_and_tokenizer(alone, base=base)


def test_classification_and_errors_name_the_path(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.gguf").write_bytes(b"GGUF")
    assert resolve_source(tmp_path / "one").kind == "gguf"
    assert resolve_source(tmp_path / "one" / "m.gguf").path == tmp_path / "one" / "m.gguf"
    with pytest.raises(CheckpointError, match=r"missing: no such file or directory; expected"):
        resolve_source(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: no config\.json, dex_config\.json or"):
        resolve_source(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"notes\.txt: not a model directory"):
        resolve_source(tmp_path / "notes.txt")
    (tmp_path / "typeless").mkdir()
    (tmp_path / "typeless" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"config\.json: no model_type"):
        resolve_source(tmp_path / "typeless")


def test_a_missing_or_broken_tokenizer_is_one_line_naming_the_files(tmp_path):
    from diffattn.loading import load_saved_tokenizer

    (tmp_path / "bare").mkdir()
    with pytest.raises(CheckpointError) as missing:
        load_saved_tokenizer(tmp_path / "bare")
    message = str(missing.value)
    assert "\n" not in message and "tokenizer.json and tokenizer_config.json" in message
    assert "save_model(model, dir, tokenizer=...)" in message
    (tmp_path / "bare" / "tokenizer.json").write_text("{\n not json")
    with pytest.raises(CheckpointError, match="cannot load the tokenizer") as broken:
        load_saved_tokenizer(tmp_path / "bare")
    assert "\n" not in str(broken.value)


def test_loading_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, diffattn.loading; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_truncated_hf_weights_name_the_file(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or padded"):
        load_model_and_tokenizer(tmp_path / "hf")
    weights.write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load_model_and_tokenizer(tmp_path / "hf")


def test_a_hub_id_is_downloaded_when_no_such_path_exists(tmp_path, monkeypatch):
    import huggingface_hub

    from diffattn import loading

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    calls = []

    def fake_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    source = loading.resolve_source("someone/tiny-llama")
    assert source.kind == "hf" and source.path == snapshot
    assert calls[0][0] == "someone/tiny-llama" and "*.safetensors" in calls[0][1]
    assert not any("bin" in p for p in calls[0][1])

    def offline(repo_id, allow_patterns):
        raise OSError("We couldn't connect to the hub.\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="could not provide it") as error:
        loading.resolve_source("someone/other")
    assert "\n" not in str(error.value)
