"""NaN/Inf weights are refused when loading, naming the first bad tensor, on every loader
path (diffattn directories, Hugging Face directories and the GGUF exports read like them),
and ``diffattn generate`` reports it as one line with exit code 2."""

from __future__ import annotations

import pytest
import torch

from diffattn.cli import main
from diffattn.fileio import CheckpointError
from diffattn.loading import load_model


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_hf_directory_with_non_finite_weights_is_refused(tmp_path, tiny_llama, bad):
    with torch.no_grad():
        tiny_llama.model.layers[1].mlp.down_proj.weight[0, 0] = bad
    tiny_llama.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    word = "NaN" if bad != bad else "infinite"
    name = r"model\.layers\.1\.mlp\.down_proj\.weight"
    with pytest.raises(CheckpointError, match=rf"{name} .*{word}"):
        load_model(tmp_path / "hf")


def test_hf_directory_with_finite_weights_still_loads(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    model = load_model(tmp_path / "hf")
    ids = torch.randint(0, 64, (1, 5))
    torch.testing.assert_close(model(ids).logits, tiny_llama(ids).logits)


@pytest.mark.extra("hf")
@pytest.mark.parametrize("extra", [[], ["--temperature", "0"]], ids=["sampling", "greedy"])
def test_generate_with_nan_weights_is_one_line_exit_2(tmp_path, capsys, tiny_baseline, extra):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from diffattn.checkpoint import save_model

    vocab = {chr(97 + i): i for i in range(26)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    with torch.no_grad():
        tiny_baseline.layers[0].attn.q_proj.weight[0, 0] = float("nan")
    model_dir = save_model(tiny_baseline, tmp_path / "model", tokenizer=tokenizer)
    code = main(["generate", str(model_dir), "--prompt", "abc", "--max-new-tokens", "2", *extra])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert "layers.0.attn.q_proj.weight" in lines[0] and "NaN" in lines[0]
    assert captured.out == ""
