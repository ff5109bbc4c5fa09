"""The one test HTTP server: a loopback TCP server answering each request as a script says.

Every test that needs an engine over HTTP uses it: a script maps each request to its
answer, given as exact bytes (so a framing fault goes out as written), ``answer(...)``
for an ordinary one, or a list of pieces:

- ``bytes``: written;
- ``None``: close the connection there (at the top level: close without answering);
- ``HANG``: write nothing more until the server stops (a server that never answers:
  only the client's own timeout can end the exchange, whatever the machine's speed);
- ``Pause(seconds)``: a drip-fed answer, where the rate is the behaviour under test;
- an async iterator of bytes: a generated stream (a million series, an endless body).

``routes({...})`` builds a script from a path table; ``threaded(script)`` runs the server
in a thread of its own for code that runs its own event loop (the CLI).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "HANG",
    "HTTPServer",
    "Pause",
    "Request",
    "answer",
    "chunked",
    "echo_headers",
    "routes",
    "threaded",
]

HANG = object()


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass
class Request:
    n: int  # 1 for the first request on its connection
    head: bytes
    method: str = ""
    target: str = ""  # path and query
    headers: dict[str, str] = field(default_factory=dict)  # names as sent

    def header(self, name: str) -> str | None:
        """A header's value, its name matched in any case."""
        wanted = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == wanted), None)

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]


Answer = Any  # bytes | None | list[...] | AsyncIterator[bytes]; see the module docstring
Script = Callable[[Request], Answer | Awaitable[Answer]]


def answer(
    status: int = 200,
    body: bytes | str = b"",
    headers: Mapping[str, str] | None = None,
    *,
    reason: str = "",
    content_type: str | None = "text/plain",
) -> bytes:
    """An ordinary HTTP/1.1 answer with a Content-Length."""
    data = body.encode() if isinstance(body, str) else body
    lines = [f"HTTP/1.1 {status} {reason or _REASONS.get(status, 'Status')}"]
    if content_type is not None and not (headers and "Content-Type" in headers):
        lines.append(f"Content-Type: {content_type}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    lines.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


def chunked(*pieces: bytes, head: bytes = b"HTTP/1.1 200 OK\r\n") -> bytes:
    """A chunked answer with one chunk per piece."""
    out = [head, b"Transfer-Encoding: chunked\r\n\r\n"]
    out += [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p]
    return b"".join([*out, b"0\r\n\r\n"])


_REASONS = {
    200: "OK",
    204: "No Content",
    301: "Moved Permanently",
    302: "Found",
    307: "Temporary Redirect",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    500: "Internal Server Error",
    501: "Not Implemented",
}


def echo_headers(request: Request) -> bytes:
    """The request's headers as a JSON object: what the client sent."""
    return answer(200, json.dumps(request.headers), content_type="application/json")


def routes(table: Mapping[str, Answer | Callable[[Request], Answer]]) -> Script:
    """A script answering by path (query ignored); 404 for any other path."""

    def script(request: Request) -> Answer:
        entry = table.get(request.path, answer(404))
        return entry(request) if callable(entry) else entry

    return script


class HTTPServer:
    """A loopback server running ``script``; counts connections and client closes."""

    def __init__(self, script: Script, *, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.connections = 0
        self.closed_by_client = 0
        self.requests: list[Request] = []
        self.url = ""
        self.port = 0
        self._server: asyncio.Server | None = None
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> HTTPServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._stopping.set()
        self._server.close()
        for writer in list(self._writers):
            writer.close()  # each handler then sees its connection end, or _stopping
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections += 1
        try:
            for n in range(1, 10_000):
                request = _parse(n, await reader.readuntil(b"\r\n\r\n"))
                self.requests.append(request)
                result = self.script(request)
                if inspect.isawaitable(result):
                    result = await result
                if not await self._send(writer, result):
                    return
        except asyncio.IncompleteReadError:
            self.closed_by_client += 1
        except (ConnectionError, ssl.SSLError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)
            self._writers.discard(writer)

    async def _send(self, writer: asyncio.StreamWriter, result: Answer) -> bool:
        """Write an answer; False once the connection is to close."""
        if result is None:
            return False
        pieces = result if isinstance(result, list | AsyncIterator) else [result]
        if isinstance(pieces, list):
            pieces = _aiter(pieces)
        async for piece in pieces:
            if self._stopping.is_set() or piece is None:
                return False
            if piece is HANG:
                await self._stopping.wait()
                return False
            if isinstance(piece, Pause):
                await asyncio.sleep(piece.seconds)
                continue
            writer.write(piece)
            await writer.drain()
        return True


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _parse(n: int, head: bytes) -> Request:
    lines = head.decode("latin-1").split("\r\n")
    method, _, rest = lines[0].partition(" ")
    target = rest.rpartition(" ")[0]
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip()] = value.strip()
    return Request(n, head, method, target, headers)


@contextmanager
def threaded(script: Script, *, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """The server in a thread with its own event loop; yields its URL."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, HTTPServer] = {}

    async def start() -> None:
        server = HTTPServer(script, tls=tls)
        holder["server"] = await server.__aenter__()
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()))
    thread.start()
    try:
        assert ready.wait(30), "the test server did not start"
        yield holder["server"].url
    finally:
        stop = holder["server"].__aexit__(None, None, None)
        asyncio.run_coroutine_threadsafe(stop, loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
