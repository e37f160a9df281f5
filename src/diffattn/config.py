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

So a baseline preset and its DIFF twins differ only in the attention fields. Each type is
one declaration (:mod:`diffattn.attention.types`): what differs between types is asked of
it, never decided here by the type's name. ``layer_types`` mixes types layer by layer (hybrid
stacks); a type's own options live in ``attention_options`` under its name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

AttentionType = str
"""A registered attention type's name (:func:`diffattn.attention.types.attention_type_names`)."""
Backend = Literal["reference", "sdpa", "flash", "fused", "triton", "auto"]
RopeStyle = Literal["half", "interleaved"]

ATTENTION_TYPES: tuple[str, ...] = ("baseline", "diff_v1", "diff_v2")
"""The papers' three types; more are registered (:mod:`diffattn.attention.types`)."""
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
    """The attention type of every layer that ``layer_types`` does not name otherwise."""
    layer_types: tuple[str, ...] | None = None
    """One attention type per layer (a hybrid stack), or ``None``: every layer ``attention``.
    Given as a list of ``n_layers`` names, or as a repeating pattern, ``"diff_v1*3,baseline"``
    (the pattern's length must divide ``n_layers``); kept as the full tuple."""
    attention_options: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)
    """Each type's own options, ``{type: {option: value}}`` (its declared ``options``);
    unset options take the declared defaults."""
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
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", self._expand_layer_types(self.layer_types))
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
        self._validate_type_options()
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
        from diffattn.attention.types import attention_type  # attention imports us

        for field_name, name in [("attention", self.attention)] + [
            ("layer_types", name) for name in self.layer_types or ()
        ]:
            try:
                attention_type(name)
            except ValueError as error:
                self._fail(field_name, str(error))
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
        query heads, then each type's own conditions (``AttentionType.check``)."""
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
        for declaration in self.attention_types:
            for field_name, message in declaration.check(self):
                self._fail(field_name, message)

    def _validate_type_options(self) -> None:
        """``attention_options``: a mapping from a type of this stack to its declared options."""
        if not isinstance(self.attention_options, dict):
            self._fail("attention_options", f"must be a mapping, got {self.attention_options!r}")
        used = {declaration.name: declaration for declaration in self.attention_types}
        for name, stored in self.attention_options.items():
            if name not in used:
                self._fail(
                    "attention_options",
                    f"options for {name!r}, which no layer of this model uses "
                    f"(its types: {', '.join(used)})",
                )
            if not isinstance(stored, dict):
                self._fail(f"attention_options.{name}", f"must be a mapping, got {stored!r}")
            for option, why in used[name].option_problems(stored):
                self._fail(f"attention_options.{name}.{option}", why)

    def _expand_layer_types(self, given: Any) -> tuple[str, ...]:
        """``layer_types`` as one name per layer: a sequence of ``n_layers`` names, or a
        pattern string (``"diff_v1*3,baseline"``) repeated to fill ``n_layers``."""
        if isinstance(given, str):
            pattern: list[str] = []
            for part in given.split(","):
                name, _, count = part.strip().partition("*")
                if not name.strip() or (count and not count.strip().isdigit()):
                    self._fail("layer_types", f"cannot read the pattern {given!r} ({part!r})")
                pattern += [name.strip()] * (int(count) if count else 1)
            if not pattern or not isinstance(self.n_layers, int) or self.n_layers % len(pattern):
                self._fail(
                    "layer_types",
                    f"the pattern {given!r} has {len(pattern)} layers, which do not divide "
                    f"n_layers={self.n_layers}",
                )
            return tuple(pattern * (self.n_layers // len(pattern)))
        if not isinstance(given, list | tuple) or not all(isinstance(n, str) for n in given):
            self._fail("layer_types", f"must be a list of type names or a pattern, got {given!r}")
        if len(given) != self.n_layers:
            self._fail(
                "layer_types", f"names {len(given)} layers, but n_layers={self.n_layers}"
            )
        return tuple(given)

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

    # --- the attention types ---------------------------------------------------------------
    def type_of_layer(self, layer_index: int):
        """The declaration (:class:`diffattn.attention.types.AttentionType`) of layer
        ``layer_index``'s attention."""
        from diffattn.attention.types import attention_type

        names = self.layer_types
        return attention_type(self.attention if names is None else names[layer_index])

    @property
    def attention_types(self) -> tuple:
        """The declarations this stack uses, each once, in order of first use."""
        from diffattn.attention.types import attention_type

        names = dict.fromkeys(self.layer_types or (self.attention,))
        return tuple(attention_type(name) for name in names)

    @property
    def is_mixed(self) -> bool:
        """Whether layers differ in their attention type."""
        return len(set(self.layer_types or ())) > 1

    def single_type(self, what: str):
        """The one declaration of a stack whose layers share a type; ``ValueError`` naming
        ``what`` (a feature) for a mixed stack."""
        if self.is_mixed:
            raise ValueError(
                f"{what} does not support a stack of mixed attention types "
                f"(layer_types={','.join(self.layer_types)})"
            )
        return self.type_of_layer(0)

    def options_of(self, type_name: str) -> dict[str, Any]:
        """The options of type ``type_name``: the stored ones over its declared defaults."""
        from diffattn.attention.types import attention_type

        return attention_type(type_name).option_values(self.attention_options.get(type_name))

    @property
    def n_output_heads(self) -> int:
        """Heads the attention outputs (W_O reads n_heads·d channels in every type)."""
        return self.single_type("n_output_heads").output_heads(self)

    @property
    def n_query_heads(self) -> int:
        """Query heads of width d that ``q_proj`` projects."""
        return self.single_type("n_query_heads").query_heads(self)

    def lambda_init_for_layer(self, layer_index: int) -> float:
        """λ_init for a 0-based layer index (Eq.2): the depth schedule or the constant."""
        if self.lambda_init == "exp":
            return lambda_init_schedule(layer_index)
        return float(self.lambda_init)

    # --- (de)serialisation -------------------------------------------------------------------
    def to_dict(self, include_runtime: bool = False) -> dict[str, Any]:
        """The fields as a plain dict: the architecture (what ``config.json`` stores), plus the
        run-time choices of :data:`RUNTIME_FIELDS` with ``include_runtime``. ``layer_types``
        and ``attention_options`` appear only when set, so a single-type model's dict is
        what it always was."""
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if include_runtime or f.name not in RUNTIME_FIELDS
        }
        if data["layer_types"] is None:
            del data["layer_types"]
        else:
            data["layer_types"] = list(data["layer_types"])
        if not data["attention_options"]:
            del data["attention_options"]
        else:
            data["attention_options"] = {k: dict(v) for k, v in data["attention_options"].items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a mapping; an unknown key raises ``ValueError`` naming it."""
        reject_unknown_fields("ModelConfig", data, cls)
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with ``changes`` applied (unknown keys raise ``ValueError``)."""
        return ModelConfig.from_dict({**self.to_dict(include_runtime=True), **changes})
