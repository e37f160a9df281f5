"""The capture probe: it observes without changing outputs, on diffattn, HF and Dex models,
and every capture's numbers equal those computed from full maps by hand."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn.probe import (
    AttentionEntropy,
    AttentionMaps,
    HeadGates,
    HeadOutputs,
    HiddenStates,
    HiddenStats,
    Lambda,
    LogitStats,
    LogitTransform,
    Probe,
    RunningStats,
    SpanMass,
    TokenLoss,
)
from helpers import ATTENTIONS, HF_KINDS, tiny_diffattn, tiny_hf

VOCAB = 128


def _inputs(n: int, padded: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, n), generator=g)
    mask = torch.ones(2, n, dtype=torch.long)
    if padded and n > 3:
        mask[0, :3] = 0  # left padding
    return ids, (mask if padded else None)


def _real(mask, n):
    return torch.ones(2, n, dtype=torch.bool) if mask is None else mask.bool()


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize(("n", "padded"), [(1, False), (7, True), (129, True)])
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_probe_does_not_change_outputs_or_gradients(attention, n, padded, backend):
    model = tiny_diffattn(attention, backend=backend, max_seq_len=256)
    ids, mask = _inputs(n, padded)
    labels = ids.clone()
    if mask is not None:  # nothing read from padding rows, whose values depend on the kernel
        labels[0, :4] = -100
    out = model(ids, attention_mask=mask, labels=labels)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    captures = [AttentionMaps(what=("applied",), layers=[1]), SpanMass([(0, 2)]), LogitStats()]
    with Probe(model, captures, block_rows=16):
        probed = model(ids, attention_mask=mask, labels=labels)
        probed_grads = torch.autograd.grad(probed.loss, list(model.parameters()))
    real = _real(mask, n)
    if backend == "reference" and n <= 16:  # one block: the reference kernel's very operations
        torch.testing.assert_close(probed.logits, out.logits, rtol=0, atol=0)
    torch.testing.assert_close(probed.logits[real], out.logits[real], rtol=1e-5, atol=1e-5)
    for got, want in zip(probed_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_maps_equal_output_attentions_and_rows_can_be_chosen(attention):
    model = tiny_diffattn(attention, backend="sdpa")
    ids, mask = _inputs(21, padded=True)
    full = model(ids, attention_mask=mask, output_attentions=True)
    maps = AttentionMaps(what=("applied", "probs", "logits", "lam"))
    rows = AttentionMaps(what=("applied",), layers=[0], heads=[1], query_positions=[0, 5, 20])
    with Probe(model, [maps, rows], block_rows=4):
        model(ids, attention_mask=mask)
    got = maps.result()
    for layer, reference in enumerate(full.attention_maps):
        call = got[layer][0]
        torch.testing.assert_close(call["applied"], reference.diff, rtol=0, atol=1e-6)
        if reference.a1 is not None:
            torch.testing.assert_close(call["probs.a1"], reference.a1, rtol=0, atol=1e-6)
            torch.testing.assert_close(call["probs.a2"], reference.a2, rtol=0, atol=1e-6)
            lam = call["lam"]
            torch.testing.assert_close(lam, reference.lam.expand_as(lam), rtol=0, atol=1e-6)
        logits = [v for k, v in call.items() if k.startswith("logits.")]
        assert logits and all(torch.isinf(t).any() for t in logits)  # the causal mask
    picked = rows.result()[0][0]["applied"]
    torch.testing.assert_close(picked, full.attentions[0][:, [1]][:, :, [0, 5, 20]])
    assert list(rows.result()) == [0]


def test_pre_softmax_logits_are_the_scaled_scores():
    model = tiny_diffattn("baseline", backend="reference")
    ids, _ = _inputs(9, padded=False)
    maps = AttentionMaps(what=("logits", "probs"), layers=[0])
    with Probe(model, [maps]):
        model(ids)
    call = maps.result()[0][0]
    torch.testing.assert_close(torch.softmax(call["logits.a"], -1), call["probs.a"])


def test_span_mass_is_the_sum_over_the_span():
    model = tiny_diffattn("diff_v1")
    ids, mask = _inputs(33, padded=True)
    full = model(ids, attention_mask=mask, output_attentions=True)
    spans = SpanMass(spans=[(3, 10), (20, 21)], maps=("applied", "a1"), query_positions=[32, 25])
    with Probe(model, [spans], block_rows=8):
        model(ids, attention_mask=mask)
    got = spans.result()
    for layer, ref in enumerate(full.attention_maps):
        want = torch.stack([ref.diff[..., 3:10].sum(-1), ref.diff[..., 20:21].sum(-1)], -1)
        torch.testing.assert_close(
            got[layer][0]["applied"], want[:, :, [25, 32]], atol=1e-6, rtol=0
        )
        want_a1 = ref.a1[..., 3:10].sum(-1)[:, :, [25, 32]]
        torch.testing.assert_close(got[layer][0]["a1"][..., 0], want_a1, atol=1e-6, rtol=0)


def test_logit_stats_match_the_full_logits():
    model = tiny_diffattn("diff_v2")
    ids, mask = _inputs(40, padded=True)
    maps = AttentionMaps(what=("logits",))
    stats = LogitStats(top_k=10)
    with Probe(model, [maps, stats], block_rows=7):
        model(ids, attention_mask=mask)
    real = mask.bool()
    pooled = []
    for calls in maps.result().values():
        for logits in calls[0].values():
            valid = torch.isfinite(logits) & real[:, None, :, None]
            pooled.append(logits[valid].abs())
    values = torch.sort(torch.cat(pooled), descending=True).values
    summary = stats.result()["all"]
    assert summary["count"] == values.numel()
    for rank in (1, 2, 3, 10):
        assert summary[f"top{rank}"] == pytest.approx(float(values[rank - 1]), rel=1e-6)
    assert summary["median"] == pytest.approx(float(values.median()), rel=0.02)
    assert summary["mean"] == pytest.approx(float(values.double().mean()), rel=1e-6)


def test_running_stats_quantiles_and_merging():
    stats = RunningStats(top_k=3)
    data = torch.linspace(-5, 5, 1001)
    for part in data.split(100):
        stats.update(part)
    assert stats.count == 1001
    assert [stats.top_values(k) for k in (1, 2, 3)] == pytest.approx([5.0, 5.0, 4.99])
    assert stats.quantile(0.5) == pytest.approx(2.5, rel=0.02)
    assert math.isnan(stats.top_values(4))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_identity_transform_changes_nothing_and_a_flat_one_makes_uniform_maps(attention):
    model = tiny_diffattn(attention, backend="reference")
    ids, _ = _inputs(6, padded=False)
    expected = model(ids).logits
    identity = LogitTransform(lambda logits, allowed, layer: logits)
    with Probe(model, [identity]):
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    assert identity.result()["blocks_transformed"] > 0
    flat = LogitTransform(lambda logits, allowed, layer: torch.zeros_like(logits), layers=[0])
    maps = AttentionMaps(what=("probs",), layers=[0])
    with Probe(model, [flat, maps]):
        model(ids)
    for key, probs in maps.result()[0][0].items():
        rows = torch.arange(1, 7, dtype=torch.float32)
        torch.testing.assert_close(probs[0, 0].sum(-1), torch.ones(6))
        torch.testing.assert_close(probs[0, 0].max(-1).values, 1 / rows, msg=key)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_hidden_states_head_outputs_loss_and_lambda(attention):
    model = tiny_diffattn(attention)
    ids, mask = _inputs(12, padded=True)
    full = model(ids, attention_mask=mask, output_hidden_states=True)
    hidden, outputs, loss, lam = HiddenStates(), HeadOutputs(), TokenLoss(), Lambda()
    stats = HiddenStats(top_k=5)
    with Probe(model, [hidden, outputs, loss, lam, stats]):
        model(ids, attention_mask=mask)
    states = hidden.result()
    torch.testing.assert_close(states[0][0], full.hidden_states[1])
    # the last layer's output before the final norm
    torch.testing.assert_close(model.norm(states[1][0]), full.hidden_states[2])
    real = mask.bool()
    top = torch.cat([s[0][real].abs().reshape(-1) for s in states.values()]).max()
    assert stats.result()["all"]["top1"] == pytest.approx(float(top))
    heads = outputs.result()[0][0]["output"]
    view = Probe(model, []).layers[0]
    assert heads.shape == (2, view.out_heads, 12, view.out_head_dim)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100  # predicted from a padding position, which TokenLoss leaves out
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, labels=labels).loss
    nll = loss.result()
    assert nll["mean"] == pytest.approx(float(expected), rel=1e-5)
    assert nll["count"] == int((labels[:, 1:] != -100).sum())
    result = lam.result()
    if attention == "diff_v1":
        assert result["lambda"] == pytest.approx(
            [float(b.attn.lambda_full()) for b in model.layers]
        )
    elif attention == "diff_v2":
        x = model.layers[0].attn_norm(model.embed_tokens(ids))
        want = torch.sigmoid(model.layers[0].attn.lambda_proj(x)).mean()
        assert result["lambda_mean"][0] == pytest.approx(float(want), rel=1e-5)
    else:
        assert result == {}


def test_entropy_is_that_of_the_maps():
    model = tiny_diffattn("baseline")
    ids, mask = _inputs(10, padded=True)
    maps = model(ids, attention_mask=mask, output_attentions=True).attentions
    entropy = AttentionEntropy()
    with Probe(model, [entropy], block_rows=3):
        model(ids, attention_mask=mask)
    real = mask.bool()
    for layer, probs in enumerate(maps):
        rows = -torch.special.xlogy(probs, probs).sum(-1)  # (B, H, N)
        want = rows.permute(1, 0, 2)[:, real].mean(-1)
        torch.testing.assert_close(entropy.result()[layer], want, rtol=1e-5, atol=1e-6)


def test_head_gates_give_gradients_without_changing_the_loss():
    model = tiny_diffattn("baseline")
    ids, _ = _inputs(8, padded=False)
    expected = model(ids, labels=ids).loss
    gates = HeadGates()
    with Probe(model, [gates]):
        loss = model(ids, labels=ids).loss
        grads = torch.autograd.grad(loss, gates.ordered())
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert [g.shape for g in grads] == [(2, 4), (2, 4)]
    assert all(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_models_through_eager_attention_hooks(kind):
    model = tiny_hf(kind)
    ids, mask = _inputs(13, padded=True)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    reference = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    model.set_attn_implementation(before)
    maps, loss = AttentionMaps(what=("probs",), layers=[1]), TokenLoss()
    with Probe(model, [maps, loss, HeadOutputs()], block_rows=4):
        out = model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == before
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], reference.logits[real], rtol=1e-5, atol=1e-5)
    got = maps.result()[1][0]["probs.a"]
    rows = real[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[rows], reference.attentions[1][rows], rtol=1e-5, atol=1e-6)
    assert list(maps.result()) == [1]
    assert loss.result()["count"] == int((real[:, 1:] & real[:, :-1]).sum())


def test_hf_diffllama_maps_are_differential():
    model = tiny_hf("diffllama", vocab_size=VOCAB)
    ids, _ = _inputs(11, padded=False)
    model.set_attn_implementation("eager")
    reference = model(input_ids=ids, output_attentions=True)
    model.set_attn_implementation("sdpa")
    maps, lam = AttentionMaps(what=("probs", "applied", "lam")), Lambda()
    with Probe(model, [maps, lam], block_rows=5):
        out = model(input_ids=ids)
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
    for layer in range(2):
        call = maps.result()[layer][0]
        full = reference.attentions[layer]  # all 4 query heads; pairs are (h, h + 2)
        torch.testing.assert_close(call["probs.a1"], full[:, :2], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(call["probs.a2"], full[:, 2:], rtol=1e-5, atol=1e-6)
        want = full[:, :2] - call["lam"] * full[:, 2:]
        torch.testing.assert_close(call["applied"], want, rtol=1e-5, atol=1e-6)
        assert float(call["lam"]) == pytest.approx(lam.result()["lambda"][layer])


def test_dex_head_outputs_before_and_after():
    from diffattn import dex

    model = tiny_hf("llama")
    dex.apply(model, heads={0: [1], 1: [0, 3]}, anneal_steps=0, lambda_learn_init=0.5)
    ids, _ = _inputs(9, padded=False)
    outputs = HeadOutputs(stages=("output", "dex_output"))
    with Probe(model, [outputs]):
        model(input_ids=ids)
    layer0 = outputs.result()[0][0]
    changed = (layer0["output"] - layer0["dex_output"]).abs().amax((0, 2, 3))
    assert changed[1] > 0 and changed[0] == 0 and changed[2] == 0


def test_bad_captures_get_clear_errors():
    model = tiny_diffattn("baseline")
    with pytest.raises(ValueError, match=r"layer\(s\) \[5\] do not exist"):
        Probe(model, [AttentionMaps(layers=[5])])
    with pytest.raises(ValueError, match="unknown item"):
        AttentionMaps(what=("nope",))
    with pytest.raises(ValueError, match="spans must be"):
        SpanMass(spans=[(4, 2)])
    with pytest.raises(ValueError, match="not supported by the probe"):
        Probe(torch.nn.Linear(2, 2), [])
