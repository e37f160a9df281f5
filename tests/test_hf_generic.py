"""HF generate against the model's own decoding, padding on every backend, and the HF-facing
behaviours that HF's generic model tests check (config names, checkpointing layers, errors),
on whatever transformers release is installed."""

from __future__ import annotations

import pytest
import torch

from diffattn.attention.registry import backend_names, get_backend
from diffattn.generation import generate
from diffattn.hf import DiffAttnConfig, DiffAttnForCausalLM
from diffattn.hf.compat import enable_activation_checkpointing
from helpers import ATTENTIONS, TINY_VOCAB, tiny_config


def _hf(attention: str, seed: int = 3, **changes) -> DiffAttnForCausalLM:
    torch.manual_seed(seed)
    config = DiffAttnConfig.from_model_config(tiny_config(attention, **changes))
    return DiffAttnForCausalLM(config).eval()


def _left_padded(batch: int = 3, n: int = 7, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY_VOCAB, (batch, n), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : 2 * row] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_hf_generate_equals_own_greedy_decoding_with_left_padding(attention, cache_implementation):
    model = _hf(attention)
    ids, mask = _left_padded()
    ours = generate(model.model, ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    theirs = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=9,
        do_sample=False,
        pad_token_id=0,
        cache_implementation=cache_implementation,
    )
    assert torch.equal(theirs[:, ids.shape[1] :], ours.sequences[:, ids.shape[1] :])
    # and each padded row generates what it generates alone, unpadded
    for row in range(ids.shape[0]):
        alone = ids[row : row + 1, mask[row].bool()]
        single = model.generate(
            input_ids=alone,
            max_new_tokens=9,
            do_sample=False,
            pad_token_id=0,
            cache_implementation=cache_implementation,
        )
        assert torch.equal(single[0, alone.shape[1] :], theirs[row, ids.shape[1] :])


def _cpu_backends() -> list[str]:
    q = torch.zeros(1, 4, 3, 16)
    names = []
    for name in backend_names():
        if name == "auto":
            continue
        if get_backend(name).why_unusable(q) is None:
            names.append(name)
    return names


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_padding_positions_are_backend_independent_right_padding_and_holes(attention):
    """Every position, padding included, gives the same logits on every backend: padding queries
    read only themselves (right padding, left padding and holes in the middle)."""
    model = _hf(attention, seed=11)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, TINY_VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding
    mask[1, :2] = 0  # left padding
    mask[2, 3:5] = 0  # a hole
    outputs = {}
    with torch.no_grad():
        for implementation in ("eager", "sdpa"):
            model.set_attn_implementation(implementation)
            outputs[implementation] = model(input_ids=ids, attention_mask=mask).logits
        for name in _cpu_backends():
            model.model.set_backend(name)
            outputs[name] = model.model(ids, attention_mask=mask).logits
    reference = outputs["reference"]
    assert {"eager", "sdpa", "reference"} <= set(outputs)
    for name, logits in outputs.items():
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5, msg=name)


def test_hf_config_names_map_or_are_refused():
    config = DiffAttnConfig(
        attention="diff_v1",
        num_attention_heads=2,
        hidden_size=32,
        num_hidden_layers=3,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        rope_theta=500.0,
        head_dim=8,
        vocab_size=99,
        rms_norm_eps=1e-6,
        initializer_range=0.01,
    )
    model = config.to_model_config()
    assert (model.n_heads, config.num_attention_heads) == (4, 2)
    assert (model.d_model, model.n_layers, model.n_kv_heads) == (32, 3, 2)
    assert (model.ffn_dim, model.max_seq_len, model.rope_theta) == (48, 64, 500.0)
    assert (model.dim_per_head, model.vocab_size, model.norm_eps, model.init_std) == (
        8,
        99,
        1e-6,
        0.01,
    )
    assert DiffAttnConfig(num_attention_heads=2, d_model=32).n_heads == 2
    with pytest.raises(ValueError, match="'bogus'"):
        DiffAttnConfig(bogus=1)
    with pytest.raises(ValueError, match="hidden_act"):
        DiffAttnConfig(hidden_act="gelu")
    with pytest.raises(ValueError, match="contradicts"):
        DiffAttnConfig(hidden_size=64, d_model=32)
    with pytest.raises(ValueError, match="num_attention_heads"):
        DiffAttnConfig(attention="diff_v1", num_attention_heads=2, n_heads=8)
    config.num_key_value_heads = 1
    config.intermediate_size = 40
    assert (config.n_kv_heads, config.ffn_hidden) == (1, 40)


def test_num_attention_heads_of_gda_counts_its_signal_heads_both_ways():
    """GDA's output heads are its signal heads, ``H_s = r·H_n``: ``num_attention_heads`` reads
    them from the declaration and, given instead of ``n_heads``, sets the ``n_heads`` that
    makes them under ``ratio`` and ``head_budget``; the maps ``output_attentions`` returns have
    that many heads."""
    from diffattn.hf import DiffAttnForCausalLM

    def gda(**fields):
        return DiffAttnConfig(attention="gda", d_model=64, n_layers=1, vocab_size=32, **fields)

    queries = gda(num_attention_heads=6, n_kv_heads=2, attention_options={"gda": {"ratio": 3}})
    assert (queries.n_heads, queries.num_attention_heads) == (8, 6)  # 6 signal + 2 noise
    outputs = {"gda": {"ratio": 2, "head_budget": "outputs"}}
    budget = gda(num_attention_heads=4, n_kv_heads=4, attention_options=outputs)
    assert (budget.n_heads, budget.num_attention_heads) == (8, 4)  # H_s = n_heads / 2
    one_to_one = gda(n_heads=8, n_kv_heads=2, attention_options={"gda": {"ratio": 1}})
    assert one_to_one.num_attention_heads == 4  # DIFF V1's count
    budget.num_attention_heads = 8
    assert budget.n_heads == 16
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    maps = DiffAttnForCausalLM(queries)(input_ids=ids, output_attentions=True).attentions
    assert maps[0].shape[1] == queries.num_attention_heads
    with pytest.raises(ValueError, match="n_noise_heads"):
        gda(num_attention_heads=6, n_kv_heads=2, attention_options={"gda": {"n_noise_heads": 2}})
    with pytest.raises(ValueError, match="ratio=3"):
        gda(num_attention_heads=4, n_kv_heads=2, attention_options={"gda": {"ratio": 3}})


def test_attributes_set_on_a_config_survive_save_and_load(tmp_path):
    config = DiffAttnConfig(d_model=32, n_heads=4)
    config.layer_norm_eps = 1.0  # a free attribute, as HF's tools set on any config
    config.save_pretrained(tmp_path)
    again = DiffAttnConfig.from_pretrained(tmp_path)
    assert again.layer_norm_eps == 1.0 and again.to_model_config() == config.to_model_config()


@pytest.mark.extra("hf")
def test_blocks_are_hf_gradient_checkpointing_layers_and_checkpoint_once():
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = _hf("diff_v1")
    assert all(isinstance(b, GradientCheckpointingLayer) for b in model.model.layers)
    ids = torch.randint(0, TINY_VOCAB, (2, 7))
    model.train()
    model.model.init_weights()
    expected = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, model.parameters())
    enable_activation_checkpointing(model, {"use_reentrant": False})
    calls = []
    func = model.model.layers[0]._gradient_checkpointing_func
    model.model.layers[0]._gradient_checkpointing_func = lambda *a, **k: (
        calls.append(1),
        func(*a, **k),
    )[1]
    model.model._gradient_checkpointing_func = lambda *a, **k: pytest.fail("checkpointed twice")
    got = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, model.parameters())
    assert calls == [1]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.extra("hf")
def test_unknown_attn_implementation_gives_hfs_own_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=37,
        vocab_size=99,
    )
    with pytest.raises(ValueError) as theirs:
        LlamaForCausalLM(llama).set_attn_implementation("foo")
    model = _hf("baseline")
    with pytest.raises(ValueError) as ours:
        model.set_attn_implementation("foo")
    assert str(ours.value).split(". The only")[0] == str(theirs.value).split(". The only")[0]
    assert model.config._attn_implementation != "foo"


def _counting_backend(graphs: list):
    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return backend


@pytest.mark.extra("hf")
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_static_cache_generate_compiles_fullgraph_and_equals_eager(attention):
    """HF's ``generate`` compiles the decode step (``fullgraph=True``) with a static cache and left
    padding: no graph break, one graph for every step, the same tokens as eager decoding."""
    from transformers import CompileConfig

    assert DiffAttnForCausalLM._can_compile_fullgraph
    model = _hf(attention)
    ids, mask = _left_padded()
    common = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=7,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    eager = model.generate(**common, disable_compile=True)
    graphs: list = []
    config = CompileConfig(
        fullgraph=True, dynamic=False, backend=_counting_backend(graphs), mode=None
    )
    config._compile_all_devices = True  # HF compiles on accelerators only unless told
    torch._dynamo.reset()
    try:
        compiled = model.generate(**common, compile_config=config)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs: the decode step was re-traced"
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_generate_modes_agree_with_and_without_cache(attention):
    """The invariants of HF's generation tests: greedy, seeded sampling and beam search give the
    same sequences with the KV cache as without it, and assisted decoding equals greedy."""
    model = _hf(attention, seed=7)
    ids, mask = _left_padded(batch=2, n=6, seed=9)
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    greedy = model.generate(**common, do_sample=False)
    assert torch.equal(model.generate(**common, do_sample=False, use_cache=False), greedy)
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        sampled.append(model.generate(**common, do_sample=True, top_k=8, use_cache=use_cache))
    assert torch.equal(sampled[0], sampled[1])
    beams = [
        model.generate(
            **common, num_beams=3, num_return_sequences=2, do_sample=False, use_cache=use_cache
        )
        for use_cache in (True, False)
    ]
    assert beams[0].shape == (4, ids.shape[1] + 6) and torch.equal(beams[0], beams[1])
    assistant = _hf(attention, seed=8)  # a different model drafts; the target decides
    row = dict(common, input_ids=ids[1:], attention_mask=mask[1:])  # HF: one row, left-padded
    assisted = model.generate(**row, do_sample=False, assistant_model=assistant)
    assert torch.equal(assisted, greedy[1:])


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_generate_continues_from_a_returned_cache(attention):
    from diffattn.hf.compat import CACHE_FIELD

    model = _hf(attention, seed=5)
    ids = torch.randint(3, TINY_VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    greedy = {"do_sample": False, "pad_token_id": 0}
    whole = model.generate(input_ids=ids, max_new_tokens=7, **greedy)
    first = model.generate(input_ids=ids, max_new_tokens=4, return_dict_in_generate=True, **greedy)
    cache = getattr(first, CACHE_FIELD)
    assert cache is not None and cache.get_seq_length() == ids.shape[1] + 3
    rest = model.generate(
        input_ids=first.sequences, max_new_tokens=3, **greedy, **{CACHE_FIELD: cache}
    )
    assert torch.equal(rest, whole)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_logits_to_keep_and_explicit_position_ids(attention):
    model = _hf(attention, seed=2)
    ids = torch.randint(3, TINY_VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    full = model(ids, use_cache=False).logits
    assert torch.equal(model(ids, use_cache=False, logits_to_keep=1).logits, full[:, -1:])
    keep = torch.tensor([0, 4, 8])
    assert torch.equal(model(ids, use_cache=False, logits_to_keep=keep).logits, full[:, keep])
    default = torch.arange(9).expand(2, 9)
    assert torch.equal(model(ids, use_cache=False, position_ids=default).logits, full)
    shifted = model(ids, use_cache=False, position_ids=default + 5).logits
    # RoPE: a shift of every position changes nothing but rounding in attention scores
    assert torch.allclose(shifted, full, atol=1e-4) and not torch.equal(shifted, full)
