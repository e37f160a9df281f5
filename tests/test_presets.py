"""Presets: paper sizes, baseline/V1 parity, V2's extra parameters and match_params."""

from __future__ import annotations

import pytest
import torch

from diffattn import DiffTransformerLM, count_parameters, presets

NAMED = {"830M": 830e6, "1.4B": 1.4e9, "2.8B": 2.8e9, "6.8B": 6.8e9, "13.1B": 13.1e9}


def test_names_cover_the_papers():
    assert set(presets.names()) >= {"tiny", "small", "0.4B", "3B", *NAMED}


@pytest.mark.parametrize("name", presets.names())
def test_baseline_and_v1_parameters_agree_within_0_1_percent(name):
    base = count_parameters(presets.get(name, attention="baseline"))
    v1 = count_parameters(presets.get(name, attention="diff_v1"))
    assert abs(v1 - base) / base < 1e-3


@pytest.mark.parametrize("name", sorted(NAMED))
def test_table10_sizes_land_near_their_names(name):
    # One embedding matrix counted: the untied LM head, not the input embedding.
    count = count_parameters(presets.get(name), exclude_embeddings=True)
    assert abs(count - NAMED[name]) / NAMED[name] < 0.03


def test_table10_head_layout():
    cfg = presets.get("1.4B", attention="diff_v1")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads // 2, cfg.dim_per_head) == (2048, 24, 8, 128)
    assert presets.get("1.4B").n_heads == 16  # the baseline doubles the heads (§3.8)
    cfg3b = presets.get("3B", attention="diff_v1")
    assert (cfg3b.n_heads // 2, cfg3b.ffn_dim, cfg3b.vocab_size) == (12, 8192, 100_288)


@pytest.mark.parametrize("name", presets.names())
def test_v2_extra_parameters_are_reported_exactly(name):
    base = count_parameters(presets.get(name))
    v2_cfg = presets.get(name, attention="diff_v2")
    assert count_parameters(v2_cfg) - base == presets.v2_extra_parameters(v2_cfg)
    matched_cfg = presets.get(name, attention="diff_v2", match_params=True)
    assert matched_cfg.ffn_dim % 64 == 0
    # Narrowing the FFN in steps of 64 units leaves at most half a step (32 units, each
    # 3·d_model·L parameters) of mismatch.
    matched = count_parameters(matched_cfg)
    assert abs(matched - base) <= 32 * 3 * v2_cfg.d_model * v2_cfg.n_layers


def test_match_multiple_of_one_matches_to_the_unit():
    # 5504 − (16·128 + 16)/3 = 4816 exactly: a whole unit, so the match is exact.
    base = count_parameters(presets.get("1.4B"))
    exact = presets.get("1.4B", "diff_v2", match_params=True, match_multiple_of=1)
    assert exact.ffn_dim == 4816 and count_parameters(exact) == base
    # 0.4B: 4096 − (16·64 + 16)/3 = 3749.33 -> 3749, a third of a unit (3·1024·16) below.
    near = presets.get("0.4B", "diff_v2", match_params=True, match_multiple_of=1)
    assert near.ffn_dim == 3749
    assert count_parameters(near) - count_parameters(presets.get("0.4B")) == -16_384


def test_match_multiple_of_needs_match_params_and_a_positive_step():
    with pytest.raises(ValueError, match="match_multiple_of applies only with match_params"):
        presets.get("tiny", "diff_v2", match_multiple_of=1)
    with pytest.raises(ValueError, match="match_multiple_of must be a positive integer"):
        presets.get("tiny", "diff_v2", match_params=True, match_multiple_of=0)


def test_match_params_refuses_an_ffn_with_nothing_left():
    with pytest.raises(ValueError, match="no width left"):
        presets.get("tiny", "diff_v2", match_params=True, ffn_hidden=64)


def test_match_params_rejects_other_types():
    with pytest.raises(ValueError, match="match_params"):
        presets.get("tiny", attention="diff_v1", match_params=True)


def test_unknown_preset_and_bad_override():
    with pytest.raises(ValueError, match="unknown preset"):
        presets.get("7B")
    with pytest.raises(ValueError, match="'n_head'"):
        presets.get("tiny", n_head=4)


def test_13b_builds_on_meta_device_without_memory():
    with torch.device("meta"):
        model = DiffTransformerLM(presets.get("13.1B", attention="diff_v1"))
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() > 13e9


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_meta_build_then_materialise_matches_eager_structure(attention):
    cfg = presets.get("tiny", attention=attention)
    with torch.device("meta"):
        model = DiffTransformerLM(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    eager = DiffTransformerLM(cfg)
    assert model.rotary.inv_freq.tolist() == eager.rotary.inv_freq.tolist()
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    assert torch.isfinite(model(ids).logits).all()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
