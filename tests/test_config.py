"""ModelConfig validation and the λ_init schedule (DIFF V1 Eq.2)."""

from __future__ import annotations

import math

import pytest

from diffattn import ModelConfig, lambda_init_schedule


def test_lambda_init_first_four_layers_match_the_paper():
    expected = [0.2000, 0.3555, 0.4707, 0.5561]
    got = [lambda_init_schedule(layer) for layer in range(4)]
    assert got == pytest.approx(expected, abs=1e-4)


def test_lambda_init_tends_to_point_eight_and_constant_option():
    assert lambda_init_schedule(100) == pytest.approx(0.8, abs=1e-9)
    cfg = ModelConfig(attention="diff_v1", lambda_init=0.5)
    assert [cfg.lambda_init_for_layer(i) for i in range(3)] == [0.5, 0.5, 0.5]
    cfg = ModelConfig(attention="diff_v1")
    assert cfg.lambda_init_for_layer(3) == pytest.approx(0.8 - 0.6 * math.exp(-0.9))


def test_model_lambda_init_per_layer():
    from diffattn import DiffTransformerLM

    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=4, n_heads=4, attention="diff_v1")
    model = DiffTransformerLM(cfg)
    got = [block.attn.lambda_init for block in model.layers]
    assert got == pytest.approx([0.2000, 0.3555, 0.4707, 0.5561], abs=1e-4)


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        (dict(d_model=100, n_heads=8), "d_model"),
        (dict(d_model=96, n_heads=6, n_kv_heads=4), "n_kv_heads"),
        (dict(n_heads=4, n_kv_heads=8), "n_kv_heads"),
        (dict(attention="diff_v1", d_model=96, n_heads=3, head_dim=32), "n_heads"),
        (dict(attention="diff_v1", d_model=96, n_heads=6, n_kv_heads=3), "n_kv_heads"),
        (dict(backend="cuda-magic"), "backend"),
        (dict(attention="diff_v3"), "attention"),
        (dict(rope_style="spiral"), "rope_style"),
        (dict(lambda_init=1.5), "lambda_init"),
        (dict(lambda_init="linear"), "lambda_init"),
        (dict(d_model=0), "d_model"),
        (dict(n_layers=2.5), "n_layers"),
        (dict(head_dim=7), "head_dim"),
        (dict(head_norm="yes"), "head_norm"),
        (dict(norm_eps=-1.0), "norm_eps"),
    ],
)
def test_invalid_config_names_the_field(fields, field_name):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field_name}\b"):
        ModelConfig(**fields)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="'n_head'"):
        ModelConfig.from_dict({"n_head": 4})
    with pytest.raises(ValueError, match="'heads'"):
        ModelConfig().replace(heads=3)


def test_v1_odd_heads_allowed_for_baseline_and_v2():
    ModelConfig(d_model=96, n_heads=3, attention="baseline")
    ModelConfig(d_model=96, n_heads=3, attention="diff_v2")


def test_derived_head_counts():
    cfg = ModelConfig(d_model=256, n_heads=8, n_kv_heads=2)
    assert (cfg.dim_per_head, cfg.n_query_heads, cfg.n_output_heads) == (32, 8, 8)
    v1 = cfg.replace(attention="diff_v1")
    assert (v1.n_query_heads, v1.n_output_heads) == (8, 4)
    v2 = cfg.replace(attention="diff_v2")
    assert (v2.n_query_heads, v2.n_output_heads) == (16, 8)


def test_round_trip_dict():
    cfg = ModelConfig(attention="diff_v2", v2_lambda_sigmoid=False, lambda_init=0.8)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_ffn_rounding_and_explicit():
    assert ModelConfig(d_model=512, ffn_multiple_of=1).ffn_dim == 1366
    assert ModelConfig(d_model=512).ffn_dim == 1408
    assert ModelConfig(d_model=512, ffn_hidden=1000).ffn_dim == 1000
