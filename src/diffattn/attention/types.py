"""The attention-type registry: an attention type is one declaration, registered by name.

A declaration is an instance of a subclass of :class:`AttentionType`. It owns everything that
differs between types: the module that computes the attention (its projections and its
``attend``), the type's own options (:class:`TypeOption`: default, bounds, help), the head
counts and widths it derives from ``d_model``, ``n_heads`` and ``n_kv_heads``, its KV-cache
layout, its FLOPs, how it is matched to the baseline's parameter count, its tensor-parallel
plan and its initialisation. Code outside a type's own module asks the declaration
(``config.type_of_layer(i)``, :func:`attention_type`) and never compares a type's name.

Built-in types declare themselves in their modules (:mod:`diffattn.attention.baseline`,
``diff_v1``, ``diff_v2``, ...); a type from another package registers with
:func:`register_attention_type` or through the ``diffattn.attention_types`` entry point
group (the entry point names a declaration instance, or a callable that returns one), which
is read the first time a type is looked up.

Options: a type's own options live in ``ModelConfig.attention_options[type_name]`` and are
saved in ``config.json`` under the type's name. The three types of the papers read the flat
``ModelConfig`` fields they always had (``lambda_init``, ``head_norm``, ``v2_*``), named in
:attr:`AttentionType.config_fields`, so every existing checkpoint loads unchanged.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar

from diffattn.attention.registry import ENTRY_SOFTMAX

logger = logging.getLogger("diffattn.attention_types")

ENTRY_POINT_GROUP = "diffattn.attention_types"
BUILT_IN_MODULES = (
    "diffattn.attention.baseline",
    "diffattn.attention.diff_v1",
    "diffattn.attention.diff_v2",
    "diffattn.attention.dint",
    "diffattn.attention.gated_diff",
    "diffattn.attention.gda",
)
"""The modules that declare the built-in types, imported on the first lookup."""


@dataclass(frozen=True)
class TypeOption:
    """One option of an attention type, declared once: its name, default, help, and the
    check a value must pass (``check(value)`` returns why it is refused, or ``None``).

    ``kind`` is the Python type values are converted to from text (``compare`` arms such as
    ``gda:ratio=3``): ``int``, ``float``, ``bool`` or ``str``."""

    name: str
    default: Any
    help: str
    kind: type = float
    check: Callable[[Any], str | None] | None = None

    def parse(self, text: str) -> Any:
        """The value ``text`` spells, as ``kind``; ``ValueError`` naming the option if not."""
        if self.kind is bool:
            lowered = text.strip().lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
            raise ValueError(f"option {self.name!r}: expected true or false, got {text!r}")
        try:
            return self.kind(text)
        except ValueError:
            raise ValueError(
                f"option {self.name!r}: expected a {self.kind.__name__}, got {text!r}"
            ) from None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is refused, or ``None``."""
        kinds = (int,) if self.kind is int else (int, float) if self.kind is float else (self.kind,)
        if (isinstance(value, bool) and self.kind is not bool) or not isinstance(value, kinds):
            return f"must be a {self.kind.__name__}, got {value!r}"
        return None if self.check is None else self.check(value)


def positive_int(value: Any) -> str | None:
    """A :attr:`TypeOption.check`: a positive integer."""
    return None if value > 0 else f"must be a positive integer, got {value!r}"


def open_unit_interval(value: Any) -> str | None:
    """A :attr:`TypeOption.check`: a number in (0, 1)."""
    return None if 0.0 < value < 1.0 else f"must lie in (0, 1), got {value!r}"


@dataclass(frozen=True)
class CacheLayout:
    """What one layer keeps per token in the KV cache: ``key_heads`` keys of width
    ``key_width`` and ``value_heads`` values of width ``value_width``."""

    key_heads: int
    key_width: int
    value_heads: int
    value_width: int

    @property
    def elements_per_token(self) -> int:
        return self.key_heads * self.key_width + self.value_heads * self.value_width


@dataclass(frozen=True)
class ServedWeight:
    """A tensor of one layer's attention beyond W_Q, W_K, W_V and W_O that a serving engine
    reads from the checkpoint (:meth:`AttentionType.vllm_weights`), named as under
    ``layers.i.attn`` (``lambda_q1``, ``lambda_proj.weight``)."""

    shape: tuple[int, ...]
    split_dim: int | None = None
    """The dimension tensor parallelism cuts into equal contiguous parts, one per rank, in the
    order of the ranks' heads (W_λ's rows), or ``None``: every rank holds all of it."""


class AttentionType:
    """The declaration of one attention type. Subclass it, set the class attributes, override
    what differs from the baseline's softmax attention, and register an instance.

    The defaults describe grouped-query softmax attention over the config's ``n_heads`` query
    and ``n_kv_heads`` key/value heads of width ``d`` (the matched baseline).
    """

    name: ClassVar[str] = ""
    """The name configs use (``attention: NAME``)."""
    title: ClassVar[str] = ""
    """The name reports print (``DIFF V1``)."""
    colour: ClassVar[str | None] = None
    """A matplotlib colour for its curves, or ``None`` for the next free one."""
    module: ClassVar[type | None] = None
    """The ``nn.Module`` class, built as ``module(config, layer_index)``."""
    options: ClassVar[tuple[TypeOption, ...]] = ()
    """The type's own options (kept in ``ModelConfig.attention_options[name]``)."""
    config_fields: ClassVar[tuple[str, ...]] = ()
    """The flat ``ModelConfig`` fields the type reads as its options (the papers' types)."""
    differential: ClassVar[bool] = False
    """Whether its output subtracts a second map (the probe's and analyses' λ, A1, A2)."""
    paper_claims: ClassVar[bool] = False
    """Whether ``diffattn compare`` judges the Differential Transformer papers' claims
    (``diffattn.compare.claims``: DIFF V1's tables and figures, the V2 blog) for this type
    against the baseline; any other type, and an ablation of any type, is reported as its
    measured difference to the baseline."""
    entry: ClassVar[str] = ENTRY_SOFTMAX
    """The kernel entry point its module calls (:data:`diffattn.attention.registry.ENTRIES`):
    what ``auto`` resolves its calls for and ``diffattn bench`` reports as its kernel. A type
    whose module calls ``softmax_attention`` runs on every backend without a kernel of its own."""
    bench_by_default: ClassVar[bool] = False
    """Whether ``diffattn bench`` times the type when ``--models`` does not choose its rows (the
    papers' three architectures); ``--models`` names any registered type. Not inherited."""
    source: ClassVar[str] = ""
    """Where the type is described (paper, equation), for reports and docs."""
    lambda_label: ClassVar[str | None] = None
    """How training summaries and plots name the type's λ, or ``None`` without one."""
    lambda_key: ClassVar[str] = "lambda"
    """The key of its λ in the per-layer summaries of ``compare`` (``lambda``/``lambda_mean``)."""
    vllm_reason: ClassVar[str | None] = "no vLLM attention layout is declared for this type"
    """Why vLLM cannot serve the type, or ``None`` when the plugin can (with :meth:`vllm_call`,
    :meth:`vllm_weights`, :meth:`vllm_queries` and :meth:`vllm_output`). Not inherited
    (:data:`NOT_INHERITED`)."""
    hf_format: ClassVar[str | None] = None
    """The Hugging Face format of its own that ``diffattn convert --to FORMAT`` writes a model
    of this type as (``hf-llama``: ``LlamaForCausalLM``, ``hf-diffllama``:
    ``DiffLlamaForCausalLM``), or ``None``: only ``--to hub``. Not inherited."""
    context_parallel_reason: ClassVar[str | None] = (
        "no context-parallel split is declared for this type"
    )
    """Why its layers cannot split the sequence over context-parallel ranks, or ``None`` when
    they can: each query's output depends only on its own token and the keys and values it may
    see, so every rank computes exact rows over the gathered K/V
    (:mod:`diffattn.attention.context_parallel`). Not inherited."""
    NOT_INHERITED: ClassVar[tuple[str, ...]] = (
        "vllm_reason",
        "hf_format",
        "bench_by_default",
        "context_parallel_reason",
    )
    """Claims about what the type computes, which a subclass may no longer meet: one that does
    not set them in its own body gets :class:`AttentionType`'s defaults (not served by vLLM,
    no Hugging Face format of its own) rather than its parent's values."""
    decodes_from_cache: ClassVar[bool] = True
    """Whether a layer can attend from a KV cache holding earlier tokens; ``generate`` runs
    the whole sequence at every step for a type that cannot (DINT)."""
    tensor_parallel: ClassVar[bool] = False
    """Whether the type declares a tensor-parallel plan (:meth:`tp_plan`): its heads split by
    :meth:`kv_units` with ``q_proj``/``k_proj``/``v_proj`` by column and ``o_proj`` by row."""
    heads_per_output_head: ClassVar[int] = 1
    """How many of the baseline's ``n_heads`` make one output head (2 for DIFF V1: a
    differential head is a pair); Hugging Face's ``num_attention_heads`` counts output heads."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Reset the attributes of :data:`NOT_INHERITED` that ``cls`` does not set itself."""
        super().__init_subclass__(**kwargs)
        for name in AttentionType.NOT_INHERITED:
            if name not in cls.__dict__:
                setattr(cls, name, AttentionType.__dict__[name])

    # --- options ----------------------------------------------------------------------
    def option_values(self, stored: Mapping[str, Any] | None) -> dict[str, Any]:
        """The type's options: ``stored`` over the declared defaults."""
        values = {option.name: option.default for option in self.options}
        values.update(stored or {})
        return values

    def option_problems(self, stored: Mapping[str, Any]) -> list[tuple[str, str]]:
        """``(option, why)`` for each unknown or refused option in ``stored``."""
        known = {option.name: option for option in self.options}
        problems = []
        for key, value in stored.items():
            if key not in known:
                choices = ", ".join(sorted(known)) or "none"
                problems.append((key, f"unknown option of {self.name}; its options are {choices}"))
                continue
            why = known[key].problem(value)
            if why is not None:
                problems.append((key, why))
        return problems

    # --- structure --------------------------------------------------------------------
    def check(self, config) -> list[tuple[str, str]]:
        """``(field, why)`` for each way ``config``'s heads do not fit this type (field
        names a ``ModelConfig`` field or ``attention_options.<type>.<option>``)."""
        return []

    def query_heads(self, config) -> int:
        """Query heads of width d that ``q_proj`` projects."""
        return config.n_heads

    def output_heads(self, config) -> int:
        """Heads the attention outputs (what the probe and analyses count)."""
        return config.n_heads // self.heads_per_output_head

    def n_heads_for_output_heads(self, output_heads: int, stored: Mapping[str, Any] | None) -> int:
        """The ``n_heads`` whose layers output ``output_heads`` heads under the options
        ``stored`` (Hugging Face's ``num_attention_heads`` given instead of ``n_heads``);
        ``ValueError`` when no ``n_heads`` does."""
        return output_heads * self.heads_per_output_head

    def output_width(self, config) -> int:
        """The width of one output head (``output_heads · output_width = n_heads · d``)."""
        return config.n_heads * config.dim_per_head // self.output_heads(config)

    def cache_layout(self, config) -> CacheLayout:
        """The per-layer KV-cache layout (:class:`CacheLayout`)."""
        d = config.dim_per_head
        return CacheLayout(config.num_kv_heads, d, config.num_kv_heads, d)

    def kv_units(self, config) -> int:
        """The indivisible KV units tensor parallelism and vLLM split the heads by."""
        return config.num_kv_heads

    def kv_unit_name(self, config) -> str:
        return "KV heads"

    def extra_linear_outputs(self, config) -> int:
        """Output widths of projections from ``d_model`` beyond W_Q, W_K, W_V and W_O (W_λ)."""
        return 0

    def extra_parameters(self, config) -> int:
        """Parameters one layer has beyond the matched baseline's attention (λ vectors, norm
        weights, wider projections); what parameter matching takes from the FFN."""
        return 0

    def attention_flops_for_keys(self, config, keys: float, v1_form: str) -> float:
        """Forward FLOPs of one query token's attention in one layer reading ``keys`` keys."""
        d = config.dim_per_head
        return self.query_heads(config) * (2.0 * d * keys + 2.0 * d * keys)

    def matches_by_ffn(self, config) -> bool:
        """Whether parameter matching narrows the FFN (``presets.match_params``): a type with
        extra parameters that are not negligible."""
        return self.extra_parameters(config) > 0

    # --- tensor parallelism ---------------------------------------------------------------
    def tp_problem(self, config, tp: int) -> str | None:
        """Why the type's heads cannot be split over ``tp`` ranks (beyond KV units)."""
        if not self.tensor_parallel:
            return f"attention type {self.name!r} declares no tensor-parallel plan"
        return None

    def tp_plan(self, config, colwise: Callable[[], Any], replicated: Callable[..., Any]):
        """Extra ``{module path under layers.*.attn: style}`` entries of the TP plan."""
        return {}

    # --- vLLM ----------------------------------------------------------------------------
    vllm_width_note: ClassVar[str] = "its attention heads have width head_dim = {width}"
    """How a refused vLLM head size is explained (``{width}``: the call's head size)."""

    def vllm_call(self, config) -> tuple[int, int, int]:
        """The stock paged-attention call serving a layer, before tensor parallelism:
        ``(query heads, KV heads, head size)``."""
        return self.query_heads(config), config.num_kv_heads, config.dim_per_head

    def vllm_weights(self, config, layer_index: int) -> dict[str, ServedWeight]:
        """The tensors of layer ``layer_index``'s attention beyond W_Q, W_K, W_V and W_O that
        the served layer reads from the checkpoint (:class:`ServedWeight`: λ's vectors, W_λ)."""
        return {}

    def vllm_queries(self, config, q):
        """The call's queries ``(T, heads·head size)`` on one rank, from ``q_proj``'s queries
        of width d after RoPE, ``(T, query heads·d)``."""
        return q

    def vllm_output(self, config, layer_index: int, out, x, weights):
        """W_O's input ``(T, output_heads·output_width / tp)`` on one rank (``n_heads·d / tp``
        unless the type changes W_O's width), from the call's output ``out``
        ``(T, heads·head size)``, the layer's input ``x`` ``(T, d_model)`` and this rank's
        parts of :meth:`vllm_weights` (``{name: tensor}``); rounded where the type's module
        rounds, so the served model computes what diffattn computes."""
        return out

    # --- initialisation -------------------------------------------------------------------
    # --- what the capture probe reads --------------------------------------------------
    def scalar_lambda(self, module) -> Any:
        """The layer's one λ as a 0-d fp32 tensor, read from the parameters of ``module`` (its
        attention module; DIFF V1 Eq.2), or ``None`` when its λ is not one number per layer
        (:class:`diffattn.probe.Lambda` records it under :attr:`lambda_key`)."""
        return None

    def token_lambda(self, module) -> tuple[Any, Callable[[Any], Any]] | None:
        """``(submodule, to_lambda)`` when the layer applies a λ per token and head: the
        submodule of ``module`` whose forward output gives it and the map from that output to
        λ (DIFF V2: ``lambda_proj``, then the sigmoid); ``None`` otherwise. The probe averages
        it over the tokens of the forwards it watches (:attr:`lambda_key`)."""
        return None

    def lambda_init(self, config, layer_index: int) -> float | None:
        """λ_init of layer ``layer_index``, or ``None`` for a type without one."""
        return None

    def describe(self, config) -> str:
        """One line for parameter reports: the type, its heads and widths."""
        return (
            f"{self.title or self.name}: {self.query_heads(config)} query heads, "
            f"{config.num_kv_heads} KV heads of width {config.dim_per_head}"
        )

    def __repr__(self) -> str:
        return f"<attention type {self.name!r}>"


_TYPES: dict[str, AttentionType] = {}
_discovered = False
_entry_point_errors: dict[str, str] = {}


def register_attention_type(declaration: AttentionType, *, replace: bool = False):
    """Add ``declaration`` (an :class:`AttentionType` instance) to the registry and return it;
    re-registering a name needs ``replace=True``."""
    if not isinstance(declaration, AttentionType):
        raise TypeError(
            f"register_attention_type takes an AttentionType instance, got {declaration!r}"
        )
    name = declaration.name
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"an attention type's name must be an identifier, got {name!r}")
    if declaration.module is None:
        raise ValueError(f"attention type {name!r} declares no module")
    if name in _TYPES and not replace and _TYPES[name] is not declaration:
        raise ValueError(f"attention type {name!r} is already registered")
    _TYPES[name] = declaration
    return declaration


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for module in BUILT_IN_MODULES:
        importlib.import_module(module)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
            declaration = loaded if isinstance(loaded, AttentionType) else loaded()
            if declaration.name not in _TYPES or _TYPES[declaration.name] is not declaration:
                register_attention_type(declaration)
        except Exception as error:
            _entry_point_errors[entry.name] = f"{type(error).__name__}: {error}"
            logger.warning("attention type entry point %r failed to load: %s", entry.name, error)


def attention_type_names() -> tuple[str, ...]:
    """Every registered attention type, built-in first."""
    _discover()
    return tuple(_TYPES)


def attention_type(name: str) -> AttentionType:
    """The declaration registered as ``name``; ``ValueError`` listing the choices if none."""
    _discover()
    if name not in _TYPES:
        hint = _entry_point_errors.get(name)
        extra = f" (its entry point failed to load: {hint})" if hint else ""
        raise ValueError(
            f"unknown attention type {name!r}{extra}; "
            f"choose one of {', '.join(attention_type_names())}"
        )
    return _TYPES[name]


def unregister_attention_type(name: str) -> None:
    """Remove a registered type (tests, notebooks); the built-in types cannot be removed."""
    if _TYPES.get(name) is not None and type(_TYPES[name]).__module__ in BUILT_IN_MODULES:
        raise ValueError(f"{name!r} is a built-in attention type")
    _TYPES.pop(name, None)
