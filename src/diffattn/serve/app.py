"""``diffattn serve``: transformers' OpenAI-compatible server for one model diffattn loads.

:func:`build_app` loads the model, builds transformers' serving app around it
(:mod:`diffattn.serve.hf_serving`) and puts :class:`~diffattn.serve.validation.RequestValidator`
in front of its generation endpoints; :func:`serve` runs it under uvicorn until SIGINT or
SIGTERM, then stops the generation workers and returns.
"""

from __future__ import annotations

import copy
import signal
import sys
from typing import Any

from diffattn.serve import hf_serving
from diffattn.serve.model import CHAT_TEMPLATE_HINT, ServedModelLoader, context_length
from diffattn.serve.options import ServeOptions
from diffattn.serve.validation import RESPONSES, RequestValidator, ServedModelFacts

GRACEFUL_SHUTDOWN_SECONDS = 5
"""How long a stopping server lets open requests finish before closing them."""


def _chat_ids_length(result: Any) -> int:
    ids = result["input_ids"] if hasattr(result, "keys") else result
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return len(ids)


def model_facts(name: str, model: Any, tokenizer: Any) -> ServedModelFacts:
    """What the request checks need of the served model. They count tokens with their own
    copy of the tokenizer, so they never share it with the generation thread."""
    counter = copy.deepcopy(tokenizer)

    def count_text(text: str) -> int:
        return len(counter(text)["input_ids"])

    def count_chat(messages: list, tools: Any) -> int:
        result = counter.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
        return _chat_ids_length(result)

    def to_chat_messages(path: str, body: dict) -> list:
        if path == RESPONSES:
            return hf_serving.responses_messages(body)
        return hf_serving.chat_messages(body["messages"])

    return ServedModelFacts(
        name=name,
        context=context_length(model),
        default_max_tokens=hf_serving.default_max_new_tokens(model),
        count_text=count_text,
        count_chat=count_chat if getattr(tokenizer, "chat_template", None) else None,
        chat_hint=CHAT_TEMPLATE_HINT,
        to_chat_messages=to_chat_messages,
    )


def build_app(options: ServeOptions) -> tuple[Any, Any, Any]:
    """Load the model and build the app: ``(app, model_manager, generation_state)``.

    Load errors (a path that is not a model, a missing tokenizer, ``--backend`` on a model that
    has none, ``--continuous-batching`` on a model that cannot run it) are ``ValueError``s
    raised before anything listens.
    """
    hf_serving.require_serving()
    loader = ServedModelLoader(options)
    app, manager, state = hf_serving.build_serving(
        loader,
        options.name,
        continuous_batching=options.continuous_batching,
        compile=options.compile,
        cb_sizes=options.cb_sizes,
    )
    model, tokenizer = hf_serving.served(manager)
    if options.continuous_batching and not hf_serving.supports_continuous_batching(model):
        manager.shutdown()
        raise ValueError(
            f"--continuous-batching: {type(model).__name__}.forward does not take the paged "
            "attention arguments (cu_seq_lens_q, ...) that continuous batching passes"
        )
    app.add_middleware(RequestValidator, facts=model_facts(options.name, model, tokenizer))
    return app, manager, state


def start_message(options: ServeOptions, model: Any, tokenizer: Any) -> list[str]:
    """The lines printed when the server is about to listen."""
    lines = [
        f"diffattn serve: {options.name} ({type(model).__name__}, {model.dtype}, "
        f"{model.device}) on http://{options.host}:{options.port}/v1"
    ]
    if options.continuous_batching:
        sizes = ", ".join(f"{k}={v}" for k, v in options.cb_sizes.items()) or "transformers'"
        lines.append(f"diffattn serve: continuous batching, sizes: {sizes}")
    if not options.is_loopback:
        lines.append(
            f"diffattn serve: listening on {options.host}, as asked with --host: reachable "
            "from other machines, with no authentication"
        )
    if not getattr(tokenizer, "chat_template", None):
        lines.append(
            "diffattn serve: the tokenizer has no chat template; /v1/chat/completions and "
            "/v1/responses answer 400 until one is set with --chat-template FILE|STRING"
        )
    return lines


def serve(options: ServeOptions) -> int:
    """Run the server until SIGINT/SIGTERM; returns 0 after a clean shutdown (open requests get
    :data:`GRACEFUL_SHUTDOWN_SECONDS` to finish)."""
    import uvicorn

    app, manager, state = build_app(options)
    model, tokenizer = hf_serving.served(manager)
    for line in start_message(options, model, tokenizer):
        print(line, file=sys.stderr, flush=True)
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    server = uvicorn.Server(config)
    stopped_by: list[int] = []
    # uvicorn handles SIGINT/SIGTERM while it serves, then restores the handlers it found and
    # raises the signal again; these handlers receive it, so a stop asked for exits with 0.
    previous = {
        number: signal.signal(number, lambda received, _frame: stopped_by.append(received))
        for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        server.run()
    except SystemExit as error:  # uvicorn exits with 1 when it cannot listen
        if server.started:
            raise
        raise ValueError(
            f"--host {options.host} --port {options.port}: cannot listen there (see above)"
        ) from error
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        state.shutdown()
        manager.shutdown()
    return 0
