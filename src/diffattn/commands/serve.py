"""``diffattn serve MODEL``: serve a model over an OpenAI-compatible HTTP API (docs/serving.md)."""

from __future__ import annotations

import argparse

DESCRIPTION = (
    "Serve any model diffattn loads (diffattn directories, Hugging Face Llama/Qwen2/Mistral/"
    "DiffLlama and Dex-merged checkpoints, GGUF SmolLM2, Dex adapters) with transformers' "
    "OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/responses, "
    "/v1/models, /health. Needs pip install 'diffattn[serve]'. With --engine vllm, vLLM's "
    "OpenAI server instead (diffattn checkpoints through diffattn's vLLM plugin)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` verb's arguments to ``parser`` (values are checked by
    :func:`diffattn.serve.parse_options`, so a bad one is one line and exit code 2)."""
    from diffattn.serve.options import (
        CB_SIZE_OPTIONS,
        CPU_CACHE_FRACTION,
        DEVICES_HELP,
        DTYPES,
        LOG_LEVELS,
        LOOPBACK,
    )

    parser.add_argument(
        "model",
        metavar="MODEL",
        help="model directory, .gguf file, 'smollm2', Dex adapter or run directory",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="the model name clients send and /v1/models lists (default: MODEL as given)",
    )
    parser.add_argument("--base", default=None, help="the pretrained model of a Dex adapter")
    parser.add_argument(
        "--host",
        default=LOOPBACK,
        help=f"address to listen on (default: {LOOPBACK}, this machine only); any other "
        "address exposes the server, unauthenticated, to whoever reaches it",
    )
    parser.add_argument("--port", default="8000", help="port to listen on (default: 8000)")
    parser.add_argument("--device", default="auto", help=f"{DEVICES_HELP} (default: auto)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help=f"{', '.join(DTYPES)} (default: auto: a diffattn directory's stored dtype, "
        "float32 for the other kinds)",
    )
    parser.add_argument(
        "--backend",
        default=None,
        help="attention backend of a diffattn model (default: the one in its config.json)",
    )
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="batch concurrent requests on transformers' paged attention",
    )
    for key, (kind, meaning) in CB_SIZE_OPTIONS.items():
        help_text = f"continuous batching: {meaning} (default: transformers')"
        if key == "max_memory_percent":
            help_text += f"; on the CPU {CPU_CACHE_FRACTION} unless --cb-num-blocks is given"
        parser.add_argument(
            "--cb-" + key.replace("_", "-"),
            dest=f"cb_{key}",
            default=None,
            metavar="N" if kind is int else "F",
            help=help_text,
        )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step (transformers' static cache)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE|STRING",
        default=None,
        help="Jinja chat template (a file, or the template itself) for a tokenizer without one, "
        "or to replace its own",
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--log-level", default="warning", help=f"{', '.join(LOG_LEVELS)} (default: warning)"
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engine`` and ``--vllm-args`` (docs/serving.md, "vLLM")."""
    parser.add_argument(
        "--engine",
        default="transformers",
        help="transformers (default: transformers serve in this process) or vllm (vLLM's "
        "OpenAI server with diffattn's model plugin; needs vLLM installed, docs/serving.md)",
    )
    parser.add_argument(
        "--vllm-args",
        metavar="ARGS",
        default=None,
        help="more options for vLLM's server, as one string after an equals sign "
        "(--vllm-args='--enforce-eager --max-num-seqs 64'); --engine vllm only",
    )


def run(args: argparse.Namespace) -> int:
    """Check the options, load the model, serve until SIGINT/SIGTERM. Returns the exit code."""
    from diffattn.serve.hf_serving import require_serving
    from diffattn.serve.options import CB_SIZE_OPTIONS, parse_options

    options = parse_options(
        args.model,
        name=args.name,
        base=args.base,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        continuous_batching=args.continuous_batching,
        cb_sizes={key: getattr(args, f"cb_{key}") for key in CB_SIZE_OPTIONS},
        compile=args.compile,
        chat_template=args.chat_template,
        log_level=args.log_level,
        engine=args.engine,
        vllm_args=args.vllm_args,
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
