"""Hugging Face integration: Auto classes, save/load, generate with HF caches, pipeline, maps."""

from __future__ import annotations

import json

import pytest
import torch

from extras import require_extra

pytestmark = require_extra("hf")

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedTokenizerFast,
    StaticCache,
    pipeline,
)

import diffattn  # noqa: F401  (registers the Auto classes)
from diffattn import DiffTransformerLM, ModelConfig
from diffattn.checkpoint import load_model, save_model
from diffattn.hf import DiffAttnConfig, DiffAttnForCausalLM
from diffattn.hf.compat import CACHE_FIELD

ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
VOCAB = 320


def tiny_config(attention: str, **overrides) -> ModelConfig:
    fields = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    fields.update(overrides)
    return ModelConfig(attention=attention, **fields)


def tiny_model(attention: str, seed: int = 0, **overrides) -> DiffTransformerLM:
    torch.manual_seed(seed)
    return DiffTransformerLM(tiny_config(attention, **overrides)).eval()


def greedy_without_cache(model: DiffTransformerLM, ids: torch.Tensor, steps: int, mask=None):
    """Argmax loop over full forwards: the definition every cached path must reproduce."""
    for _ in range(steps):
        logits = model(ids, attention_mask=mask).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (
        "Differential attention subtracts two softmax maps to cancel attention noise. "
        "The quick brown fox jumps over the lazy dog. "
    ) * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer)
    assert tok.get_vocab_size() <= VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


# ------------------------------------------------------------------------------------------
def test_config_maps_hf_names_and_validates():
    cfg = DiffAttnConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, attention="diff_v1")
    assert cfg.hidden_size == 64
    assert cfg.num_hidden_layers == 3
    # output_attentions returns one map per head W_O reads: 2 differential heads of width 2d
    assert cfg.num_attention_heads == 2
    assert cfg.num_key_value_heads == 2
    assert cfg.to_model_config() == tiny_config("diff_v1", n_layers=3, vocab_size=8192).replace(
        max_seq_len=2048
    )
    with pytest.raises(ValueError, match="n_heads"):
        DiffAttnConfig(d_model=64, n_heads=3)
    with pytest.raises(ValueError, match="unknown key"):
        DiffAttnConfig(d_model=64, n_heads=4, attention="diff_v1").to_model_config().from_dict(
            {"bogus": 1}
        )


def test_a_mixed_stack_config_keeps_diffattn_layer_types_and_shows_hf_its_own(tmp_path):
    """diffattn's per-layer types are what config.json stores under ``layer_types``; Hugging
    Face's ``layer_types`` (read by its caches and validated against its own names) says full
    attention per layer; ``num_attention_heads`` is ``n_heads`` when the types count output
    heads differently, and a stack of one type keeps its count."""
    config = tiny_config("baseline", layer_types="diff_v1,baseline")
    hf_config = DiffAttnConfig.from_model_config(config)
    assert hf_config.layer_types == ["full_attention", "full_attention"]
    assert hf_config.to_model_config() == config
    assert hf_config.num_attention_heads == 4
    hf_config.num_attention_heads = 8
    assert hf_config.n_heads == 8
    same = DiffAttnConfig.from_model_config(tiny_config("baseline", layer_types="diff_v1*2"))
    assert same.num_attention_heads == 2
    assert DiffAttnConfig.from_model_config(tiny_config("diff_v1")).layer_types is None
    hf_config.num_attention_heads = 4
    hf_config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["layer_types"] == [
        "diff_v1",
        "baseline",
    ]
    assert AutoConfig.from_pretrained(tmp_path).to_model_config() == config


def test_a_mixed_stack_decodes_with_hf_caches_and_saves(tmp_path):
    """Each layer keeps its own cache layout in HF's caches (DIFF V1's values of width 2d
    split in two, DIFF V2's and the baseline's as they are): decoding token by token gives the
    full forward's logits."""
    model = tiny_model("baseline", seed=5, layer_types="diff_v2,diff_v1")
    hf = DiffAttnForCausalLM.from_diffattn(model).eval()
    ids = torch.randint(0, VOCAB, (2, 11))
    full = model(ids).logits
    for cache in (DynamicCache(), StaticCache(config=hf.config, max_cache_len=16)):
        steps = [hf(ids[:, :6], use_cache=True, **{CACHE_FIELD: cache}).logits]
        for t in range(6, 11):
            steps.append(hf(ids[:, t : t + 1], use_cache=True, **{CACHE_FIELD: cache}).logits)
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    hf.save_pretrained(tmp_path)
    torch.testing.assert_close(load_model(tmp_path)(ids).logits, full)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_and_from_pretrained_restore_identical_logits(tmp_path, attention, tied):
    model = tiny_model(attention, tie_embeddings=tied)
    ids = torch.randint(0, VOCAB, (2, 7))
    # bit-for-bit on the same kernel: HF loads with its default implementation ("sdpa"), our
    # loader with "auto" (the fused kernel for DIFF V1 on the CPU, equal to ~1e-7)
    backend = model.backend
    ours = model(ids).logits
    model.set_backend("sdpa")
    ref = model(ids).logits
    model.set_backend(backend)

    save_model(model, tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert isinstance(hf, DiffAttnForCausalLM)
    torch.testing.assert_close(hf(ids).logits, ref, rtol=0, atol=0)

    hf.save_pretrained(tmp_path / "hf")
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in files and "config.json" in files
    assert not any(name.endswith(".bin") for name in files)
    data = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert data["model_type"] == "diffattn"
    assert data["attention"] == attention and data["d_model"] == 64  # every field written
    assert data["tie_word_embeddings"] is tied
    torch.testing.assert_close(load_model(tmp_path / "hf")(ids).logits, ours, rtol=0, atol=0)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(again(ids).logits, ref, rtol=0, atol=0)


def test_from_pretrained_initialises_missing_tensors_and_keeps_every_loaded_one(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("diff_v1", seed=6)
    save_model(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    stored = load_file(weights)
    # one of the four λ vectors of a module whose other tensors are present, and a whole Linear
    missing = {"model.layers.0.attn.lambda_q1", "model.layers.1.ffn.up_proj.weight"}
    save_file({k: v for k, v in stored.items() if k not in missing}, weights, {"format": "pt"})
    torch.manual_seed(123)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == missing
    state = hf.state_dict()
    for key, value in stored.items():
        if key in missing:
            assert torch.isfinite(state[key]).all() and not torch.equal(state[key], value)
        else:
            torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    up = state["model.layers.1.ffn.up_proj.weight"]
    init_std = model.config.init_std
    assert 0.8 * init_std < float(up.std()) < 1.2 * init_std


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_hf_generate_with_hf_caches_equals_greedy_reference(attention):
    model = tiny_model(attention, seed=1)
    hf = DiffAttnForCausalLM.from_diffattn(model).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    expected = greedy_without_cache(model, ids, steps=9)
    dynamic = hf.generate(ids, max_new_tokens=9, do_sample=False, pad_token_id=0)
    static = hf.generate(
        ids, max_new_tokens=9, do_sample=False, cache_implementation="static", pad_token_id=0
    )
    torch.testing.assert_close(dynamic, expected, rtol=0, atol=0)
    torch.testing.assert_close(static, expected, rtol=0, atol=0)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_hf_generate_left_padded_batch_matches_unpadded_rows(attention):
    model = tiny_model(attention, seed=2)
    hf = DiffAttnForCausalLM.from_diffattn(model).eval()
    long = torch.randint(1, VOCAB, (1, 7))
    short = torch.randint(1, VOCAB, (1, 4))
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(out[0:1, 7:], greedy_without_cache(model, long, 6)[:, 7:])
    torch.testing.assert_close(out[1:2, 7:], greedy_without_cache(model, short, 6)[:, 4:])


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_hf_cache_objects_decode_like_full_forward(attention):
    model = tiny_model(attention, seed=3)
    hf = DiffAttnForCausalLM.from_diffattn(model).eval()
    ids = torch.randint(0, VOCAB, (2, 11))
    full = model(ids).logits
    for cache in (DynamicCache(), StaticCache(config=hf.config, max_cache_len=16)):
        first = hf(ids[:, :6], use_cache=True, **{CACHE_FIELD: cache})
        steps = [first.logits]
        for t in range(6, 11):
            step = hf(ids[:, t : t + 1], use_cache=True, **{CACHE_FIELD: cache})
            steps.append(step.logits)
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_cache_under_its_pre_5_24_name_decodes_the_same_and_both_names_are_refused():
    import warnings

    hf = DiffAttnForCausalLM.from_diffattn(tiny_model("diff_v1", seed=3)).eval()
    ids = torch.randint(0, VOCAB, (2, 5))
    current, old = DynamicCache(), DynamicCache()
    hf(ids[:, :4], use_cache=True, **{CACHE_FIELD: current})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf(ids[:, :4], use_cache=True, past_key_values=old)
        step = hf(ids[:, 4:], use_cache=True, past_key_values=old)
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(future) == (2 if CACHE_FIELD == "cache" else 0)
    assert all("`cache`" in str(w.message) for w in future)
    expected = hf(ids[:, 4:], use_cache=True, **{CACHE_FIELD: current})
    torch.testing.assert_close(step.logits, expected.logits, rtol=0, atol=0)
    assert getattr(step, CACHE_FIELD) is old and old.get_seq_length() == 5
    with pytest.raises(ValueError, match="not both"):
        hf(ids, cache=DynamicCache(), past_key_values=DynamicCache())


@pytest.mark.parametrize("attention", ["diff_v1", "diff_v2"])
def test_output_attentions_are_the_differential_maps(attention):
    model = tiny_model(attention, seed=4)
    hf = DiffAttnForCausalLM.from_diffattn(model).eval()
    ids = torch.randint(0, VOCAB, (1, 7))
    out = hf(ids, output_attentions=True, use_cache=False)
    ours = model(ids, output_attentions=True)
    assert len(out.attentions) == 2
    for got, maps in zip(out.attentions, ours.attention_maps, strict=True):
        # λ: a 0-d tensor for V1, (B, H, N, 1) for V2 (one value per token and head)
        expected = maps.a1 - maps.lam * maps.a2
        torch.testing.assert_close(got, expected)
        softmax_rows = maps.a1.sum(-1)
        torch.testing.assert_close(softmax_rows, torch.ones_like(softmax_rows))
        assert not torch.allclose(got.sum(-1), torch.ones_like(softmax_rows))


def test_tokenizer_saved_beside_model_and_pipeline_generates(tmp_path, hf_tokenizer):
    model = tiny_model("diff_v1", seed=5)
    save_model(model, tmp_path / "m", tokenizer=hf_tokenizer)
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.encode("the lazy dog") == hf_tokenizer.encode("the lazy dog")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    generator = pipeline("text-generation", model=hf, tokenizer=tok, device="cpu")
    text = generator("The quick brown", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("The quick brown")
    ids = tok("The quick brown", return_tensors="pt").input_ids
    expected = greedy_without_cache(model, ids, 5)
    assert text == tok.decode(expected[0])


def test_hf_loss_matches_model_loss():
    model = tiny_model("diff_v2", seed=6)
    hf = DiffAttnForCausalLM.from_diffattn(model)
    ids = torch.randint(0, VOCAB, (2, 9))
    torch.testing.assert_close(hf(ids, labels=ids).loss, model(ids, labels=ids).loss)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_hf_generate_equals_diffattn_generation(attention):
    from diffattn.generation import generate

    model = tiny_model(attention, seed=7)
    hf = DiffAttnForCausalLM.from_diffattn(model).eval()
    ids = torch.randint(1, VOCAB, (2, 5))
    ours = generate(model, ids, max_new_tokens=8, do_sample=False).sequences
    theirs = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
