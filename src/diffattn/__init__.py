"""diffattn: Differential Transformers (DIFF V1, DIFF V2) next to a matched baseline."""

from diffattn import presets
from diffattn.attention.types import (
    AttentionType,
    TypeOption,
    attention_type,
    attention_type_names,
    register_attention_type,
)
from diffattn.config import ModelConfig, lambda_init_schedule
from diffattn.hf.autoregister import install as _install_hf_registration
from diffattn.loading import load_model
from diffattn.model import CausalLMOutput, DiffTransformerLM, count_parameters
from diffattn.version import __version__

_install_hf_registration()  # AutoConfig / AutoModelForCausalLM know "diffattn"

__all__ = [
    "AttentionType",
    "CausalLMOutput",
    "DiffTransformerLM",
    "ModelConfig",
    "TypeOption",
    "__version__",
    "attention_type",
    "attention_type_names",
    "count_parameters",
    "lambda_init_schedule",
    "load_model",
    "presets",
    "register_attention_type",
]
