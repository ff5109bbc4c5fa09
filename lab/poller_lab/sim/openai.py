"""The OpenAI-compatible request path of a simulated engine, and vLLM's sleep endpoints.

    POST /v1/chat/completions   {"model", "messages", "max_tokens"?, "stream"?}
    POST /v1/completions        {"model", "prompt", "max_tokens"?, "stream"?}
    GET  /v1/models             the models the endpoint serves, in its engine's shape
    GET  /version               (vLLM) the server's version, as vLLM answers it
    POST /sleep?level=1|2       (vLLM) stop serving; POST /wake_up; GET /is_sleeping

A request names a model ``/v1/models`` lists (llama.cpp and TGI also take one naming
none, as their servers do); another name is a 404 on every engine, stricter than
llama-server and TGI (which ignore it), so that a misconfigured gateway shows. A
request holds a running slot for its prefill and ``max_tokens / speed_tps`` seconds of
decode (``ServeQueue``)
and always generates ``max_tokens`` tokens (``finish_reason: "length"``). Errors use the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}``, as vLLM writes them:
400 bad input, 404 a model the endpoint does not serve, 503 while asleep (vLLM answers
its protected routes so in sleep mode). The endpoint's fault applies too: ``down`` and
``refuse`` drop the connection, ``hang`` never answers, ``http500`` and ``garbage``
answer 500, ``http401`` 401, ``slow`` delays; the others only touch the metrics page.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from poller_lab.sim.endpoint import JSON, SimEndpoint

__all__ = [
    "COMPLETION_PATHS",
    "SLEEP_PATHS",
    "BadRequest",
    "chat_text",
    "error",
    "models_reply",
    "parse_request",
    "reply",
    "version_reply",
]

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
SLEEP_PATHS = ("/sleep", "/wake_up", "/is_sleeping")
#: OpenAI's default for /v1/completions; chat uses it too here (no model length to fill).
DEFAULT_MAX_TOKENS = 16
_MAX_TOKENS_LIMIT = 1_000_000
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}
_TYPES |= {500: "InternalServerError", 503: "ServiceUnavailableError"}
_WORDS = ("the", "engine", "says", "hello", "to", "a", "simulated", "gateway")
#: What the simulated vLLM says it is on ``/version``: the release its page follows
#: (pages_vllm.py).
VLLM_VERSION = "0.33.0"
#: ``max_model_len`` a vLLM ``/v1/models`` entry carries: Llama-3.1-8B's context.
MAX_MODEL_LEN = 131072


class BadRequest(Exception):
    """Input the endpoint refuses: the status, message and parameter of the error."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error(status: int, message: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": _TYPES[status], "param": param, "code": status}}
    return web.json_response(body, status=status)


def parse_request(ep: SimEndpoint, path: str, raw: bytes) -> tuple[str, str, int, bool]:
    """(model, prompt text, max_tokens, stream) of a valid request; BadRequest if not."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is None and ep.engine.model_optional:
        model = ep.models[0]  # llama-server and TGI serve their one model unasked
    if not isinstance(model, str) or not model:
        raise BadRequest(400, "model is required (a string)", "model")
    if model not in ep.models:
        raise BadRequest(404, f"The model `{model}` does not exist.", "model")
    chat = path == "/v1/chat/completions"
    prompt = chat_text(body) if chat else _prompt_text(body)
    max_tokens = body.get("max_completion_tokens" if chat else "max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise BadRequest(400, "max_tokens must be an integer", "max_tokens")
    if not 1 <= max_tokens <= _MAX_TOKENS_LIMIT:
        raise BadRequest(400, f"max_tokens must be 1 to {_MAX_TOKENS_LIMIT}", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "stream must be true or false", "stream")
    return model, prompt, max_tokens, stream


def chat_text(body: dict[str, Any]) -> str:
    """The prompt of a chat request: each message as ``role: content`` and a newline, in
    order (so a conversation's next turn extends its last prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "messages must be a non-empty list", "messages")
    parts = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(400, "each message needs a role", "messages")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise BadRequest(400, "message content must be a string or parts", "messages")
        parts.append(f"{message['role']}: {content}\n")
    return "".join(parts)


def _prompt_text(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    if not isinstance(prompt, str):
        raise BadRequest(400, "prompt must be a string or a list of strings", "prompt")
    return prompt


def _text(max_tokens: int) -> str:
    # One word per token, capped: the usage figures carry the length, not the body.
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(min(max_tokens, 64)))


class _Answer:
    """The response shapes of one request (ids, timestamps, the chunks of a stream)."""

    def __init__(self, path: str, model: str, prompt_tokens: int, max_tokens: int) -> None:
        self.chat = path == "/v1/chat/completions"
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
        }
        self.text = _text(max_tokens)

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            kind = "chat.completion.chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text},
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": "length"}
        return {**self._envelope(False), "choices": [choice], "usage": self.usage}

    def chunk(self, text: str, finish: str | None, *, role: bool = False) -> bytes:
        """One SSE event (``role``: the chat stream's first chunk, naming the speaker)."""
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if role:
                delta = {"role": "assistant", "content": ""}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        data = {**self._envelope(True), "choices": [choice]}
        if finish is not None:
            data["usage"] = self.usage
        return b"data: " + json.dumps(data).encode() + b"\n\n"


def reply(
    path: str, model: str, prompt_tokens: int, max_tokens: int
) -> tuple[dict[str, Any], list[bytes], list[bytes]]:
    """(whole body, stream chunks at the first token (the end of the prefill): chat's
    role chunk and the first word, chunks when the request ends: the rest)."""
    answer = _Answer(path, model, prompt_tokens, max_tokens)
    head, space, rest = answer.text.partition(" ")
    first = [answer.chunk("", None, role=True)] if answer.chat else []
    first.append(answer.chunk(head, None))
    last = [answer.chunk(space + rest, None)] if rest else []
    last += [answer.chunk("", "length"), b"data: [DONE]\n\n"]
    return answer.whole(), first, last


def models_reply(ep: SimEndpoint) -> dict[str, Any]:
    """``GET /v1/models`` as the endpoint's engine answers it: the served model (and its
    LoRA adapters), ``owned_by`` the engine (TGI: the model id); llama-server also lists
    them under ``models``, Ollama's shape."""
    created = 0 if ep.engine.owned_by is None else int(time.time())
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": ep.engine.owned_by or m}
        for m in ep.models
    ]
    if ep.engine.owned_by == "vllm":
        # vLLM's model cards also name the model's root, its base (adapters) and its
        # context length (vllm/entrypoints/openai/protocol.py ``ModelCard``); routers
        # read them when they register an engine.
        base = ep.models[0]
        for card in data:
            adapter = card["id"] != base
            card.update(root=card["id"], parent=base if adapter else None)
            card.update(max_model_len=MAX_MODEL_LEN, permission=[])
    body: dict[str, Any] = {"object": "list", "data": data}
    if ep.engine.name == "llamacpp":
        body["models"] = [{"name": m, "model": m} for m in ep.models]
    return body


def version_reply() -> web.Response:
    """vLLM's ``GET /version`` (vllm/entrypoints/openai/api_server.py): routers probe it
    to tell a vLLM from another engine."""
    return web.json_response({"version": VLLM_VERSION})


def sleep_reply(ep: SimEndpoint, path: str, query: dict[str, str]) -> web.Response:
    """vLLM's ``/sleep``, ``/wake_up`` and ``/is_sleeping`` on one endpoint."""
    if path == "/is_sleeping":
        return web.json_response({"is_sleeping": ep.sleep_level > 0})
    if path == "/wake_up":
        ep.sleep_level = 0
    else:
        level = query.get("level", "1")
        if level not in ("1", "2"):
            return error(400, "level must be 1 or 2", "level")
        ep.sleep_level = int(level)
    return web.Response(status=200, headers={"Content-Type": JSON}, body=b"")
