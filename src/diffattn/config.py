"""Model configuration: one typed, validated dataclass for all three attention types.

Head convention (used everywhere in diffattn): ``n_heads`` and ``n_kv_heads`` count heads of
width ``head_dim`` (= d) exactly as the *matched baseline Transformer* counts them. The
attention type then decides how those heads are used:

* ``baseline``: ``n_heads`` query heads, ``n_kv_heads`` key/value heads (LLaMA GQA).
* ``diff_v1`` (DIFF V1 §2.1): the ``n_heads`` query heads are paired into
  ``n_heads / 2`` differential heads (Q1, Q2 of width d each), the ``n_kv_heads`` key heads into
  ``n_kv_heads / 2`` groups (K1, K2), and V has ``n_kv_heads / 2`` heads of width 2d. This is
  the paper's h = d_model / 2d and gives the baseline's parameter count and FLOPs.
* ``diff_v2`` (V2 blog): ``n_heads`` output heads, ``2 * n_heads`` query heads, ``n_kv_heads``
  key/value heads of width d, and W_λ: d_model -> n_heads.

So a baseline preset and its DIFF twins differ only in the attention fields.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

AttentionType = Literal["baseline", "diff_v1", "diff_v2"]
Backend = Literal["reference", "sdpa", "flash", "fused", "triton", "auto"]
RopeStyle = Literal["half", "interleaved"]

ATTENTION_TYPES: tuple[str, ...] = get_args(AttentionType)
RUNTIME_FIELDS = frozenset({"backend"})
"""Fields that choose how the model runs, not what it computes; never saved as architecture."""
BACKENDS: tuple[str, ...] = get_args(Backend)
"""The built-in backends; more can be registered (:mod:`diffattn.attention.registry`)."""
ROPE_STYLES: tuple[str, ...] = get_args(RopeStyle)


def lambda_init_schedule(layer_index: int) -> float:
    """λ_init of DIFF V1 Eq.2 for a 0-based layer index.

    The paper writes λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) with a 1-based layer l, so the
    first four layers get 0.2000, 0.3555, 0.4707 and 0.5561.
    """
    if layer_index < 0:
        raise ValueError(f"layer_index must be >= 0, got {layer_index}")
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


def reject_unknown_fields(owner: str, names: Any, fields_of: Any, noun: str = "key") -> None:
    """Raise ``ValueError`` when some of ``names`` are not fields of the dataclass
    ``fields_of``: ``"<owner>: unknown <noun>(s) …; valid <noun>s are …"``, both sorted."""
    known = {f.name for f in dataclasses.fields(fields_of)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(
            f"{owner}: unknown {noun}(s) {', '.join(map(repr, unknown))}; "
            f"valid {noun}s are {', '.join(sorted(known))}"
        )


def _round_up(value: float, multiple: int) -> int:
    return int(multiple * math.ceil(value / multiple))


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build a :class:`diffattn.DiffTransformerLM`.

    Validated on construction: an inconsistent setting raises ``ValueError`` naming the field,
    before any tensor is allocated.
    """

    # --- sizes -----------------------------------------------------------------------------
    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    """Query heads of width ``head_dim`` in the matched baseline (see module docstring)."""
    n_kv_heads: int | None = None
    """Key/value heads of width ``head_dim`` in the matched baseline; ``None`` means MHA."""
    head_dim: int | None = None
    """Per-head width d; ``None`` means ``d_model // n_heads``."""
    ffn_hidden: int | None = None
    """SwiGLU hidden size; ``None`` means ``ffn_multiplier * d_model`` rounded up."""
    ffn_multiplier: float = 8 / 3
    ffn_multiple_of: int = 64
    """The default SwiGLU width is rounded up to a multiple of this, and DIFF V2's
    parameter-matched width (``presets.match_v2_params``) is kept on it: GEMM dimensions off
    a multiple of 64 run on slow GPU kernels (docs/performance.md, "Aligned shapes")."""
    max_seq_len: int = 2048

    # --- attention -------------------------------------------------------------------------
    attention: AttentionType = "baseline"
    backend: str = field(default="auto", compare=False)
    """The attention backend the model starts with (``reference``, ``sdpa``, ``flash``, ``auto``
    or any registered one). A run-time choice, not architecture: it is not written to
    ``config.json``, does not take part in equality, and can be changed on a built model with
    ``DiffTransformerLM.set_backend`` or Hugging Face's ``attn_implementation``."""

    # --- positions, norms, embeddings ------------------------------------------------------
    rope_theta: float = 10000.0
    rope_style: RopeStyle = "half"
    """``half``: rotate-half (LLaMA, HF); ``interleaved``: adjacent channel pairs (GPT-J)."""
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    """Std of every Linear and the embedding; residual output projections use
    ``init_std / sqrt(2 * n_layers)``."""

    # --- DIFF V1 (Eq.2-3) ------------------------------------------------------------------
    lambda_init: str | float = "exp"
    """``"exp"``: λ_init = 0.8 − 0.6·exp(−0.3·(l−1)); a float in (0, 1): that constant."""
    lambda_std: float = 0.1
    """Std of the normal init of λ_q1, λ_k1, λ_q2, λ_k2."""
    head_norm: bool = True
    """Per-head RMSNorm over 2d followed by the fixed multiplier (1 − λ_init) (Eq.3)."""
    head_norm_learnable: bool = True
    """One learnable weight of width 2d shared by all heads (official code) or none (HF)."""
    head_norm_eps: float = 1e-5

    # --- DIFF V2 ablation switches (blog, "Design Ablations") ------------------------------
    v2_paired_heads: bool = True
    """``False``: subtract heads from different GQA groups (ablation 1)."""
    v2_use_lambda: bool = True
    """``False``: ``attn1 - attn2`` without λ (ablation 2)."""
    v2_lambda_sigmoid: bool = True
    """``False``: use the projected λ without sigmoid (ablation 3)."""

    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Free-form metadata carried along (e.g. the preset name); never read by the model."""

    # -------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self._validate()
        if self.head_dim is not None and self.head_dim * self.n_heads == self.d_model:
            # An explicit head width equal to the default is the default: one spelling per
            # model, so configs written with and without it compare equal.
            object.__setattr__(self, "head_dim", None)

    def _fail(self, field_name: str, message: str) -> None:
        raise ValueError(f"ModelConfig.{field_name}: {message}")

    def _validate(self) -> None:
        """Every check, in order; the first that fails raises ``ValueError`` naming its field."""
        self._validate_sizes()
        self._validate_choices()
        self._validate_heads()
        self._validate_lambda_init()
        self._validate_numbers_and_flags()

    def _validate_sizes(self) -> None:
        """The integer sizes: required ones positive, optional ones positive or ``None``."""
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "max_seq_len",
            "ffn_multiple_of",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self._fail(name, f"must be a positive integer, got {value!r}")
        for name in ("n_kv_heads", "head_dim", "ffn_hidden"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                self._fail(name, f"must be a positive integer or None, got {value!r}")

    def _validate_choices(self) -> None:
        """The named choices: attention type, backend (built-in or registered), RoPE style."""
        if self.attention not in ATTENTION_TYPES:
            self._fail(
                "attention",
                f"unknown attention type {self.attention!r}; "
                f"choose one of {', '.join(ATTENTION_TYPES)}",
            )
        if not isinstance(self.backend, str):
            self._fail("backend", f"must be a backend name, got {self.backend!r}")
        from diffattn.attention.registry import check_backend_name  # attention imports us

        try:
            check_backend_name(self.backend)
        except ValueError as error:
            self._fail("backend", str(error))
        if self.rope_style not in ROPE_STYLES:
            self._fail(
                "rope_style",
                f"unknown rope style {self.rope_style!r}; choose one of {', '.join(ROPE_STYLES)}",
            )

    def _validate_heads(self) -> None:
        """Head counts and widths (module docstring): d even for RoPE, GQA groups dividing the
        query heads, and DIFF V1's pairing (§2.1) of query heads and key heads into twos."""
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            self._fail(
                "d_model",
                f"d_model={self.d_model} is not divisible by "
                f"n_heads={self.n_heads}; set head_dim explicitly or change n_heads",
            )
        if self.dim_per_head % 2 != 0:
            self._fail("head_dim", f"head_dim={self.dim_per_head} must be even for RoPE")
        kv = self.num_kv_heads
        if kv > self.n_heads or self.n_heads % kv != 0:
            self._fail("n_kv_heads", f"n_kv_heads={kv} must divide n_heads={self.n_heads}")
        if self.attention == "diff_v1":
            if self.n_heads % 2 != 0:
                self._fail(
                    "n_heads",
                    f"diff_v1 pairs query heads into differential heads, so "
                    f"n_heads must be even, got {self.n_heads}",
                )
            if kv % 2 != 0:
                self._fail(
                    "n_kv_heads",
                    f"diff_v1 pairs key heads (K1, K2) and needs an even n_kv_heads, got {kv}",
                )

    def _validate_lambda_init(self) -> None:
        """λ_init (DIFF V1 Eq.2): ``"exp"`` for the depth schedule or a constant in (0, 1)."""
        if isinstance(self.lambda_init, str):
            if self.lambda_init != "exp":
                self._fail(
                    "lambda_init", f"must be 'exp' or a float in (0, 1), got {self.lambda_init!r}"
                )
        elif isinstance(self.lambda_init, bool) or not isinstance(self.lambda_init, int | float):
            self._fail(
                "lambda_init", f"must be 'exp' or a float in (0, 1), got {self.lambda_init!r}"
            )
        elif not 0.0 < float(self.lambda_init) < 1.0:
            self._fail("lambda_init", f"must lie in (0, 1), got {self.lambda_init}")

    def _validate_numbers_and_flags(self) -> None:
        """The positive real hyper-parameters, then the boolean switches (bools, not ints)."""
        for name in (
            "rope_theta",
            "norm_eps",
            "head_norm_eps",
            "init_std",
            "lambda_std",
            "ffn_multiplier",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                self._fail(name, f"must be a positive number, got {value!r}")
        for name in (
            "tie_embeddings",
            "head_norm",
            "head_norm_learnable",
            "v2_paired_heads",
            "v2_use_lambda",
            "v2_lambda_sigmoid",
        ):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, f"must be a bool, got {getattr(self, name)!r}")

    # --- derived sizes -------------------------------------------------------------------
    @property
    def dim_per_head(self) -> int:
        """d: width of one query/key head (and of V in baseline and V2)."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden size: explicit, or ``ffn_multiplier · d_model`` rounded up."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return _round_up(self.ffn_multiplier * self.d_model, self.ffn_multiple_of)

    @property
    def n_output_heads(self) -> int:
        """Heads whose outputs W_O reads: 2h·d = n_heads·d channels in every type."""
        return self.n_heads // 2 if self.attention == "diff_v1" else self.n_heads

    @property
    def n_query_heads(self) -> int:
        """Query heads of width d that are projected: 2·n_heads for V2, n_heads otherwise."""
        return 2 * self.n_heads if self.attention == "diff_v2" else self.n_heads

    def lambda_init_for_layer(self, layer_index: int) -> float:
        """λ_init for a 0-based layer index (Eq.2): the depth schedule or the constant."""
        if self.lambda_init == "exp":
            return lambda_init_schedule(layer_index)
        return float(self.lambda_init)

    # --- (de)serialisation -------------------------------------------------------------------
    def to_dict(self, include_runtime: bool = False) -> dict[str, Any]:
        """The fields as a plain dict: the architecture (what ``config.json`` stores), plus the
        run-time choices of :data:`RUNTIME_FIELDS` with ``include_runtime``."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if include_runtime or f.name not in RUNTIME_FIELDS
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a mapping; an unknown key raises ``ValueError`` naming it."""
        reject_unknown_fields("ModelConfig", data, cls)
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with ``changes`` applied (unknown keys raise ``ValueError``)."""
        return ModelConfig.from_dict({**self.to_dict(include_runtime=True), **changes})
