"""``diffattn generate`` on every model directory diffattn loads: a Hugging Face Llama (here a
diffattn baseline converted with ``diffattn convert --to hf-llama``) streams the greedy tokens
of the diffattn model it came from; diffattn-only decoding options are refused by name."""

from __future__ import annotations

import pytest

from extras import require_extra

pytestmark = require_extra("hf")

from diffattn import cli
from diffattn.checkpoint import save_model
from helpers import tiny_diffattn
from serve_helpers import VOCAB, word_tokenizer

PROMPT = "w1 w2 w3 w4 w5"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    model = tiny_diffattn("baseline", vocab_size=VOCAB, init_std=0.1, tie_embeddings=False)
    save_model(model, root / "diffattn", tokenizer=word_tokenizer())
    assert (
        cli.main(["convert", str(root / "diffattn"), str(root / "llama"), "--to", "hf-llama"]) == 0
    )
    return root / "diffattn", root / "llama"


def generated(capsys, model, *flags) -> str:
    capsys.readouterr()
    argv = ["generate", str(model), "--prompt", PROMPT, "--temperature", "0", *flags]
    assert cli.main([*argv, "--max-new-tokens", "12", "--no-echo"]) == 0
    return capsys.readouterr().out


def test_an_hf_llama_generates_the_tokens_of_the_model_it_came_from(models, capsys):
    ours, llama = models
    expected = generated(capsys, ours)
    assert expected.strip()
    assert generated(capsys, llama) == expected


def test_echo_prints_the_prompt_once(models, capsys):
    _, llama = models
    capsys.readouterr()
    argv = ["generate", str(llama), "--prompt", PROMPT, "--temperature", "0"]
    assert cli.main([*argv, "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and out.count(PROMPT) == 1


@pytest.mark.parametrize(
    "flags", [["--backend", "sdpa"], ["--compile"], ["--cache", "static"]], ids=str
)
def test_diffattn_decoding_options_are_refused_for_hf_models(models, capsys, flags):
    _, llama = models
    argv = ["generate", str(llama), "--prompt", PROMPT, *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "diffattn decoding options" in err and "hf model" in err


def test_the_models_generation_config_is_not_merged_in(models, capsys, tmp_path):
    """A repetition penalty in the model's generation_config.json does not reach the call."""
    import json
    import shutil

    ours, llama = models
    penalised = tmp_path / "penalised"
    shutil.copytree(llama, penalised)
    settings = penalised / "generation_config.json"
    config = json.loads(settings.read_text()) if settings.is_file() else {}
    settings.write_text(json.dumps({**config, "repetition_penalty": 5.0}))
    assert generated(capsys, penalised) == generated(capsys, ours)
