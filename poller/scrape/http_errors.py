"""The message of a non-2xx answer: its status and the first line of its body.

llama-server without ``--metrics`` answers 501 with a JSON error whose message says what
to do; a proxy answers 502 with a line of text. ``status_error`` reads a bounded head of
the body (never inflating a compressed one) and keeps one printable line of it for the
failure's ``detail`` and for ``poller check``.
"""

from __future__ import annotations

import json

import aiohttp
import httpx

from poller.errors import FetchError

__all__ = ["status_error"]

#: How much of a non-2xx body is read for its message (engines answer with a line or a
#: small JSON object; a proxy's HTML error page is cut here).
_ERROR_BODY_BYTES = 4096
_ERROR_LINE_CHARS = 200


async def status_error(endpoint_id: str, response: httpx.Response) -> FetchError:
    """A non-2xx answer as a FetchError carrying the status and the body's first line
    (llama-server without --metrics: 501 "This server does not support metrics ...")."""
    status = response.status_code
    # A redirect's body is boilerplate ("302: Found"); its Location is what matters.
    body = await _error_line(response) if status >= 400 else ""
    suffix = f": {body}" if body else ""
    if status in (401, 403):
        reason, detail = "auth", f"HTTP {status} (check the API key){suffix}"
    else:
        reason, detail = "http_status", f"HTTP {status}{suffix}"
    return FetchError(reason, detail, endpoint=endpoint_id, status=status, body=body)


async def _error_line(response: httpx.Response) -> str:
    """The message of an error body: a JSON error's ``message``, else its first
    non-blank line; printable, at most 200 characters; "" if compressed or unreadable."""
    if response.headers.get("content-encoding", "identity").lower() not in ("", "identity"):
        return ""  # never inflate an error body: it has no cap of its own
    head = b""
    try:
        if response.is_stream_consumed:
            head = response.content
        else:
            async for raw in response.aiter_raw():
                head += raw
                if len(head) >= _ERROR_BODY_BYTES:
                    break
    except (httpx.HTTPError, aiohttp.ClientError, OSError):
        return ""
    text = head[:_ERROR_BODY_BYTES].decode("utf-8", "replace")
    message = _json_message(text) if text.lstrip().startswith("{") else None
    for line in (message or text).splitlines():
        line = "".join(c if c.isprintable() else " " for c in line).strip()
        if line:
            return line[:_ERROR_LINE_CHARS]
    return ""


def _json_message(text: str) -> str | None:
    """``{"error": {"message": ...}}`` (llama-server, OpenAI style), ``{"message"}``,
    ``{"detail"}`` (FastAPI) or ``{"error": "..."}``; None for anything else."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    for key in ("message", "detail", "error"):
        if isinstance(data.get(key), str):
            return str(data[key])
    return None
