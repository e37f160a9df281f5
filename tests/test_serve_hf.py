"""What ``diffattn serve`` relies on in transformers' serving code
(:mod:`diffattn.serve.hf_serving`), checked against the installed release: each test fails
when a release changes the name, signature or behaviour it uses."""

from __future__ import annotations

import inspect

import pytest
import torch

from extras import require_extra
from serve_helpers import save_tiny_model, word_tokenizer

pytestmark = require_extra("hf", "serve")


def served_model(model_dir):
    """The model as ``diffattn serve`` loads it (on the CPU)."""
    from diffattn.serve.model import ServedModelLoader
    from diffattn.serve.options import parse_options

    return ServedModelLoader(parse_options(str(model_dir), device="cpu")).load_model()


def test_transformers_serve_alone_cannot_find_the_diffattn_class():
    """Why the loader hooks exist: ``ModelManager._load_model`` looks the class up on the
    transformers module, where no outside class is."""
    import transformers
    from transformers.cli.serving import model_manager

    import diffattn.hf  # noqa: F401 (registers with the Auto classes)

    assert "getattr(transformers, config.architectures[0])" in inspect.getsource(
        model_manager.ModelManager._load_model
    )
    assert not hasattr(transformers, "DiffAttnForCausalLM")


def test_the_loading_hooks_take_what_the_manager_passes():
    from transformers.cli.serving.model_manager import ModelManager

    from diffattn.serve.hf_serving import manager_class

    ours = manager_class()
    for hook in ("_load_processor", "_load_model"):
        theirs = inspect.signature(getattr(ModelManager, hook)).parameters
        mine = inspect.signature(getattr(ours, hook)).parameters
        assert list(theirs) == list(mine)[: len(theirs)], hook
    calls = inspect.getsource(ModelManager.load_model_and_processor)
    assert "self._load_processor(" in calls and "self._load_model(" in calls
    assert "force_model" in inspect.signature(ModelManager).parameters


def test_build_server_asks_for_handlers_this_module_builds():
    from transformers.cli.serving.server import build_server

    from diffattn.serve.hf_serving import HANDLER_FACTORIES

    parameters = inspect.signature(build_server).parameters
    handlers = {name for name in parameters if name.endswith("_handler")}
    assert handlers <= set(HANDLER_FACTORIES)
    assert {"model_manager", "generation_state"} <= set(parameters)


def test_default_limit_is_the_handlers_own():
    from transformers import GenerationConfig
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.utils import GenerationState

    from diffattn.serve.hf_serving import default_max_new_tokens

    handler = CompletionHandler(model_manager=None, generation_state=GenerationState())
    for config in (GenerationConfig(), GenerationConfig(max_new_tokens=4096)):

        class Model:
            generation_config = config

        real = handler._build_generation_config({}, config).max_new_tokens
        assert default_max_new_tokens(Model()) == real


def test_chat_messages_are_joined_as_the_chat_handler_joins_them():
    from diffattn.serve.hf_serving import chat_messages, responses_messages

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "a b"}
    ]
    assert responses_messages({"input": "hi", "instructions": "be brief"}) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


@pytest.mark.parametrize("kind", ["diff_v1", "llama"])
def test_served_models_take_continuous_batching(kind, tmp_path):
    from diffattn.serve.hf_serving import supports_continuous_batching

    model_dir = save_tiny_model(kind, tmp_path / kind)
    model = served_model(model_dir)
    assert supports_continuous_batching(model)


def test_generate_with_the_tokenizer_as_serve_passes_it(tmp_path):
    """transformers' server calls ``generate(..., tokenizer=...)``; the diffattn adapter keeps
    that argument out of ``forward`` (before, a ``TypeError`` naming it)."""
    model_dir = save_tiny_model("diff_v2", tmp_path / "m")
    model = served_model(model_dir)
    tokenizer = word_tokenizer()
    ids = torch.tensor([tokenizer("w1 w2 w3")["input_ids"]])
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    told = model.generate(ids, max_new_tokens=8, do_sample=False, tokenizer=tokenizer)
    assert torch.equal(plain, told)


def test_eos_of_a_diffattn_directory_comes_from_its_tokenizer(tmp_path):
    model_dir = save_tiny_model("baseline", tmp_path / "m")
    model = served_model(model_dir)
    assert model.generation_config.eos_token_id == word_tokenizer().eos_token_id == 0


def test_backend_is_refused_for_a_hugging_face_directory(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path / "m")
    from diffattn.serve.model import ServedModelLoader
    from diffattn.serve.options import parse_options

    with pytest.raises(ValueError, match="diffattn model directories only"):
        ServedModelLoader(parse_options(str(model_dir), device="cpu", backend="sdpa"))
