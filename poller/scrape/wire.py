"""An httpx transport of our own: HTTP/1.1 GETs on asyncio protocols (issue 13).

A scrape is one small request and one response of tens of kilobytes, to a host the
poller talks to every second. Under httpx, aiohttp's client machinery and the
``httpx-aiohttp`` adapter cost about a quarter of a scrape's CPU (docs/performance.md);
this transport does the same exchange with one ``asyncio.Protocol`` per connection:

- the request's bytes are built once per prepared ``httpx.Request`` (kept in its
  extensions) and written in one call;
- the response is parsed as it arrives, in ``data_received`` (``h1.py``), without a task
  switch per piece: the status line and headers once, then the body by
  ``Content-Length``, ``chunked`` framing, or until the server closes (HTTP/1.0,
  ``Connection: close``);
- the awaiting request is woken once, with the whole body (at most ``max_body_bytes`` + 1
  bytes of it: past the cap the connection is dropped, and the caller sees a body over
  its cap, or a ``Content-Length`` over it, and reports ``too_large``);
- connections are kept alive per origin (scheme, host, port) and reused, and closed
  after ``KEEPALIVE_S`` idle; one found closed by the server before any byte of the
  answer came is replaced, once, by a new one.

Errors are httpx's: ``ConnectError`` (refused, unresolvable, TLS verification, with the
``OSError``/``ssl`` error as its cause), ``ConnectTimeout`` and ``ReadTimeout`` (from the
request's ``timeout`` extension; the caller's overall deadline still bounds everything),
``RemoteProtocolError`` for anything that is not HTTP/1.x framing we can trust (a bad status
line, a header over 64 KiB or with a NUL, conflicting or malformed ``Content-Length``, a bad
chunk, a body cut short) and ``ReadError`` for a reset. Only ``GET`` without a request body
is supported: that is all a scrape sends.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import httpx

from poller.scrape.h1 import Connection, Stale

__all__ = ["WireTransport"]

#: An idle connection older than this is closed (aiohttp's default too): an endpoint
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
            raise httpx.UnsupportedProtocol(f"only GET is supported, not {request.method}")
        url = request.url
        if url.scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}")
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
            except Stale:
                if reused:
                    continue  # the server closed it while idle: once more, on a new one
                raise httpx.RemoteProtocolError(
                    "server disconnected without sending a response"
                ) from None
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
        raise httpx.RemoteProtocolError("server disconnected without sending a response")

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
            raise httpx.ConnectTimeout(f"no connection within {timeout_s:g}s") from None
        except OSError as exc:  # refused, unreachable, DNS, ssl.SSLError
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
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
        raise httpx.UnsupportedProtocol("a request body is not supported")
    lines = [b"GET " + request.url.raw_path + b" HTTP/1.1"]
    for name, value in request.headers.raw:
        text = value.decode("latin-1")
        if _BAD_VALUE_CHARS.intersection(text) or _BAD_VALUE_CHARS.intersection(name.decode()):
            # Never quote it: the value may be a key read from a file.
            raise ValueError(f"header {name.decode('ascii', 'replace')!r} has a line break or NUL")
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n"
