"""What a pick needs from an OpenAI request body: the model and the prompt.

``read_body`` takes the whole body (the EPP buffers it, whatever Envoy's body mode) and
returns the ``model`` and the text the engine will prefill, for prefix affinity: the
chat ``messages`` rendered by ``prompt_of`` (as the library's gateways do), else a
completion's ``prompt`` (a string, or the first of a list). A body that is not a JSON
object, or names no model, is a ``BadRequest`` (a 400 for the client).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from poller.reader import prompt_of

__all__ = ["BadRequest", "Request", "read_body"]


class BadRequest(Exception):
    """The body cannot be routed; ``str(exc)`` says why, for the client's 400."""


class Request(NamedTuple):
    model: str
    prompt: str | None
    stream: bool


def read_body(body: bytes) -> Request:
    try:
        parsed: Any = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the request body is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise BadRequest(f"the request body is a JSON {type(parsed).__name__}, not an object")
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest('the request body names no model (a non-empty string "model")')
    return Request(model, _prompt(parsed), parsed.get("stream") is True)


def _prompt(parsed: dict[str, Any]) -> str | None:
    messages = parsed.get("messages")
    if messages is not None:
        try:
            return prompt_of(messages)
        except TypeError:
            return None  # the engine will say what is wrong with them; route on load alone
    prompt = parsed.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None
