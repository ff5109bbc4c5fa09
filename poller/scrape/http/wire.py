"""An httpx transport of our own: HTTP/1.1 GETs on asyncio protocols, parsed by llhttp.

A scrape is one small request and one answer of tens of kilobytes, to a host the poller
talks to every second. httpx is the client API; under it, this transport does the
exchange with one ``asyncio.Protocol`` per connection (``h1.py``):

- the request's bytes are built once per prepared ``httpx.Request`` (kept in its
  extensions) and written in one call;
- the answer is parsed by llhttp as it arrives, without a task switch per piece, and the
  awaiting request is woken once, with the whole body (at most ``max_body_bytes`` + one
  read of it: past the cap the connection is dropped, and the caller sees a body over its
  cap, or a ``Content-Length`` over it, and reports ``too_large``);
- connections are kept alive per origin (scheme, host, port) and reused, and closed
  after ``KEEPALIVE_S`` idle; one found closed by the server before any byte of the
  answer came is replaced, once, by a new one.

Errors are httpx's, built in ``transport_errors`` (the one place that maps socket, TLS and
parser errors). Only ``GET`` without a request body is supported: that is all a scrape
sends.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import httpx

from poller.scrape.http import transport_errors as errors
from poller.scrape.http.h1 import Connection

__all__ = ["WireTransport"]

#: An idle connection older than this is closed: an endpoint
#: whose lease moved away must not keep a socket open on an engine that never hangs up.
KEEPALIVE_S = 15.0
_WIRE = "llmgw.wire"  # the request's bytes, cached in its extensions
_DEFAULT_PORTS = {"http": 80, "https": 443}
_BAD_VALUE_CHARS = frozenset("\r\n\x00")

Origin = tuple[str, str, int]


class WireTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 connections per origin; see the module docstring."""

    def __init__(self, *, max_body_bytes: int, ssl_context: ssl.SSLContext | None = None):
        self.max_body_bytes = max_body_bytes
        self.ssl_context = ssl_context
        self._idle: dict[Origin, list[Connection]] = {}
        self._closed = False
        self._next_sweep = 0.0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "GET":
            raise errors.unsupported(f"only GET is supported, not {request.method}")
        url = request.url
        if url.scheme not in _DEFAULT_PORTS:
            raise errors.unsupported(f"unsupported URL scheme {url.scheme!r}")
        wire = request.extensions.get(_WIRE)
        if wire is None:
            wire = request.extensions[_WIRE] = _request_bytes(request)
        origin = (url.scheme, url.host, url.port or _DEFAULT_PORTS[url.scheme])
        timeouts = request.extensions.get("timeout") or {}
        now = asyncio.get_running_loop().time()
        if now >= self._next_sweep:
            self._sweep(now)
        for _ in range(2):
            conn, reused = self._idle_connection(origin, now), True
            if conn is None:
                conn, reused = await self._connect(origin, timeouts.get("connect")), False
            try:
                reply = await conn.exchange(wire, timeouts.get("read"))
            except errors.Stale:
                if reused:
                    continue  # the server closed it while idle: once more, on a new one
                raise errors.protocol("server disconnected without sending a response") from None
            if conn.reusable and not self._closed:
                conn.idle_since = now
                self._idle.setdefault(origin, []).append(conn)
            else:
                conn.close()
            status, reason, headers, body = reply
            return httpx.Response(
                status,
                headers=headers,
                stream=_Body(body),
                request=request,
                extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
            )
        raise errors.protocol("server disconnected without sending a response")

    def _idle_connection(self, origin: Origin, now: float) -> Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.reusable and now - conn.idle_since <= KEEPALIVE_S:
                return conn
            conn.abort()
        return None

    def _sweep(self, now: float) -> None:
        """Close idle connections past KEEPALIVE_S, forget origins left with none."""
        self._next_sweep = now + KEEPALIVE_S
        for origin, conns in list(self._idle.items()):
            keep = [c for c in conns if c.reusable and now - c.idle_since <= KEEPALIVE_S]
            for conn in conns:
                if conn not in keep:
                    conn.abort()
            if keep:
                self._idle[origin] = keep
            else:
                del self._idle[origin]

    async def _connect(self, origin: Origin, timeout_s: float | None) -> Connection:
        scheme, host, port = origin
        tls = None
        if scheme == "https":
            tls = self.ssl_context or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self.max_body_bytes),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                )
        except TimeoutError:
            raise errors.connect_timeout(timeout_s or 0.0) from None
        except OSError as exc:  # refused, unreachable, DNS, ssl.SSLError
            raise errors.connect_error(exc) from exc
        return conn

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.abort()  # idle: no TLS goodbye to wait for (it could outlive the loop)
        await asyncio.sleep(0)  # the sockets close in the loop's next step


class _Body(httpx.AsyncByteStream):
    """The body, read already: one piece."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._body:
            yield self._body


def _request_bytes(request: httpx.Request) -> bytes:
    if request.stream is not None and request.headers.get("content-length", "0") != "0":
        raise errors.unsupported("a request body is not supported")
    lines = [b"GET " + request.url.raw_path + b" HTTP/1.1"]
    for name, value in request.headers.raw:
        text = value.decode("latin-1")
        if _BAD_VALUE_CHARS.intersection(text) or _BAD_VALUE_CHARS.intersection(name.decode()):
            # Never quote it: the value may be a key read from a file.
            raise ValueError(f"header {name.decode('ascii', 'replace')!r} has a line break or NUL")
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n"
