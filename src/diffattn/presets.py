"""Named model sizes from the papers plus CPU sizes, for every attention type.

A preset is stated as the matched baseline (``n_heads`` heads of width ``head_dim``); DIFF V1
uses half as many differential heads of the same width (paper §2.1), which gives the same
parameter count and FLOPs, so ``get(name, attention=...)`` only changes the attention field.

Sources:

* ``830M`` … ``13.1B``: DIFF V1 Table 10 (§3.2), FFN 8/3·d_model, vocabulary 100,288
  (cl100k_base padded, Table 9), training length 2048.
* ``3B``: DIFF V1 Table 9 (§3.1): 28 layers, hidden 3072, FFN 8192, 12 DIFF heads of d = 128
  (24 baseline heads), length 4096.
* ``0.4B``: Dex Table 9 (App. F.2): 16 layers, 16 heads, 4 KV heads, hidden 1024, FFN 4096,
  Llama-3 vocabulary (128,256).
* ``tiny``, ``small``: CPU sizes for tests, examples and ``diffattn compare``.

DIFF V2 adds the second half of W_Q (d_model·h·d per layer) and W_λ (d_model·h per layer);
``get(..., match_params=True)`` narrows the SwiGLU hidden size to give those parameters back,
as the V2 blog's "borrowed from other parts of the model" suggests.
"""

from __future__ import annotations

from typing import Any

from diffattn.config import ModelConfig

CL100K_VOCAB = 100_288
LLAMA3_VOCAB = 128_256

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=8192, d_model=128, n_layers=2, n_heads=8, head_dim=16, max_seq_len=512),
    "small": dict(
        vocab_size=8192, d_model=256, n_layers=4, n_heads=8, head_dim=32, max_seq_len=1024
    ),
    "0.4B": dict(
        vocab_size=LLAMA3_VOCAB,
        d_model=1024,
        n_layers=16,
        n_heads=16,
        n_kv_heads=4,
        head_dim=64,
        ffn_hidden=4096,
        max_seq_len=4096,
    ),
    "830M": dict(
        vocab_size=CL100K_VOCAB,
        d_model=1536,
        n_layers=24,
        n_heads=16,
        head_dim=96,
        max_seq_len=2048,
    ),
    "1.4B": dict(
        vocab_size=CL100K_VOCAB,
        d_model=2048,
        n_layers=24,
        n_heads=16,
        head_dim=128,
        max_seq_len=2048,
    ),
    "2.8B": dict(
        vocab_size=CL100K_VOCAB,
        d_model=2560,
        n_layers=32,
        n_heads=20,
        head_dim=128,
        max_seq_len=2048,
    ),
    "3B": dict(
        vocab_size=CL100K_VOCAB,
        d_model=3072,
        n_layers=28,
        n_heads=24,
        head_dim=128,
        ffn_hidden=8192,
        max_seq_len=4096,
    ),
    "6.8B": dict(
        vocab_size=CL100K_VOCAB,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        head_dim=128,
        max_seq_len=2048,
    ),
    "13.1B": dict(
        vocab_size=CL100K_VOCAB,
        d_model=5120,
        n_layers=40,
        n_heads=40,
        head_dim=128,
        max_seq_len=2048,
    ),
}

#: Sizes whose names are parameter counts from DIFF V1 Table 10.
TABLE10_SIZES = ("830M", "1.4B", "2.8B", "6.8B", "13.1B")


def names() -> list[str]:
    """All preset names, smallest first."""
    return list(_PRESETS)


def v2_extra_parameters(config: ModelConfig) -> int:
    """Parameters DIFF V2 adds over the matched baseline: the second half of W_Q and W_λ."""
    per_layer = config.d_model * config.n_heads * config.dim_per_head
    if config.v2_use_lambda:
        per_layer += config.d_model * config.n_heads
    return config.n_layers * per_layer


def get(
    name: str,
    attention: str = "baseline",
    match_params: bool = False,
    **overrides: Any,
) -> ModelConfig:
    """The preset ``name`` with ``attention`` and any ``ModelConfig`` field ``overrides``.

    ``match_params=True`` (DIFF V2 only) narrows the SwiGLU hidden size by
    ``round(extra / (3·d_model·n_layers))`` so the total matches the baseline's.
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(_PRESETS)}")
    fields = {**_PRESETS[name], "attention": attention, **overrides}
    fields.setdefault("extra", {})
    fields["extra"] = {**fields["extra"], "preset": name}
    config = ModelConfig.from_dict(fields)
    return match_v2_params(config) if match_params else config


def match_v2_params(config: ModelConfig) -> ModelConfig:
    """``config`` (DIFF V2) with the SwiGLU narrowed by ``round(extra / (3·d_model·n_layers))``
    hidden units, so its parameter total matches the baseline with the same fields."""
    if config.attention != "diff_v2":
        raise ValueError(
            "match_params only applies to attention='diff_v2'; baseline and "
            "diff_v1 are matched by construction"
        )
    per_unit = 3 * config.d_model * config.n_layers  # one SwiGLU hidden unit, all layers
    narrow = round(v2_extra_parameters(config) / per_unit)
    if narrow >= config.ffn_dim:
        raise ValueError("match_params: the FFN has no width left to give back")
    return config.replace(ffn_hidden=config.ffn_dim - narrow)
