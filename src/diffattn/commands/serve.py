"""``diffattn serve MODEL``: serve a model over an OpenAI-compatible HTTP API (docs/serving.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from diffattn.serve.options import (
    CB_SIZE_OPTIONS,
    CPU_CACHE_FRACTION,
    DEVICES_HELP,
    DTYPES,
    LOG_LEVELS,
    LOOPBACK,
)
from diffattn.settings import Settings, setting

DESCRIPTION = (
    "Serve any model diffattn loads (diffattn directories, Hugging Face Llama/Qwen2/Mistral/"
    "DiffLlama and Dex-merged checkpoints, GGUF SmolLM2, Dex adapters) with transformers' "
    "OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/responses, "
    "/v1/models, /health. Needs pip install 'diffattn[serve]'. With --engine vllm, vLLM's "
    "OpenAI server instead (diffattn checkpoints through diffattn's vLLM plugin)."
)


def _cb_size(key: str) -> Any:
    """The ``--cb-*`` setting of the continuous-batching size ``key`` of
    :data:`~diffattn.serve.options.CB_SIZE_OPTIONS` (its text, checked by ``parse_options``)."""
    kind, meaning = CB_SIZE_OPTIONS[key]
    help_text = f"continuous batching: {meaning} (default: transformers')"
    if key == "max_memory_percent":
        help_text += f"; on the CPU {CPU_CACHE_FRACTION} unless --cb-num-blocks is given"
    return setting(None, metavar="N" if kind is int else "F", help=help_text)


@dataclass(frozen=True)
class ServeSettings(Settings):
    """The options of ``diffattn serve``, as the command line gives them: text, checked and
    converted by :func:`diffattn.serve.parse_options` (a bad value is one line, exit code 2).
    The ``cb_*`` settings are the sizes of :data:`~diffattn.serve.options.CB_SIZE_OPTIONS`."""

    model: str = setting(
        positional=True,
        metavar="MODEL",
        help="model directory, .gguf file, 'smollm2', Dex adapter or run directory",
    )
    name: str | None = setting(
        None, help="the model name clients send and /v1/models lists (default: MODEL as given)"
    )
    base: str | None = setting(None, help="the pretrained model of a Dex adapter")
    host: str = setting(
        LOOPBACK,
        help="address to listen on (default: {default}, this machine only); any other "
        "address exposes the server, unauthenticated, to whoever reaches it",
    )
    port: str = setting("8000", help="port to listen on (default: {default})")
    device: str = setting("auto", help=f"{DEVICES_HELP} (default: {{default}})")
    dtype: str = setting(
        "auto",
        help=f"{', '.join(DTYPES)} (default: {{default}}: a diffattn directory's stored dtype, "
        "float32 for the other kinds)",
    )
    backend: str | None = setting(
        None, help="attention backend of a diffattn model (default: the one in its config.json)"
    )
    continuous_batching: bool = setting(
        False, help="batch concurrent requests on transformers' paged attention"
    )
    cb_block_size: str | None = _cb_size("block_size")
    cb_num_blocks: str | None = _cb_size("num_blocks")
    cb_max_batch_tokens: str | None = _cb_size("max_batch_tokens")
    cb_max_memory_percent: str | None = _cb_size("max_memory_percent")
    compile: bool = setting(
        False, help="torch.compile the decode step (transformers' static cache)"
    )
    chat_template: str | None = setting(
        None,
        metavar="FILE|STRING",
        help="Jinja chat template (a file, or the template itself) for a tokenizer without one, "
        "or to replace its own",
    )
    engine: str = setting(
        "transformers",
        help="transformers (default: {default} serve in this process) or vllm (vLLM's "
        "OpenAI server with diffattn's model plugin; needs vLLM installed, docs/serving.md)",
    )
    vllm_args: str | None = setting(
        None,
        metavar="ARGS",
        help="more options for vLLM's server, as one string after an equals sign "
        "(--vllm-args='--enforce-eager --max-num-seqs 64'); --engine vllm only",
    )
    log_level: str = setting("warning", help=f"{', '.join(LOG_LEVELS)} (default: {{default}})")

    def cb_sizes(self) -> dict[str, str | None]:
        """The continuous-batching sizes by :data:`CB_SIZE_OPTIONS` name (``None``: not set)."""
        return {key: getattr(self, f"cb_{key}") for key in CB_SIZE_OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` verb's arguments to ``parser`` (:class:`ServeSettings`)."""
    ServeSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Check the options, load the model, serve until SIGINT/SIGTERM. Returns the exit code."""
    from diffattn.serve.hf_serving import require_serving
    from diffattn.serve.options import parse_options

    settings = ServeSettings.from_args(args)
    options = parse_options(
        settings.model,
        name=settings.name,
        base=settings.base,
        host=settings.host,
        port=settings.port,
        device=settings.device,
        dtype=settings.dtype,
        backend=settings.backend,
        continuous_batching=settings.continuous_batching,
        cb_sizes=settings.cb_sizes(),
        compile=settings.compile,
        chat_template=settings.chat_template,
        log_level=settings.log_level,
        engine=settings.engine,
        vllm_args=settings.vllm_args,
    )
    if options.engine == "vllm":
        from diffattn.serve.vllm_engine import serve_with_vllm

        return serve_with_vllm(options)
    try:
        require_serving()
    except ImportError as error:
        raise ValueError(str(error)) from None
    from diffattn.serve.app import serve

    return serve(options)
