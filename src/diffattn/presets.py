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
as the V2 blog's "borrowed from other parts of the model" suggests. The narrowed width stays a
multiple of ``ffn_multiple_of`` (64 by default): a GEMM dimension off that grid sends cuBLAS to
slow kernels, so the matched total is within half a step (32 hidden units, all layers) of the
baseline's instead of exact (docs/architecture.md, "Parameter matching").
"""

from __future__ import annotations

import math
from typing import Any

from diffattn.config import ModelConfig

CL100K_VOCAB = 100_288
LLAMA3_VOCAB = 128_256


def _size(
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    max_seq_len: int,
    **more: int,
) -> dict[str, Any]:
    """One row of the preset table: the fields every size states, then any others."""
    return dict(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        **more,
    )


# fmt: off
_PRESETS: dict[str, dict[str, Any]] = {
    #              vocabulary  d_model layers heads head_dim length  other fields
    "tiny":  _size(8192,          128,  2,  8,  16,  512),
    "small": _size(8192,          256,  4,  8,  32, 1024),
    "0.4B":  _size(LLAMA3_VOCAB, 1024, 16, 16,  64, 4096, n_kv_heads=4, ffn_hidden=4096),
    "830M":  _size(CL100K_VOCAB, 1536, 24, 16,  96, 2048),
    "1.4B":  _size(CL100K_VOCAB, 2048, 24, 16, 128, 2048),
    "2.8B":  _size(CL100K_VOCAB, 2560, 32, 20, 128, 2048),
    "3B":    _size(CL100K_VOCAB, 3072, 28, 24, 128, 4096, ffn_hidden=8192),
    "6.8B":  _size(CL100K_VOCAB, 4096, 32, 32, 128, 2048),
    "13.1B": _size(CL100K_VOCAB, 5120, 40, 40, 128, 2048),
}
# fmt: on

#: Sizes whose names are parameter counts from DIFF V1 Table 10.
TABLE10_SIZES = ("830M", "1.4B", "2.8B", "6.8B", "13.1B")


def names() -> list[str]:
    """All preset names, smallest first."""
    return list(_PRESETS)


def extra_parameters(config: ModelConfig) -> int:
    """Parameters the model's attention types add over the matched baseline, all layers
    (each layer's ``AttentionType.extra_parameters``; DIFF V2: the second half of W_Q and
    W_λ)."""
    if not config.is_mixed:
        return config.n_layers * config.type_of_layer(0).extra_parameters(config)
    return sum(config.type_of_layer(i).extra_parameters(config) for i in range(config.n_layers))


def v2_extra_parameters(config: ModelConfig) -> int:
    """:func:`extra_parameters`, under the name DIFF V2's matching was first written with."""
    return extra_parameters(config)


def ffn_matched_layers(config: ModelConfig) -> int:
    """How many layers have a type matched to the baseline by narrowing the FFN."""
    return sum(config.type_of_layer(i).matches_by_ffn(config) for i in range(config.n_layers))


def get(
    name: str,
    attention: str = "baseline",
    match_params: bool = False,
    match_multiple_of: int | None = None,
    **overrides: Any,
) -> ModelConfig:
    """The preset ``name`` with ``attention`` and any ``ModelConfig`` field ``overrides``.

    ``match_params=True`` (DIFF V2 only) narrows the SwiGLU hidden size so the total matches
    the baseline's, keeping the width a multiple of ``match_multiple_of`` (default: the
    config's ``ffn_multiple_of``); see :func:`match_v2_params`.
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(_PRESETS)}")
    if match_multiple_of is not None and not match_params:
        raise ValueError("match_multiple_of applies only with match_params=True")
    fields = {**_PRESETS[name], "attention": attention, **overrides}
    fields.setdefault("extra", {})
    fields["extra"] = {**fields["extra"], "preset": name}
    config = ModelConfig.from_dict(fields)
    return match_v2_params(config, match_multiple_of) if match_params else config


def match_v2_params(config: ModelConfig, multiple_of: int | None = None) -> ModelConfig:
    """``config`` (DIFF V2) with the SwiGLU narrowed so its parameter total matches the
    baseline with the same fields, the width kept a multiple of ``multiple_of``.

    V2 adds ``E = L·(d_model·h·d + d_model·h)`` parameters (the second half of W_Q and W_λ,
    V2 blog); one SwiGLU hidden unit costs ``3·d_model`` per layer (gate, up, down). The exact
    width ``ffn_dim − E / (3·d_model·L)`` is rarely on the grid, so of the two multiples of
    ``multiple_of`` around it the one with the smaller parameter difference wins (the wider
    on a tie). The remainder is left as a difference of at most ``multiple_of / 2`` hidden
    units in every layer: ``1.5·multiple_of·d_model·L`` parameters.

    ``multiple_of`` defaults to the config's ``ffn_multiple_of`` (64); ``1`` matches to the
    nearest unit, for CPU models too small for a 64-wide step.
    """
    if not ffn_matched_layers(config):
        names = ", ".join(declaration.name for declaration in config.attention_types)
        raise ValueError(
            f"match_params only applies to attention types that add parameters (such as "
            f"diff_v2); {names} are matched by construction"
        )
    step = config.ffn_multiple_of if multiple_of is None else multiple_of
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ValueError(f"match_multiple_of must be a positive integer, got {step!r}")
    per_unit = 3 * config.d_model * config.n_layers  # one SwiGLU hidden unit, all layers
    exact = config.ffn_dim - extra_parameters(config) / per_unit
    below = step * math.floor(exact / step)
    width = below if exact - below < below + step - exact else below + step
    if width <= 0:
        raise ValueError(
            f"match_params: the FFN has no width left to give back (ffn_dim={config.ffn_dim}, "
            f"{exact:.1f} hidden units would match)"
        )
    return config.replace(ffn_hidden=width)
