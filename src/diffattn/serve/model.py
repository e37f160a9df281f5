"""What ``diffattn serve`` hands to transformers' serving code: a Hugging Face model with
``generate`` and a fast tokenizer, for every kind of model :mod:`diffattn.loading` reads.

A diffattn directory (baseline, DIFF V1, DIFF V2) is read by :func:`diffattn.loading.load_model`
(with ``--backend`` as a config override) and wrapped in
:class:`~diffattn.hf.modeling.DiffAttnForCausalLM` (weights shared); Hugging Face directories
(Llama, Qwen2, Mistral, DiffLlama, a Dex-merged model), GGUF files and Dex adapters come back
from it as Hugging Face models already.
"""

from __future__ import annotations

import os
from typing import Any

from diffattn.fileio import CheckpointError, read_json
from diffattn.loading import (
    ModelSource,
    has_tokenizer,
    load_model,
    load_saved_tokenizer,
    resolve_source,
)
from diffattn.serve.options import ServeOptions

GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_HINT = (
    "start the server with --chat-template FILE|STRING (a Jinja chat template), or send the "
    "text to /v1/completions"
)


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of a ``--dtype`` name; ``None`` for ``auto`` (a diffattn directory
    keeps its stored dtypes, the other kinds load in float32)."""
    import torch

    return None if name == "auto" else getattr(torch, name)


class ServedModelLoader:
    """Loads the model and tokenizer of ``options`` (again after an unload).

    The source is classified at construction, so a path that is not a model is an error before
    the server is built.
    """

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.source: ModelSource = resolve_source(options.model, base=options.base)
        if options.backend is not None and self.source.kind != "diffattn":
            raise ValueError(
                f"--backend {options.backend}: chooses the attention of diffattn model "
                f"directories only; {options.model} is a {self.source.kind} model"
            )

    def load_tokenizer(self) -> Any:
        """The model's own fast tokenizer, with ``--chat-template`` applied when given."""
        directory = self.source.model_dir
        if not has_tokenizer(directory):
            raise CheckpointError(
                f"{directory}: no tokenizer (tokenizer.json or tokenizer_config.json); a "
                "server needs one to read prompts: copy the files of the tokenizer the model "
                "was trained with into it"
            )
        tokenizer = load_saved_tokenizer(directory)
        if not hasattr(tokenizer, "apply_chat_template") or not getattr(tokenizer, "is_fast", 0):
            raise CheckpointError(
                f"{directory}: the tokenizer must load as a transformers fast tokenizer "
                f"(got {type(tokenizer).__name__})"
            )
        if self.options.chat_template is not None:
            tokenizer.chat_template = self.options.chat_template
        return tokenizer

    def load_model(self) -> Any:
        """The model in eval mode on ``--device`` in ``--dtype``, with ``generate``; its
        generation config knows the EOS token (``generation_config.json``, else the
        tokenizer's)."""
        overrides = {"backend": self.options.backend} if self.options.backend else {}
        model = load_model(
            self.source,
            device=self.options.device,
            dtype=torch_dtype(self.options.dtype),
            **overrides,
        )
        if not hasattr(model, "generate"):  # a diffattn DiffTransformerLM
            from diffattn.hf.modeling import DiffAttnForCausalLM

            model = DiffAttnForCausalLM.from_diffattn(model).eval()
            self._set_eos(model)
        return model

    def _set_eos(self, model: Any) -> None:
        """EOS: ``generation_config.json``'s ``eos_token_id`` when it has one (``null``: none,
        generation runs to its limit), else the tokenizer's."""
        directory = self.source.model_dir
        generation_config = os.path.join(directory, GENERATION_CONFIG_FILE)
        saved = read_json(generation_config) if os.path.isfile(generation_config) else {}
        if "eos_token_id" in saved:
            eos = saved["eos_token_id"]
        elif has_tokenizer(directory):
            eos = getattr(load_saved_tokenizer(directory), "eos_token_id", None)
        else:
            eos = None
        if eos is not None:
            model.generation_config.eos_token_id = eos
            if model.generation_config.pad_token_id is None:
                model.generation_config.pad_token_id = eos if isinstance(eos, int) else eos[0]


def context_length(model: Any) -> int | None:
    """The most tokens (prompt + completion) the model attends over: its config's
    ``max_position_embeddings`` (``max_seq_len`` of a diffattn model)."""
    value = getattr(model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
