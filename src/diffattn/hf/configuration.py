"""``DiffAttnConfig``: the Hugging Face ``PretrainedConfig`` of a diffattn model.

It carries every :class:`~diffattn.config.ModelConfig` field under the same name, validates
them through ``ModelConfig`` (a bad value raises ``ValueError`` naming the field), and maps the
standard HF attribute names onto them (``hidden_size`` -> ``d_model``, ``num_hidden_layers`` ->
``n_layers``, ...), so HF utilities that read those names work. ``config.json`` always holds
every field, not only those that differ from the defaults, so a saved model keeps its meaning
if a default changes later.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from diffattn.checkpoint import MODEL_TYPE
from diffattn.config import RUNTIME_FIELDS, ModelConfig

# The architecture; the backend is chosen with HF's attn_implementation instead.
_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModelConfig)
    if f.name != "extra" and f.name not in RUNTIME_FIELDS
)


class DiffAttnConfig(PretrainedConfig):
    """HF config for ``DiffAttnForCausalLM`` (``model_type = "diffattn"``)."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ("cache", "past_key_values")
    attribute_map = {  # noqa: RUF012 (HF reads this class attribute)
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "max_seq_len",
        "intermediate_size": "ffn_dim",
        "rms_norm_eps": "norm_eps",
        "initializer_range": "init_std",
    }

    def __init__(self, **kwargs: Any) -> None:
        fields = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
        if "tie_word_embeddings" in kwargs and "tie_embeddings" not in fields:
            fields["tie_embeddings"] = bool(kwargs["tie_word_embeddings"])
        kwargs.pop("diffattn_version", None)
        for name in RUNTIME_FIELDS:  # written by earlier versions; a run-time choice now
            kwargs.pop(name, None)
        model_config = ModelConfig.from_dict(fields)  # validates; names bad keys and values
        for name in _FIELDS:
            setattr(self, name, getattr(model_config, name))
        if self.head_dim is None:  # HF reads head_dim; state it, it is the same model
            self.head_dim = model_config.dim_per_head
        kwargs["tie_word_embeddings"] = model_config.tie_embeddings
        kwargs.pop("num_attention_heads", None)  # derived, see the property
        self.use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)

    # HF reads these standard names; they are derived from the ModelConfig fields.
    @property
    def num_attention_heads(self) -> int:
        """Heads whose maps ``output_attentions`` returns: the heads W_O reads (``n_heads``
        for the baseline and DIFF V2, ``n_heads / 2`` differential heads for DIFF V1)."""
        return self.to_model_config().n_output_heads

    @num_attention_heads.setter
    def num_attention_heads(self, value: int) -> None:
        factor = 2 if getattr(self, "attention", "baseline") == "diff_v1" else 1
        self.n_heads = int(value) * factor

    @property
    def num_key_value_heads(self) -> int:
        return self.to_model_config().num_kv_heads

    @property
    def ffn_dim(self) -> int:
        return self.to_model_config().ffn_dim

    def to_model_config(self) -> ModelConfig:
        """The validated :class:`ModelConfig` these settings describe."""
        return ModelConfig.from_dict({name: getattr(self, name) for name in _FIELDS})

    @classmethod
    def from_model_config(cls, config: ModelConfig, **hf_kwargs: Any) -> DiffAttnConfig:
        """Wrap a :class:`ModelConfig` (``hf_kwargs``: e.g. ``eos_token_id``)."""
        data = config.to_dict()
        data.pop("extra", None)
        return cls(**data, **hf_kwargs)

    def to_diff_dict(self) -> dict[str, Any]:
        data = super().to_diff_dict()
        for name in _FIELDS:  # always write every model field (see module docstring)
            data[name] = getattr(self, name)
        from diffattn.version import __version__

        data["diffattn_version"] = __version__
        return data

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("ffn_dim", "num_key_value_heads"):
            raise AttributeError(f"DiffAttnConfig.{name} is derived; set the ModelConfig fields")
        super().__setattr__(name, value)


def _register() -> None:
    """Make ``AutoConfig`` know ``model_type: diffattn`` as soon as this class exists, and
    bring in the model class, which registers itself with ``AutoModelForCausalLM``."""
    import importlib

    from transformers import AutoConfig

    AutoConfig.register(DiffAttnConfig.model_type, DiffAttnConfig, exist_ok=True)
    importlib.import_module("diffattn.hf.modeling")


_register()
