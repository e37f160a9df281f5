"""DiffTransformerLM behaviour: outputs, maps, hidden states, bad input, and learning."""

from __future__ import annotations

import pytest
import torch

from diffattn import DiffTransformerLM, ModelConfig

TYPES = ["baseline", "diff_v1", "diff_v2"]


def _config(attention: str, **overrides) -> ModelConfig:
    fields = dict(
        vocab_size=64,
        d_model=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        head_dim=8,
        max_seq_len=64,
        attention=attention,
        backend="sdpa",
    )
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize("attention", TYPES)
def test_outputs_have_documented_shapes(attention):
    model = DiffTransformerLM(_config(attention))
    ids = torch.randint(0, 64, (3, 11))
    out = model(ids, labels=ids, output_attentions=True, output_hidden_states=True)
    heads = 4 if attention == "diff_v1" else 8
    assert out.logits.shape == (3, 11, 64)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert len(out.attentions) == 2
    assert all(a.shape == (3, heads, 11, 11) for a in out.attentions)
    assert len(out.hidden_states) == 3
    assert all(h.shape == (3, 11, 64) for h in out.hidden_states)
    # Asking for maps must not change the outputs (maps come from the reference kernel).
    torch.testing.assert_close(model(ids).logits, out.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", TYPES)
def test_differential_maps_are_a1_minus_lambda_a2(attention):
    model = DiffTransformerLM(_config(attention))
    ids = torch.randint(0, 64, (2, 9))
    out = model(ids, output_attentions=True)
    for maps in out.attention_maps:
        assert torch.all(maps.diff.triu(1) == 0)  # causal
        if attention == "baseline":
            assert maps.a1 is None and maps.lam is None
            torch.testing.assert_close(maps.diff.sum(-1), torch.ones(2, 8, 9))
            continue
        torch.testing.assert_close(maps.diff, maps.a1 - maps.lam * maps.a2)
        # Rows of A1 − λA2 sum to 1 − λ: the differential map is not a distribution.
        expected = ((1 - maps.lam) * torch.ones_like(maps.diff[..., :1]))[..., 0]
        torch.testing.assert_close(maps.diff.sum(-1), expected, rtol=1e-5, atol=1e-5)
    if attention == "diff_v2":
        lam = out.attention_maps[0].lam
        assert lam.shape == (2, 8, 9, 1) and torch.all((lam > 0) & (lam < 1))


def test_v1_lambda_at_init_is_near_lambda_init_and_fp32():
    model = DiffTransformerLM(_config("diff_v1", n_layers=3)).to(torch.bfloat16)
    for index, block in enumerate(model.layers):
        lam = block.attn.lambda_full().detach()
        assert lam.dtype == torch.float32
        assert abs(float(lam) - model.config.lambda_init_for_layer(index)) < 0.1


def test_v2_ablation_switches_change_parameters():
    assert "layers.0.attn.lambda_proj.weight" in dict(
        DiffTransformerLM(_config("diff_v2")).named_parameters()
    )
    no_lambda = DiffTransformerLM(_config("diff_v2", v2_use_lambda=False))
    assert all("lambda" not in name for name, _ in no_lambda.named_parameters())
    no_norm = DiffTransformerLM(_config("diff_v1", head_norm=False))
    assert all("head_norm" not in name for name, _ in no_norm.named_parameters())
    fixed_norm = DiffTransformerLM(_config("diff_v1", head_norm_learnable=False))
    assert all("head_norm" not in name for name, _ in fixed_norm.named_parameters())


def test_tied_embeddings_share_one_matrix():
    model = DiffTransformerLM(_config("baseline", tie_embeddings=True))
    untied = DiffTransformerLM(_config("baseline"))
    assert model.lm_head is None and model.output_weight is model.embed_tokens.weight
    assert untied.num_parameters() - model.num_parameters() == 64 * 64


def test_init_scales_residual_projections():
    model = DiffTransformerLM(
        _config("baseline", d_model=256, n_heads=8, head_dim=32, n_layers=8, vocab_size=512)
    )
    std_q = model.layers[0].attn.q_proj.weight.std().item()
    std_o = model.layers[0].attn.o_proj.weight.std().item()
    assert std_q == pytest.approx(0.02, rel=0.05)
    assert std_o == pytest.approx(0.02 / 4, rel=0.05)


def test_labels_ignore_index_and_loss_value():
    model = DiffTransformerLM(_config("baseline"))
    ids = torch.randint(0, 64, (2, 6))
    labels = ids.clone()
    labels[:, :3] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, 2:-1].reshape(-1, 64)
    expected = torch.nn.functional.cross_entropy(logits, ids[:, 3:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(input_ids=torch.zeros(4, dtype=torch.long)), "input_ids must have shape"),
        (dict(input_ids=torch.zeros(1, 65, dtype=torch.long)), "exceeds max_seq_len"),
        (
            dict(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 5)),
            "attention_mask shape",
        ),
        (
            dict(
                input_ids=torch.zeros(1, 4, dtype=torch.long),
                labels=torch.zeros(1, 3, dtype=torch.long),
            ),
            "labels shape",
        ),
    ],
)
def test_bad_input_raises_one_clear_error(kwargs, message):
    model = DiffTransformerLM(_config("baseline"))
    with pytest.raises(ValueError, match=message):
        model(**kwargs)


@pytest.mark.parametrize("attention", TYPES)
def test_each_type_overfits_a_tiny_batch(attention):
    """Loss falls by at least 90% within 200 AdamW steps on CPU."""
    torch.manual_seed(0)
    cfg = _config(
        attention, vocab_size=32, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=16
    )
    model = DiffTransformerLM(cfg)
    ids = torch.randint(0, 32, (2, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(200):
        loss = model(ids, labels=ids).loss
        first = loss.item() if first is None else first
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    final = model(ids, labels=ids).loss.item()
    assert final <= 0.1 * first, (first, final)


@pytest.mark.parametrize(("batch", "length"), [(1, 2), (2, 7), (3, 129)])
def test_next_token_loss_equals_the_sliced_form_with_gradients(batch, length):
    """Shifting the labels instead of slicing the logits: same loss and gradient in fp32."""
    import torch.nn.functional as F

    from diffattn.model import next_token_loss

    torch.manual_seed(length)
    logits = torch.randn(batch, length, 11, requires_grad=True)
    labels = torch.randint(0, 11, (batch, length))
    labels[-1, length // 2 + 1 :] = -100  # ignored labels, e.g. right padding
    got = next_token_loss(logits, labels)
    want = F.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    grad, ref = (torch.autograd.grad(x, logits)[0] for x in (got, want))
    torch.testing.assert_close(grad, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("misspelt", ["past_key_value", "attention_masks", "cache", "label"])
def test_forward_refuses_an_argument_it_does_not_take(misspelt):
    model = DiffTransformerLM(ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match=misspelt):
        model(ids, **{misspelt: None})
