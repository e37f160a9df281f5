"""ModelConfig's validation errors, word for word, and which one wins when several apply.

Pins the exact messages and the order of the checks (the first failing one is raised), so that
the validation code can be reorganised without changing what a user reads.
"""

from __future__ import annotations

import pytest

from diffattn import ModelConfig

CASES = [
    ({"vocab_size": 0}, "ModelConfig.vocab_size: must be a positive integer, got 0"),
    ({"d_model": True}, "ModelConfig.d_model: must be a positive integer, got True"),
    ({"n_layers": 2.5}, "ModelConfig.n_layers: must be a positive integer, got 2.5"),
    ({"n_heads": -1}, "ModelConfig.n_heads: must be a positive integer, got -1"),
    ({"max_seq_len": "x"}, "ModelConfig.max_seq_len: must be a positive integer, got 'x'"),
    ({"ffn_multiple_of": 0}, "ModelConfig.ffn_multiple_of: must be a positive integer, got 0"),
    ({"n_kv_heads": 0}, "ModelConfig.n_kv_heads: must be a positive integer or None, got 0"),
    ({"head_dim": True}, "ModelConfig.head_dim: must be a positive integer or None, got True"),
    ({"ffn_hidden": 1.5}, "ModelConfig.ffn_hidden: must be a positive integer or None, got 1.5"),
    (
        {"attention": "diff_v3"},
        "ModelConfig.attention: unknown attention type 'diff_v3'; choose one "
        "of baseline, diff_v1, diff_v2, dint, gated_diff, gda",
    ),
    ({"backend": 3}, "ModelConfig.backend: must be a backend name, got 3"),
    (
        {"rope_style": "spiral"},
        "ModelConfig.rope_style: unknown rope style 'spiral'; choose one of half, interleaved",
    ),
    (
        {"d_model": 100, "n_heads": 8},
        "ModelConfig.d_model: d_model=100 is not divisible by n_heads=8; set "
        "head_dim explicitly or change n_heads",
    ),
    ({"head_dim": 7}, "ModelConfig.head_dim: head_dim=7 must be even for RoPE"),
    (
        {"d_model": 96, "n_heads": 6, "n_kv_heads": 4},
        "ModelConfig.n_kv_heads: n_kv_heads=4 must divide n_heads=6",
    ),
    ({"n_heads": 4, "n_kv_heads": 8}, "ModelConfig.n_kv_heads: n_kv_heads=8 must divide n_heads=4"),
    (
        {"attention": "diff_v1", "d_model": 96, "n_heads": 3, "head_dim": 32},
        "ModelConfig.n_heads: diff_v1 pairs query heads into differential "
        "heads, so n_heads must be even, got 3",
    ),
    (
        {"attention": "diff_v1", "d_model": 96, "n_heads": 6, "n_kv_heads": 3},
        "ModelConfig.n_kv_heads: diff_v1 pairs key heads (K1, K2) and needs an "
        "even n_kv_heads, got 3",
    ),
    (
        {"lambda_init": "linear"},
        "ModelConfig.lambda_init: must be 'exp' or a float in (0, 1), got 'linear'",
    ),
    (
        {"lambda_init": True},
        "ModelConfig.lambda_init: must be 'exp' or a float in (0, 1), got True",
    ),
    (
        {"lambda_init": [0.5]},
        "ModelConfig.lambda_init: must be 'exp' or a float in (0, 1), got [0.5]",
    ),
    ({"lambda_init": 1.5}, "ModelConfig.lambda_init: must lie in (0, 1), got 1.5"),
    ({"lambda_init": 0}, "ModelConfig.lambda_init: must lie in (0, 1), got 0"),
    ({"rope_theta": 0}, "ModelConfig.rope_theta: must be a positive number, got 0"),
    ({"norm_eps": -1.0}, "ModelConfig.norm_eps: must be a positive number, got -1.0"),
    ({"head_norm_eps": True}, "ModelConfig.head_norm_eps: must be a positive number, got True"),
    ({"init_std": "a"}, "ModelConfig.init_std: must be a positive number, got 'a'"),
    ({"lambda_std": 0.0}, "ModelConfig.lambda_std: must be a positive number, got 0.0"),
    ({"ffn_multiplier": -2}, "ModelConfig.ffn_multiplier: must be a positive number, got -2"),
    ({"tie_embeddings": 1}, "ModelConfig.tie_embeddings: must be a bool, got 1"),
    ({"head_norm": "yes"}, "ModelConfig.head_norm: must be a bool, got 'yes'"),
    ({"head_norm_learnable": None}, "ModelConfig.head_norm_learnable: must be a bool, got None"),
    ({"v2_paired_heads": 0}, "ModelConfig.v2_paired_heads: must be a bool, got 0"),
    ({"v2_use_lambda": "no"}, "ModelConfig.v2_use_lambda: must be a bool, got 'no'"),
    ({"v2_lambda_sigmoid": 1.0}, "ModelConfig.v2_lambda_sigmoid: must be a bool, got 1.0"),
    (
        {"vocab_size": 0, "attention": "x", "norm_eps": -1},
        "ModelConfig.vocab_size: must be a positive integer, got 0",
    ),
    (
        {"attention": "x", "rope_style": "y"},
        "ModelConfig.attention: unknown attention type 'x'; choose one of "
        "baseline, diff_v1, diff_v2, dint, gated_diff, gda",
    ),
    (
        {"d_model": 100, "n_heads": 8, "lambda_init": 2.0},
        "ModelConfig.d_model: d_model=100 is not divisible by n_heads=8; set "
        "head_dim explicitly or change n_heads",
    ),
    (
        {"lambda_init": 2.0, "norm_eps": -1, "head_norm": "x"},
        "ModelConfig.lambda_init: must lie in (0, 1), got 2.0",
    ),
    ({"norm_eps": -1, "head_norm": "x"}, "ModelConfig.norm_eps: must be a positive number, got -1"),
]


@pytest.mark.parametrize(("fields", "message"), CASES)
def test_validation_message_is_exact(fields, message):
    with pytest.raises(ValueError) as caught:
        ModelConfig(**fields)
    assert str(caught.value) == message


def test_unknown_backend_message_names_it():
    with pytest.raises(ValueError) as caught:
        ModelConfig(backend="cuda-magic")
    assert str(caught.value).startswith(
        "ModelConfig.backend: unknown attention backend 'cuda-magic'; choose one of "
    )


def test_valid_configs_still_build():
    for fields in (
        {},
        dict(attention="diff_v1"),
        dict(attention="diff_v2", n_kv_heads=4),
        dict(lambda_init=0.5, head_dim=32, d_model=256, n_heads=8),
    ):
        ModelConfig(**fields)
