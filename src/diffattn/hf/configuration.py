"""``DiffAttnConfig``: the Hugging Face ``PretrainedConfig`` of a diffattn model.

It carries every :class:`~diffattn.config.ModelConfig` field under the same name, validates
them through ``ModelConfig`` (a bad value raises ``ValueError`` naming the field), and maps the
standard HF attribute names onto them (``hidden_size`` -> ``d_model``, ``num_hidden_layers`` ->
``n_layers``, ...), so HF utilities that read those names work. ``config.json`` always holds
every field, not only those that differ from the defaults, so a saved model keeps its meaning
if a default changes later.

Constructor arguments are never silently dropped: a diffattn field, an HF name of one (table
:data:`HF_NAMES`; both names at once must agree), an HF setting that diffattn models have
fixed (:data:`FIXED_SETTINGS`, accepted only with the fixed value) or one of the generic
settings of HF's ``PretrainedConfig`` (token ids, ``return_dict``, ``dtype``, ...). Anything
else is a ``ValueError`` naming it. An attribute set on a built config (HF's tools set free
attributes on any config) is saved, and ``config.json`` lists such names under
``diffattn_extra_attributes``, so the file reads back as written; they do not change the model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from transformers import PretrainedConfig

from diffattn.checkpoint import MODEL_TYPE
from diffattn.config import RUNTIME_FIELDS, ModelConfig
from diffattn.hf.compat import generic_config_keys
from diffattn.hf.remote_runtime import register_auto_class, write_modeling_file

# The architecture; the backend is chosen with HF's attn_implementation instead.
_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModelConfig)
    if f.name != "extra" and f.name not in RUNTIME_FIELDS
)

HF_NAMES = {
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "max_position_embeddings": "max_seq_len",
    "intermediate_size": "ffn_hidden",
    "rms_norm_eps": "norm_eps",
    "initializer_range": "init_std",
    "tie_word_embeddings": "tie_embeddings",
    "num_key_value_heads": "n_kv_heads",
}
"""HF's standard names of diffattn fields; ``num_attention_heads`` is handled apart (for DIFF
V1 it counts differential heads, ``n_heads / 2``; see ``DiffAttnConfig.num_attention_heads``)."""

FIXED_SETTINGS: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
}
"""HF settings that diffattn models do not make configurable: accepted with this value only."""

EXTRA_ATTRIBUTES_KEY = "diffattn_extra_attributes"

TOKEN_ID_NAMES = ("pad_token_id", "bos_token_id", "eos_token_id")
"""Special token ids every config states (``None`` when the tokenizer has none)."""


def _single_type(attention: str, layer_types: Any):
    """The declaration of the one type every layer of the stack has, or ``None`` for a stack of
    mixed types (whose ``num_attention_heads`` is ``n_heads``) or a name not registered
    (``ModelConfig`` then refuses it by name)."""
    from diffattn.attention.types import attention_type

    names = set(layer_types) if isinstance(layer_types, list | tuple) and layer_types else set()
    names = names or {attention}
    if len(names) != 1:
        return None
    try:
        return attention_type(names.pop())
    except (ValueError, TypeError):
        return None


def _n_heads_for(output_heads: int, fields: dict[str, Any]) -> int:
    """``n_heads`` for Hugging Face's ``num_attention_heads`` (the heads W_O reads) under the
    type and options in ``fields``: the declaration's
    :meth:`~diffattn.attention.types.AttentionType.n_heads_for_output_heads`."""
    declared = _single_type(fields.get("attention", "baseline"), fields.get("layer_types"))
    if declared is None:
        return output_heads
    options = fields.get("attention_options") or {}
    stored = options.get(declared.name) if isinstance(options, dict) else None
    return declared.n_heads_for_output_heads(output_heads, stored)


def _translate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The diffattn fields given in ``kwargs`` under either name (popped from ``kwargs``)."""
    fields = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
    for hf_name, field in HF_NAMES.items():
        if hf_name not in kwargs:
            continue
        value = kwargs.pop(hf_name)
        if field in fields and fields[field] != value:
            raise ValueError(
                f"DiffAttnConfig: {hf_name}={value!r} contradicts {field}={fields[field]!r} "
                "(the same setting under its HF name); give one"
            )
        fields[field] = bool(value) if field == "tie_embeddings" else value
    if "num_attention_heads" in kwargs:
        value = kwargs.pop("num_attention_heads")
        try:
            n_heads = _n_heads_for(int(value), fields)
        except ValueError as error:
            raise ValueError(f"DiffAttnConfig: {error}") from None
        if "n_heads" in fields and fields["n_heads"] != n_heads:
            raise ValueError(
                f"DiffAttnConfig: num_attention_heads={value!r} means n_heads={n_heads} for "
                f"attention={fields.get('attention', 'baseline')!r}, but n_heads="
                f"{fields['n_heads']!r} was given; give one"
            )
        fields["n_heads"] = n_heads
    for name, fixed in FIXED_SETTINGS.items():
        if name in kwargs and kwargs.pop(name) != fixed:
            raise ValueError(
                f"DiffAttnConfig: {name} is fixed to {fixed!r} in diffattn models; it cannot be "
                "changed"
            )
    return fields


def _derived(model_name: str, field: str | None, doc: str) -> property:
    """An HF attribute derived from the :class:`ModelConfig`: read as ``model_name`` of
    :meth:`DiffAttnConfig.to_model_config`, written (when ``field`` is given) as the
    diffattn field ``field`` (an ``int``)."""

    def read(config: DiffAttnConfig) -> int:
        return getattr(config.to_model_config(), model_name)

    def write(config: DiffAttnConfig, value: int) -> None:
        setattr(config, field, int(value))

    return property(read, None if field is None else write, doc=doc)


class DiffAttnConfig(PretrainedConfig):
    """HF config for ``DiffAttnForCausalLM`` (``model_type = "diffattn"``)."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ("cache", "past_key_values")
    attribute_map = {  # noqa: RUF012 (HF reads this class attribute)
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "max_seq_len",
        "rms_norm_eps": "norm_eps",
        "initializer_range": "init_std",
    }

    def __init__(self, **kwargs: Any) -> None:
        fields = _translate(kwargs)
        kwargs.pop("diffattn_version", None)
        for name in RUNTIME_FIELDS:  # written by earlier versions; a run-time choice now
            kwargs.pop(name, None)
        saved_extras = set(kwargs.pop(EXTRA_ATTRIBUTES_KEY, ()))
        unknown = sorted(set(kwargs) - generic_config_keys() - saved_extras)
        if unknown:
            raise ValueError(
                f"DiffAttnConfig: unknown argument(s) {', '.join(map(repr, unknown))}; the "
                "diffattn fields are those of diffattn.config.ModelConfig (or their HF names: "
                + ", ".join(sorted([*HF_NAMES, "num_attention_heads"]))
                + ")"
            )
        model_config = ModelConfig.from_dict(fields)  # validates; names bad keys and values
        for name in _FIELDS:
            setattr(self, name, getattr(model_config, name))  # layer_types: see its property
        if self.head_dim is None:  # HF reads head_dim; state it, it is the same model
            self.head_dim = model_config.dim_per_head
        kwargs["tie_word_embeddings"] = model_config.tie_embeddings
        self.use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)
        for name in TOKEN_ID_NAMES:  # as Llama's config: HF's tools read them, None if unset
            try:
                getattr(self, name)
            except AttributeError:
                setattr(self, name, None)

    # HF reads these standard names; they are derived from the ModelConfig fields.
    @property
    def num_attention_heads(self) -> int:
        """Heads whose maps ``output_attentions`` returns: the heads W_O reads, as the type
        declares them (``n_heads`` for the baseline and DIFF V2, ``n_heads / 2`` differential
        heads for DIFF V1, the signal heads for GDA; ``n_heads`` for a stack of mixed types)."""
        declared = _single_type(self.attention, self._layer_types)
        if declared is None:
            return self.n_heads
        return declared.output_heads(self.to_model_config())

    @num_attention_heads.setter
    def num_attention_heads(self, value: int) -> None:
        self.n_heads = _n_heads_for(int(value), self._field_values())

    @property
    def layer_types(self) -> list[str] | None:
        """Hugging Face's ``layer_types``: what its caches and masks read per layer,
        ``full_attention`` for every layer of a stack of mixed attention types (each is causal
        attention over the whole cache), ``None`` otherwise. diffattn's own per-layer types
        (``ModelConfig.layer_types``) are kept beside it and are what ``config.json`` stores
        under this key (``to_model_config().layer_types`` reads them)."""
        names = self._layer_types
        return None if names is None else ["full_attention"] * len(names)

    @layer_types.setter
    def layer_types(self, value: Any) -> None:
        """Set diffattn's per-layer attention types (``ModelConfig.layer_types``)."""
        self.__dict__["layer_types"] = None if value is None else list(value)

    @property
    def _layer_types(self) -> list[str] | None:
        return self.__dict__.get("layer_types")

    num_key_value_heads = _derived(
        "num_kv_heads",
        "n_kv_heads",
        "Key heads of width ``head_dim`` in the cache (``n_kv_heads``, or ``n_heads``).",
    )
    intermediate_size = _derived(
        "ffn_dim",
        "ffn_hidden",
        "The SwiGLU hidden size (``ffn_hidden``, or its default from ``d_model``).",
    )
    ffn_dim = _derived("ffn_dim", None, "The SwiGLU hidden size (read only).")

    def _field_values(self) -> dict[str, Any]:
        """The :class:`ModelConfig` fields as stored (``layer_types``: diffattn's names)."""
        values = {name: getattr(self, name) for name in _FIELDS}
        values["layer_types"] = self._layer_types
        return values

    def to_model_config(self) -> ModelConfig:
        """The validated :class:`ModelConfig` these settings describe."""
        return ModelConfig.from_dict(self._field_values())

    @classmethod
    def from_model_config(cls, config: ModelConfig, **hf_kwargs: Any) -> DiffAttnConfig:
        """Wrap a :class:`ModelConfig` (``hf_kwargs``: e.g. ``eos_token_id``)."""
        data = config.to_dict()
        data.pop("extra", None)
        return cls(**data, **hf_kwargs)

    def to_diff_dict(self) -> dict[str, Any]:
        data = super().to_diff_dict()
        data.update(self._field_values())  # always write every model field (module docstring)
        from diffattn.version import __version__

        data["diffattn_version"] = __version__
        return data

    def to_dict(self) -> dict[str, Any]:
        """HF's dict, plus the names of free attributes set on this config (module docstring)."""
        data = super().to_dict()
        data.pop(EXTRA_ATTRIBUTES_KEY, None)
        known = {*_FIELDS, *HF_NAMES, "num_attention_heads", "diffattn_version"}
        extras = sorted(
            k for k in data if not k.startswith("_") and k not in known | generic_config_keys()
        )
        if extras:
            data[EXTRA_ATTRIBUTES_KEY] = extras
        return data

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """HF's ``save_pretrained`` (arguments passed on as given), then ``modeling_diffattn.py``
        beside ``config.json`` when ``auto_map`` points at it and transformers copied no file
        (:func:`~diffattn.hf.remote_runtime.write_modeling_file`). A model's ``save_pretrained``
        calls this, so the file comes along with every save of a Hub directory's model."""
        super().save_pretrained(save_directory, *args, **kwargs)
        write_modeling_file(self, save_directory)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "ffn_dim":
            raise AttributeError(f"DiffAttnConfig.{name} is derived; set the ModelConfig fields")
        super().__setattr__(name, value)


def _register() -> None:
    """Make ``AutoConfig`` know ``model_type: diffattn`` as soon as this class exists. The model
    class registers itself with ``AutoModelForCausalLM`` when :mod:`diffattn.hf.modeling` is
    imported; :func:`diffattn.hf.register` pairs the two (``import diffattn`` arranges that it
    runs once this module or transformers has been imported, :mod:`diffattn.hf.autoregister`).
    The copy vendored into Hub remote code registers nothing (:mod:`diffattn.hf.remote_runtime`)."""
    register_auto_class("AutoConfig", DiffAttnConfig.model_type, DiffAttnConfig)


_register()
