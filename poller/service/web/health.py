"""Health and metrics HTTP endpoints for the poller itself, on plain asyncio streams.

``/healthz``: the event loop answers. ``/readyz``: Redis reachable and our membership
fresh; when not, the body says why (Redis refused our credentials, is unreachable, the
heartbeat is stale). ``/metrics``: our own Prometheus metrics. Extra JSON routes
(``/v1/view``) and raw routes (the operator's page and its static files, which see the
query string and set their own headers) are plugged in by the caller. Deliberately
tiny: GET only, one request per connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

__all__ = ["HealthServer", "Response"]

log = logging.getLogger(__name__)


class Response(NamedTuple):
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


JsonRoute = Callable[[], Awaitable[Any]]
#: Gets the raw query string (without ``?``), answers a whole response.
RawRoute = Callable[[str], Awaitable[Response]]
_REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


_REQUEST_LINE = re.compile(rb"[A-Z]+ [^ ]+ HTTP/\d\.\d\r\n")
_NOT_HTTP = b"not an HTTP request: this is a poller's health port (HTTP)\n"


class HealthServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        ready: Callable[[], bool],
        registry: Collector,
        unready_reason: Callable[[], str] = lambda: "",
        routes: dict[str, JsonRoute] | None = None,
        raw_routes: dict[str, RawRoute] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._ready = ready
        self._unready_reason = unready_reason
        self._registry = registry
        self._routes = routes or {}
        self._raw_routes = raw_routes or {}
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health server listening", extra={"host": self.host, "port": self.port})
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                line = await reader.readuntil(b"\r\n")
                if _REQUEST_LINE.fullmatch(line) is None:
                    # Not HTTP (a Redis client given this port sends RESP, which never
                    # ends a head): answer at once, so the client says "it answers HTTP"
                    # rather than waiting for its timeout.
                    response = Response(400, "text/plain", _NOT_HTTP)
                else:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # the headers: nothing here reads them
                    method, target, _ = line.decode("latin-1").split(" ")
                    path, _, query = target.partition("?")
                    response = await self._respond(method, path, query)
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ValueError,
            ConnectionError,
        ):
            writer.close()
            return
        status, ctype, body, headers = response
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
        try:
            writer.write(
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _respond(self, method: str, path: str, query: str) -> Response:
        if method != "GET":
            return Response(405, "text/plain", b"GET only\n")
        if path == "/healthz":
            return Response(200, "text/plain", b"ok\n")
        if path == "/readyz":
            if self._ready():
                return Response(200, "text/plain", b"ready\n")
            why = self._unready_reason()
            body = f"not ready: {why}\n" if why else "not ready\n"
            return Response(503, "text/plain", body.encode())
        if path == "/metrics":
            return Response(200, CONTENT_TYPE_LATEST, generate_latest(self._registry))
        raw = self._raw_routes.get(path)
        route = self._routes.get(path)
        if raw is None and route is None:
            return Response(404, "text/plain", b"not found\n")
        try:
            if raw is not None:
                return await raw(query)
            assert route is not None
            payload = await route()
        except Exception:
            log.exception("route failed", extra={"path": path})
            return Response(500, "text/plain", b"internal error\n")
        return Response(200, "application/json", json.dumps(payload).encode())
