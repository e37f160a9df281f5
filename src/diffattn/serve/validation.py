"""Request checks in front of transformers' handlers: a bad request gets a 4xx with a message.

transformers' handlers trust the shapes and values of a request: a wrong type, a negative
``max_tokens`` or a prompt longer than the model's context reach ``generate`` and come back as
a 500 (or, streaming, as an error inside a 200). :class:`RequestValidator` is an ASGI
middleware on their app that reads each generation request first and answers what it can
tell is wrong, in the OpenAI error shape
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``:

* a body that is not a JSON object (400) or larger than :data:`MAX_BODY_BYTES` (413);
* a model other than the served one (404, ``model_not_found``);
* a field of the wrong type or out of range: ``stream``, ``temperature`` (0 to 2), ``top_p``
  (0 to 1), ``seed``, ``stop``, ``n`` (only 1), ``frequency_penalty``, the token limits
  (at least 1, at most the context), ``messages``, ``prompt``, ``input`` (400);
* a chat request when the tokenizer has no chat template (400, naming ``--chat-template``);
* a prompt that encodes to no tokens, or with its token limit does not fit the context (400).

A request that gives no token limit gets the handlers' default, cut to what is left of the
context after its prompt (the limit is then written into the body the handler reads).
Everything else passes through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_BODY_BYTES = 4 * 1024 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
LIMIT_FIELDS = {
    CHAT: ("max_completion_tokens", "max_tokens"),
    COMPLETIONS: ("max_tokens",),
    RESPONSES: ("max_output_tokens",),
}
"""The token-limit fields each endpoint reads, the one it prefers first."""
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, a message, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.code,
        }
        return json.dumps({"error": error}).encode()


@dataclass
class ServedModelFacts:
    """What the checks need to know of the served model.

    ``count_chat`` and ``count_text`` give the prompt length in tokens of chat messages
    (through the chat template) and of plain text; ``count_chat`` is ``None`` when the
    tokenizer has no chat template, and ``chat_hint`` then says how to set one.
    """

    name: str
    context: int | None
    default_max_tokens: int | None
    count_text: Callable[[str], int]
    count_chat: Callable[[list, Any], int] | None
    chat_hint: str
    to_chat_messages: Callable[[str, dict], list]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> None:
    if key not in body or body[key] is None:
        return
    value = body[key]
    if not _is_number(value):
        raise RequestError(f"'{key}' must be a number, got {type(value).__name__}", key)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(f"'{key}' must be in {bracket}{low}, {high}], got {value}", key)


def check_common(body: dict, facts: ServedModelFacts) -> None:
    """The fields every generation endpoint reads."""
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise RequestError(f"'model' must be a string, got {type(model).__name__}", "model")
        if model != facts.name:
            raise RequestError(
                f"the model {model!r} does not exist here; this server serves {facts.name!r}",
                "model",
                status=404,
                code="model_not_found",
            )
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise RequestError("'stream' must be true or false", "stream")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0, low_open=True)
    _number(body, "frequency_penalty", -2.0, 2.0)
    if body.get("seed") is not None and not _is_int(body["seed"]):
        raise RequestError("'seed' must be an integer", "seed")
    if body.get("n") is not None and body["n"] != 1:
        raise RequestError("'n' must be 1: this server returns one choice per request", "n")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise RequestError("'stop' must be a string or a list of strings", "stop")


def check_messages(messages: Any) -> None:
    """Chat messages: a non-empty list of objects with a known role and text content."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages", "messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content'", where)
        if message.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(
                f"{where}.content must be a string or a list of parts", f"{where}.content"
            )
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(
                    f"{where}.content: each part must be an object with a 'type'",
                    f"{where}.content",
                )
            if part["type"] in ("text", "input_text") and not isinstance(part.get("text"), str):
                raise RequestError(
                    f"{where}.content: a text part needs a string 'text'", f"{where}.content"
                )


def _token_limit(body: dict, path: str, facts: ServedModelFacts) -> tuple[str, int | None]:
    """The limit field the handler will read and its value (``None`` when not given)."""
    fields = LIMIT_FIELDS[path]
    for key in fields:
        value = body.get(key)
        if value is None:
            continue
        if not _is_int(value):
            raise RequestError(f"'{key}' must be an integer, got {type(value).__name__}", key)
        if value < 1:
            raise RequestError(f"'{key}' must be at least 1, got {value}", key)
        if facts.context is not None and value > facts.context:
            raise RequestError(
                f"'{key}' is {value}, more than the model's context of {facts.context} tokens",
                key,
            )
        return key, value
    return fields[-1], None


def _prompt_tokens(body: dict, path: str, facts: ServedModelFacts) -> tuple[int, str]:
    """The prompt's length in tokens and the field it came from."""
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("'prompt' must be a string", "prompt")
        if body.get("suffix") is not None and not isinstance(body["suffix"], str):
            raise RequestError("'suffix' must be a string", "suffix")
        return facts.count_text(prompt), "prompt"
    if facts.count_chat is None:
        raise RequestError(f"the model's tokenizer has no chat template: {facts.chat_hint}")
    if path == CHAT:
        check_messages(body.get("messages"))
        field = "messages"
    else:
        field = "input"
        if not isinstance(body.get("input"), (str, list)):
            raise RequestError("'input' must be a string or a list of items", "input")
        if body.get("instructions") is not None and not isinstance(body["instructions"], str):
            raise RequestError("'instructions' must be a string", "instructions")
    try:
        messages = facts.to_chat_messages(path, body)
        return facts.count_chat(messages, body.get("tools")), field
    except RequestError:
        raise
    except Exception as error:  # the template or the message conversion refused them
        reason = " ".join(str(error).split()) or type(error).__name__
        message = f"the chat template cannot render these messages ({reason})"
        raise RequestError(message, field) from None


def check_request(path: str, body: Any, facts: ServedModelFacts) -> dict:
    """The body to pass on (with a token limit filled in where the default would overflow the
    context), or a :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    check_common(body, facts)
    key, limit = _token_limit(body, path, facts)
    tokens, field = _prompt_tokens(body, path, facts)
    if tokens == 0:
        raise RequestError(f"'{field}' encodes to no tokens; give a non-empty prompt", field)
    context = facts.context
    if context is None:
        return body
    if tokens >= context:
        raise RequestError(
            f"the prompt is {tokens} tokens; the model's context is {context} tokens, which "
            "leaves no room for a completion",
            field,
            code="context_length_exceeded",
        )
    if limit is not None and tokens + limit > context:
        raise RequestError(
            f"the prompt ({tokens} tokens) and '{key}' ({limit}) exceed the model's context "
            f"of {context} tokens; lower '{key}' to at most {context - tokens}",
            key,
            code="context_length_exceeded",
        )
    default = facts.default_max_tokens
    if limit is None and (default is None or tokens + default > context):
        body = {**body, key: context - tokens}
    return body


class RequestValidator:
    """ASGI middleware: runs :func:`check_request` on the POST requests of the generation
    endpoints and answers a refused one itself; passes everything else through."""

    def __init__(self, app: Any, facts: ServedModelFacts) -> None:
        self.app = app
        self.facts = facts

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in LIMIT_FIELDS:
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                error = RequestError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)
                await self._refuse(send, error)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise RequestError(f"the request body is not valid JSON ({error})") from None
            checked = check_request(path, body, self.facts)
        except RequestError as error:
            await self._refuse(send, error)
            return
        if checked is not body:
            raw = json.dumps(checked).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        scope = {**scope, "headers": headers}
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # later reads wait for the client's disconnect

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send: Callable, error: RequestError) -> None:
        body = error.body()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
