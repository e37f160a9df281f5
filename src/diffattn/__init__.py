"""diffattn: Differential Transformers (DIFF V1, DIFF V2) next to a matched baseline."""

from diffattn import presets
from diffattn.config import ModelConfig, lambda_init_schedule
from diffattn.model import CausalLMOutput, DiffTransformerLM, count_parameters

__version__ = "0.1.0"

__all__ = [
    "CausalLMOutput",
    "DiffTransformerLM",
    "ModelConfig",
    "__version__",
    "count_parameters",
    "lambda_init_schedule",
    "presets",
]
