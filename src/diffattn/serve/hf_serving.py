"""Everything ``diffattn serve`` uses of transformers' serving internals, in one place.

``transformers serve`` is a FastAPI app (``transformers.cli.serving``) whose handlers take their
model from a ``ModelManager``. That manager finds a checkpoint's class as
``getattr(transformers, config.architectures[0])``, which no class outside transformers can
satisfy. diffattn plugs in at the manager's two loading hooks instead:
:class:`DiffAttnModelManager` overrides ``_load_processor`` and ``_load_model`` to load through
:class:`~diffattn.serve.model.ServedModelLoader`; the app, its routes, the handlers, streaming,
the generation thread and continuous batching are transformers' own, built as
``transformers serve`` builds them. Nothing of transformers is patched.

What differs between releases (checked against the published wheels):

==============  ================================================================================
release         ``transformers.cli.serving``
==============  ================================================================================
5.0 – 5.4       absent: ``transformers serve`` is the single module ``transformers/cli/serve.py``
                with no loader hook; not supported
5.5 – 5.9       present, without ``completion.py`` (no ``/v1/completions``): not supported
5.10 – 5.19     ``build_server`` takes no ``systemone_handler``; ``_load_processor(model_id)``
                and ``_load_model(model_id, tqdm_class, progress_callback)`` take no
                ``gguf_file``
5.20 –          ``build_server(..., systemone_handler=...)``; both loading hooks take
                ``gguf_file``
before 5.24     ``/v1/models`` lists the Hugging Face cache's models (``get_gen_models``), not
                the pinned one, and answers 500 where there is no cache:
                :class:`DiffAttnModelManager` lists the served model there, as 5.24's
                ``list_models`` does
==============  ================================================================================

The handlers ``build_server`` asks for are built from its signature
(:data:`HANDLER_FACTORIES`), and the loading hooks accept ``gguf_file`` optionally, so the code
is written for every listed release from 5.10 on; it was tested on 5.23.0
(:data:`MINIMUM_TRANSFORMERS`, the lower bound of the ``serve`` extra) and 5.24.0.
``tests/test_serve_hf.py`` checks each name used here against the installed release and fails
when one changes.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

MINIMUM_TRANSFORMERS = "5.23.0"
"""The lowest transformers release ``diffattn serve`` was tested with (``diffattn[serve]``)."""
SERVE_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic")
INSTALL_HINT = "pip install 'diffattn[serve]'"


def missing_packages() -> list[str]:
    """The packages of the ``serve`` extra that are not installed (transformers included)."""
    names = ["transformers", *SERVE_PACKAGES]
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    has_serving = "transformers" not in missing and importlib.util.find_spec(
        "transformers.cli.serving"
    )
    if "transformers" not in missing and not has_serving:
        missing.append(f"transformers>={MINIMUM_TRANSFORMERS} (with transformers.cli.serving)")
    return missing


def require_serving() -> None:
    """An ``ImportError`` naming the ``serve`` extra when something it installs is missing."""
    missing = missing_packages()
    if missing:
        raise ImportError(f"diffattn serve needs {', '.join(missing)}: {INSTALL_HINT}")


def _serving():
    from transformers.cli.serving import model_manager, server, utils

    return model_manager, server, utils


def manager_class() -> type:
    """:class:`DiffAttnModelManager`, defined on first use (it subclasses transformers'
    ``ModelManager``, which needs the ``serve`` extra to import)."""
    global _MANAGER_CLASS
    if _MANAGER_CLASS is None:
        _MANAGER_CLASS = _define_manager_class()
    return _MANAGER_CLASS


_MANAGER_CLASS: type | None = None


def _define_manager_class() -> type:
    model_manager, _, _ = _serving()

    class DiffAttnModelManager(model_manager.ModelManager):
        """transformers' ``ModelManager`` pinned to one model that ``loader`` loads.

        Everything else (caching, the per-model lock, unloading on ``/reset``, ``/v1/models``)
        is the base class's. ``device``/``dtype`` are given to the base class for its records
        only: the loader places the model.
        """

        def __init__(self, loader: Any, name: str) -> None:
            self._loader = loader
            self._served_name = name
            super().__init__(device=loader.options.device, force_model=name)

        def process_model_name(self, model_id: str) -> str:
            # The served name is not a hub id: keep it as given (no "@main" revision).
            return model_id

        def _check_name(self, model_id: str) -> None:
            if model_id != self._served_name:
                raise ValueError(f"this server serves {self._served_name!r}, not {model_id!r}")

        def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
            self._check_name(model_id_and_revision)
            return self._loader.load_tokenizer()

        def _load_model(
            self,
            model_id_and_revision: str,
            tqdm_class: type | None = None,
            progress_callback: Callable | None = None,
            gguf_file: str | None = None,
        ):
            self._check_name(model_id_and_revision)
            return self._loader.load_model()

        if not hasattr(model_manager.ModelManager, "list_models"):  # before 5.24

            def get_gen_models(self, cache_dir: str | None = None) -> list[dict]:
                # /v1/models of a server pinned to one model lists that model, as 5.24 does.
                loaded = self._served_name in self.loaded_models
                return [
                    {
                        "id": self._served_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "local",
                        "status": {"value": "loaded" if loaded else "unloaded"},
                    }
                ]

    return DiffAttnModelManager


def _chat_handler(manager: Any, state: Any, **kwargs: Any) -> Any:
    from transformers.cli.serving.chat_completion import ChatCompletionHandler

    return ChatCompletionHandler(model_manager=manager, generation_state=state, **kwargs)


def _completion_handler(manager: Any, state: Any, **kwargs: Any) -> Any:
    from transformers.cli.serving.completion import CompletionHandler

    return CompletionHandler(model_manager=manager, generation_state=state)


def _response_handler(manager: Any, state: Any, **kwargs: Any) -> Any:
    from transformers.cli.serving.response import ResponseHandler

    return ResponseHandler(model_manager=manager, generation_state=state, **kwargs)


def _transcription_handler(manager: Any, state: Any, **kwargs: Any) -> Any:
    from transformers.cli.serving.transcription import TranscriptionHandler

    return TranscriptionHandler(manager, state)


def _systemone_handler(manager: Any, state: Any, **kwargs: Any) -> Any:
    from transformers.cli.serving.systemone import SystemOneHandler

    return SystemOneHandler(model_manager=manager, generation_state=state, **kwargs)


HANDLER_FACTORIES: dict[str, Callable[..., Any]] = {
    "chat_handler": _chat_handler,
    "completion_handler": _completion_handler,
    "response_handler": _response_handler,
    "transcription_handler": _transcription_handler,
    "systemone_handler": _systemone_handler,
}
"""``build_server``'s handler parameters and how each handler is built (as ``transformers
serve`` builds it; the chat-like ones get ``chat_template_kwargs``)."""


def continuous_batching_config(sizes: dict[str, int | float]) -> Any:
    """transformers' ``ContinuousBatchingConfig`` with the ``--cb-*`` sizes that were set
    (``None`` when none was: transformers' defaults)."""
    if not sizes:
        return None
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(**sizes)


def supports_continuous_batching(model: Any) -> bool:
    """Whether ``model``'s ``forward`` takes the paged-attention arguments that transformers'
    continuous batching passes (``cu_seq_lens_q`` ...), by name or through ``**kwargs``."""
    if not hasattr(model, "init_continuous_batching"):
        return False
    parameters = inspect.signature(model.forward).parameters
    return "cu_seq_lens_q" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def build_serving(
    loader: Any, name: str, continuous_batching: bool, compile: bool, cb_sizes: dict
) -> tuple[Any, Any, Any]:
    """transformers' serving app for the one model of ``loader``, served as ``name``.

    Returns ``(app, model_manager, generation_state)``. The model is loaded here: a load error
    is raised before anything listens.
    """
    require_serving()
    _, server, utils = _serving()
    manager = manager_class()(loader, name)
    state = utils.GenerationState(
        continuous_batching=continuous_batching,
        compile=compile,
        cb_config=continuous_batching_config(cb_sizes),
    )
    wanted = inspect.signature(server.build_server).parameters
    unknown = [p for p in wanted if p.endswith("_handler") and p not in HANDLER_FACTORIES]
    if unknown:
        raise RuntimeError(
            f"this transformers release's build_server asks for {unknown}, which diffattn "
            f"serve does not know; supported: transformers>={MINIMUM_TRANSFORMERS} "
            "(see diffattn.serve.hf_serving)"
        )
    handlers = {
        parameter: factory(manager, state, chat_template_kwargs={})
        for parameter, factory in HANDLER_FACTORIES.items()
        if parameter in wanted
    }
    app = server.build_server(manager, generation_state=state, **handlers)
    return app, manager, state


def served(manager: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the manager's one model (loading it again after an unload)."""
    return manager.load_model_and_processor(manager.force_model)


def default_max_new_tokens(model: Any) -> int | None:
    """How many tokens the handlers generate when a request gives no limit: what their own
    ``_build_generation_config`` makes of the model's generation config."""
    from transformers.cli.serving.utils import BaseHandler

    config = BaseHandler._build_generation_config(
        _BareHandler(), {}, model.generation_config, use_cb=False
    )
    return config.max_new_tokens


class _BareHandler:
    """What ``BaseHandler._build_generation_config`` reads of its handler."""

    class generation_state:  # the attribute name the handler reads
        _compile = False


def chat_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as the chat handler gives them to the chat template (text parts
    joined), so a prompt is measured as it will be generated from."""
    from transformers.cli.serving.utils import BaseHandler, Modality

    return BaseHandler.get_processor_inputs_from_messages(messages, Modality.LLM)


def responses_messages(body: dict) -> list[dict]:
    """The chat messages a ``/v1/responses`` body stands for, as its handler builds them."""
    from transformers.cli.serving.response import ResponseHandler

    return chat_messages(ResponseHandler._normalize_input(body))
