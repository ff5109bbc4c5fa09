"""The one place where httpx's exceptions become failure reasons, and the message of a
non-2xx answer.

``to_fetch_error`` maps what a fetch can raise (httpx's exceptions, which the transport
builds in ``transport_errors``; the fetch's own deadline; a request that cannot be built)
to a ``FetchError`` whose ``reason`` is a failure reason of docs/schema.md:

- ``timeout``: the overall deadline, or httpx's connect/read timeouts;
- ``unreachable``: refused, DNS, TLS (said first in the detail), reset, and every
  protocol failure (a malformed answer: the engine is not serving HTTP we can trust);
- ``parse``: a body httpx cannot decode;
- ``config``: a request that cannot be built (a URL or header the client refuses; the
  exception text may quote a header, so it is not repeated).

llama-server without ``--metrics`` answers 501 with a JSON error whose message says what
to do; a proxy answers 502 with a line of text. ``status_error`` reads a bounded head of
the body (never inflating a compressed one) and keeps one printable line of it for the
failure's ``detail`` and for ``poller check``.
"""

from __future__ import annotations

import json
import ssl

import httpx

from poller.errors import FetchError

__all__ = ["describe", "status_error", "to_fetch_error", "unreachable_detail"]

#: What ``to_fetch_error`` maps; anything else is a bug and propagates.
MAPPED = (TimeoutError, httpx.HTTPError, httpx.InvalidURL, UnicodeError, ValueError)


def to_fetch_error(exc: BaseException, endpoint_id: str, timeout_s: float) -> FetchError:
    """The failure a fetch's exception stands for (one of ``MAPPED``)."""
    if isinstance(exc, httpx.TimeoutException):
        return FetchError(
            "timeout", f"{type(exc).__name__} after {timeout_s:g}s", endpoint=endpoint_id
        )
    if isinstance(exc, TimeoutError):
        return FetchError(
            "timeout", f"no complete response within {timeout_s:g}s", endpoint=endpoint_id
        )
    if isinstance(exc, httpx.DecodingError):
        return FetchError("parse", f"cannot decode body: {exc}", endpoint=endpoint_id)
    if isinstance(exc, httpx.TransportError):
        return FetchError("unreachable", unreachable_detail(exc), endpoint=endpoint_id)
    return FetchError(
        "config",
        f"cannot build the request ({type(exc).__name__}): check the URL",
        endpoint=endpoint_id,
    )


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
    except httpx.HTTPError:
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


def unreachable_detail(exc: BaseException) -> str:
    """The detail of an ``unreachable`` failure; TLS problems say so first."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            why = cause.verify_message or cause.reason or str(cause)
            return (
                f"TLS certificate verification failed: {why} (tls_ca_file names the CA "
                "bundle to verify it with)"
            )[:300]
        if isinstance(cause, ssl.SSLError):
            return f"TLS handshake failed: {cause.reason or cause}"[:300]
        cause = cause.__cause__ or cause.__context__
    return describe(exc)


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
