"""The one place where socket, TLS and llhttp errors become httpx's exceptions.

The transport (``wire.py``, ``h1.py``) raises only what httpx's own transports raise, so
everything above it (``errors.to_fetch_error``) sees one family:

- ``ConnectError``: refused, unresolvable, TLS verification (the ``OSError`` or
  ``ssl.SSLError`` is its ``__cause__``); ``ConnectTimeout``;
- ``ReadTimeout``: no complete answer within the request's read timeout;
- ``ReadError``: the connection reset during the answer;
- ``RemoteProtocolError``: anything that is not HTTP/1.1 framing we can trust (llhttp's
  verdict, a cap on the head, an upgrade, a body cut short);
- ``UnsupportedProtocol``: a request this transport does not send (not GET, a body,
  another scheme).
"""

from __future__ import annotations

import httptools
import httpx

__all__ = [
    "Stale",
    "connect_error",
    "connect_timeout",
    "lost",
    "parser_error",
    "protocol",
    "read_timeout",
    "unsupported",
]


class Stale(Exception):
    """The connection closed before any byte of the answer (a reused one may be retried)."""


def protocol(message: str) -> httpx.RemoteProtocolError:
    return httpx.RemoteProtocolError(message)


def parser_error(exc: httptools.HttpParserError) -> httpx.RemoteProtocolError:
    """llhttp's reason ("Invalid header value char", "Content-Length overflow", ...)."""
    reason = str(exc) or type(exc).__name__
    return httpx.RemoteProtocolError(f"malformed HTTP answer: {reason[:200]}")


def lost(exc: Exception | None, got_bytes: bool, head_done: bool) -> Exception:
    """The connection ended before the answer did."""
    if not got_bytes:
        return Stale()
    if exc is not None:
        return httpx.ReadError(f"connection lost: {exc}")
    what = "body" if head_done else "headers"
    return httpx.RemoteProtocolError(f"server closed the connection in the middle of the {what}")


def read_timeout(timeout_s: float) -> httpx.ReadTimeout:
    return httpx.ReadTimeout(f"no complete response within {timeout_s:g}s")


def connect_timeout(timeout_s: float) -> httpx.ConnectTimeout:
    return httpx.ConnectTimeout(f"no connection within {timeout_s:g}s")


def connect_error(exc: OSError) -> httpx.ConnectError:
    """Refused, unreachable, DNS, ``ssl.SSLError``: the caller keeps ``exc`` as the cause."""
    return httpx.ConnectError(str(exc) or type(exc).__name__)


def unsupported(message: str) -> httpx.UnsupportedProtocol:
    return httpx.UnsupportedProtocol(message)
