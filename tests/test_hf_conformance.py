"""What a user of Hugging Face models expects from DiffAttnForCausalLM, for all three types
(the behaviours HF's generic model and generation tests check, in our own words)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from diffattn.hf import DiffAttnConfig, DiffAttnForCausalLM
from diffattn.hf.compat import (
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    is_activation_checkpointing,
)
from helpers import ATTENTIONS, tiny_config


def _model(attention: str, **changes) -> DiffAttnForCausalLM:
    torch.manual_seed(0)
    config = DiffAttnConfig.from_model_config(tiny_config(attention, **changes))
    return DiffAttnForCausalLM(config).eval()


def _ids(n=9, batch=2, seed=1):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_inputs_embeds_equal_input_ids(attention):
    model = _model(attention)
    ids = _ids()
    expected = model(input_ids=ids).logits
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=ids, inputs_embeds=embeds)
    out = model.generate(inputs_embeds=embeds, max_new_tokens=3, do_sample=False)
    greedy = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(out, greedy[:, ids.shape[1] :])


@pytest.mark.parametrize("tie", [False, True])
def test_resize_token_embeddings_keeps_input_and_output_in_step(tie, tmp_path):
    model = _model("diff_v1", tie_embeddings=tie)
    model.resize_token_embeddings(140)
    assert model.get_input_embeddings().weight.shape[0] == 140
    assert model.model.output_weight.shape[0] == 140
    assert model.config.vocab_size == 140 and model.model.config.vocab_size == 140
    assert model(input_ids=_ids()).logits.shape[-1] == 140
    model.save_pretrained(tmp_path)
    again = DiffAttnForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(again.model.output_weight, model.model.output_weight)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_return_dict_false_gives_a_tuple(attention):
    model = _model(attention)
    ids = _ids()
    out = model(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple)
    loss, logits = out[0], out[1]
    full = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(loss, full.loss)
    torch.testing.assert_close(logits, full.logits)


def test_config_has_use_cache():
    assert _model("baseline").config.use_cache is True


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_static_cache_generation_with_left_padding(attention):
    model = _model(attention)
    ids = _ids(7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    dynamic = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    static = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        cache_implementation="static",
    )
    torch.testing.assert_close(static, dynamic)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_attention_maps_count_the_configured_heads_and_carry_gradients(attention):
    model = _model(attention).train()
    ids = _ids()
    out = model(input_ids=ids, labels=ids, output_attentions=True)
    heads = model.config.num_attention_heads
    assert all(a.shape == (2, heads, 9, 9) for a in out.attentions)
    head_dim = model.config.head_dim
    assert model.config.hidden_size == model.model.config.d_model
    assert head_dim == model.model.config.dim_per_head
    out.attentions[0].retain_grad()
    out.loss.backward()
    assert out.attentions[0].grad is not None and out.attentions[0].grad.abs().sum() > 0


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gradient_checkpointing_gives_the_same_gradients(attention):
    model = _model(attention).train()
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert model.supports_gradient_checkpointing
    enable_activation_checkpointing(model)
    assert is_activation_checkpointing(model)
    assert all(block.gradient_checkpointing for block in model.model.layers)
    model(input_ids=ids, labels=ids).loss.backward()
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7)
    disable_activation_checkpointing(model)
    assert not is_activation_checkpointing(model)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_4d_masks_and_packed_sequences(attention, implementation):
    model = _model(attention)
    model.set_attn_implementation(implementation)
    a, b = _ids(5, 1, seed=2), _ids(4, 1, seed=3)
    packed = torch.cat([a, b], dim=1)
    causal = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    block = causal.clone()
    block[5:, :5] = False  # the second sequence does not see the first
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    out = model(input_ids=packed, attention_mask=block[None, None], position_ids=positions)
    torch.testing.assert_close(out.logits[:, :5], model(input_ids=a).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits[:, 5:], model(input_ids=b).logits, rtol=1e-5, atol=1e-5)
    additive = torch.zeros(1, 1, 9, 9).masked_fill(~block, torch.finfo(torch.float32).min)
    torch.testing.assert_close(
        model(input_ids=packed, attention_mask=additive, position_ids=positions).logits,
        out.logits,
    )
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=packed, attention_mask=torch.ones(1, 1, 9, 8, dtype=torch.bool))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_logits_at_padding_positions_do_not_depend_on_the_backend(attention):
    model = _model(attention)
    ids = _ids(8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    model.set_attn_implementation("eager")
    eager = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    sdpa = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.extra("hf")
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_one_decode_step_compiles_with_fullgraph(attention):
    from transformers import DynamicCache

    model = _model(attention).model
    ids = _ids(6)
    cache = DynamicCache()
    from diffattn.hf.modeling import HFCacheAdapter

    adapter = HFCacheAdapter(cache)
    mask = torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        model(ids, attention_mask=mask[:, :6], past_key_values=adapter)
        step = torch.compile(model, fullgraph=True, backend="eager")
        out = step(ids[:, :1], attention_mask=mask, past_key_values=adapter)
    assert out.logits.shape == (2, 1, 128)


REGISTRATION_CHECK = """
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
config = AutoConfig.for_model("diffattn", vocab_size=64, d_model=32, n_layers=1, n_heads=4)
model = AutoModelForCausalLM.from_config(config)
causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
print(type(config).__name__, causal_lm.__name__, type(model).__name__)
"""


@pytest.mark.parametrize(
    "order",
    [
        "import sys, diffattn; assert 'transformers' not in sys.modules, 'imported transformers'",
        "import transformers; import diffattn",
        "import diffattn; from diffattn.hf import DiffAttnConfig; import transformers",
        "from diffattn.hf import DiffAttnForCausalLM; import transformers",
        "from diffattn.hf.configuration import DiffAttnConfig",
        "from diffattn.hf.modeling import DiffAttnForCausalLM",
    ],
)
def test_registration_does_not_depend_on_import_order(order):
    """In a fresh process, whatever is imported first: ``import diffattn`` does not import
    transformers, yet registers both Auto classes on transformers' import; the configuration
    module, which does not import the modeling one, still pairs them
    (:mod:`diffattn.hf.autoregister`); and no UserWarning is raised on the way."""
    code = f"{order}\n{REGISTRATION_CHECK}"
    result = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["DiffAttnConfig", "DiffAttnForCausalLM", "DiffAttnForCausalLM"]


@pytest.mark.extra("hf")
def test_pickle_weights_are_refused_on_the_hf_path(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model("baseline")
    model.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin.*safetensors") as error:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.extra("hf")
def test_from_pretrained_names_a_truncated_safetensors_file(tmp_path):
    from transformers import AutoModelForCausalLM

    _model("diff_v2").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors") as error:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)
