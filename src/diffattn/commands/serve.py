"""``diffattn serve MODEL``: serve a model over an OpenAI-compatible HTTP API (docs/serving.md)."""

from __future__ import annotations

import argparse

from diffattn.serve.options import ServeSettings

__all__ = ["DESCRIPTION", "ServeSettings", "add_arguments", "run"]

DESCRIPTION = (
    "Serve any model diffattn loads (diffattn directories, Hugging Face Llama/Qwen2/Mistral/"
    "DiffLlama and Dex-merged checkpoints, GGUF SmolLM2, Dex adapters) with transformers' "
    "OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/responses, "
    "/v1/models, /health. Needs pip install 'diffattn[serve]'. With --engine vllm, vLLM's "
    "OpenAI server instead (diffattn checkpoints through diffattn's vLLM plugin)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` verb's arguments to ``parser``: the settings of
    :class:`~diffattn.serve.options.ServeSettings`, where each is declared."""
    ServeSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Check the options, load the model, serve until SIGINT/SIGTERM. Returns the exit code."""
    from diffattn.serve.hf_serving import require_serving
    from diffattn.serve.options import parse_options

    options = parse_options(ServeSettings.from_args(args))
    if options.engine == "vllm":
        from diffattn.serve.vllm_engine import serve_with_vllm

        return serve_with_vllm(options)
    try:
        require_serving()
    except ImportError as error:
        raise ValueError(str(error)) from None
    from diffattn.serve.app import serve

    return serve(options)
