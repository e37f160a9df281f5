"""Every model diffattn loads, as an lm-evaluation-harness model named ``diffattn``.

Importing this module registers :class:`DiffattnLM` in the harness's model registry (the
harness's own command line cannot find model classes outside its package; ``diffattn
lm-eval`` imports this module, then runs that command line). It is the harness's
Hugging Face model class (``HFLM``: its batching, tokenization and scoring) over a model
loaded by :func:`diffattn.eval.common.load_models`, so ``--model_args`` take what
``diffattn eval`` takes:

* ``pretrained=MODEL``: a diffattn directory, a Hugging Face Llama/Qwen2/Mistral/DiffLlama
  directory, a ``.gguf`` file or ``smollm2``, a Dex adapter or run directory, a hub id;
* ``dex=ADAPTER``: a Dex adapter applied to ``MODEL`` first;
* ``dtype=fp32|bf16|fp16`` (default fp32), ``device=cpu|cuda|auto`` (the harness's
  ``--device``; default auto: CUDA when available), ``max_length=N``
  (default: the model's context length), and the harness's other ``HFLM`` arguments
  (``batch_size``, ``add_bos_token``, ...).

Any other argument is refused with its name: an argument ``HFLM`` does not know, and those
that only steer how ``HFLM`` loads a model by name (``revision``, ``peft``, ``parallelize``,
...), which it would ignore for a model loaded here.

Needs ``pip install 'diffattn[lm-eval]'``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from torch import nn

from diffattn.eval.common import load_models
from diffattn.eval.text import context_limit

MODEL_NAME = "diffattn"
HARNESS_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "fp32"}
# HFLM arguments that only act while it loads a model by name: given a loaded model it drops
# them, so here they would be ignored silently.
LOADING_ONLY = frozenset(
    {
        "revision", "subfolder", "trust_remote_code", "use_fast_tokenizer", "parallelize",
        "max_memory_per_gpu", "max_cpu_memory", "offload_folder", "tp_plan", "peft", "delta",
        "autogptq", "gptqmodel", "gguf_file",
    }
)  # fmt: skip


def check_harness_arguments(kwargs: dict[str, Any]) -> None:
    """Refuse, by name, every argument ``HFLM`` would not use for a model loaded here."""
    explicit = {
        name
        for name, parameter in inspect.signature(HFLM.__init__).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }
    unknown = sorted(set(kwargs) - explicit)
    if unknown:
        raise TypeError(f"diffattn harness model: unknown argument(s) {', '.join(unknown)}")
    ignored = sorted(set(kwargs) & LOADING_ONLY)
    if ignored:
        raise TypeError(
            f"diffattn harness model: {', '.join(ignored)} only apply when the harness loads "
            "a model by name; diffattn loads it (pretrained=, dex=, dtype=, device=)"
        )
    backend = kwargs.pop("backend", "causal")
    if backend not in ("causal", "default"):
        raise TypeError(f"diffattn harness model: backend={backend!r}; its models are causal")


class CausalLMView(nn.Module):
    """A diffattn model with the few attributes the harness reads from a Hugging Face one
    (``config.model_type``, ``device``, ``tie_weights``, ``generate``); calls go to the
    model."""

    def __init__(self, model: nn.Module, eos_token_id: int | None = None) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.eos_token_id = eos_token_id
        self.hf_model: nn.Module | None = None

    @property
    def device(self) -> torch.device:
        return next(self.inner.parameters()).device

    def tie_weights(self) -> None:
        """Nothing to do: diffattn models tie (or not) at construction."""

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return self.inner(input_ids=input_ids, **kwargs)

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """Hugging Face's ``generate`` (the harness's ``generate_until``: left-padded batches,
        its stop-string criteria), run by :class:`~diffattn.hf.modeling.DiffAttnForCausalLM`
        around the same weights. A row ends at ``eos_token_id`` (the tokenizer's), as a
        Hugging Face model's generation config ends it: the harness decodes without special
        tokens, so a row that went on past EOS would keep what followed it."""
        if self.hf_model is None:
            from diffattn.hf.modeling import DiffAttnForCausalLM

            self.hf_model = DiffAttnForCausalLM.from_diffattn(self.inner).eval()
            self.hf_model.generation_config.eos_token_id = self.eos_token_id
        return self.hf_model.generate(**kwargs)


@register_model(MODEL_NAME)
class DiffattnLM(HFLM):
    """``lm_eval --model diffattn --model_args pretrained=MODEL[,dex=ADAPTER,...]``."""

    def __init__(
        self,
        pretrained: str,
        dex: str | None = None,
        dtype: str = "fp32",
        device: str | None = "auto",
        max_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(pretrained, str):
            raise ValueError("pretrained= must name a model (a path, smollm2 or a hub id)")
        check_harness_arguments(kwargs)
        dtype = HARNESS_DTYPES.get(str(dtype), str(dtype))
        loaded = load_models([pretrained], dex=dex, device=device or "auto", dtype=dtype)[0]
        if loaded.tokenizer is None or not hasattr(
            loaded.tokenizer.backend, "convert_ids_to_tokens"
        ):
            raise ValueError(
                f"{pretrained}: the harness needs a Hugging Face tokenizer stored with the "
                "model (tokenizer.json or tokenizer_config.json) and transformers installed"
            )
        model = (
            loaded.model
            if loaded.kind != "diffattn"
            else CausalLMView(loaded.model, loaded.tokenizer.eos_token_id)
        )
        self.diffattn_model = loaded
        super().__init__(
            pretrained=model,
            tokenizer=loaded.tokenizer.backend,
            backend="causal",
            max_length=max_length or context_limit(loaded),
            **kwargs,
        )
