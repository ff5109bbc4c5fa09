"""A small asyncio TCP proxy for tests, with faults that can be switched at run time.

``TcpProxy(upstream_port)`` listens on a free loopback port and forwards every
connection to ``127.0.0.1:<upstream_port>``. Faults (``set_faults``), all off by default:

- ``latency=(lo, hi)``: every chunk, in either direction, is held for a uniformly random
  ``lo..hi`` seconds before it is written on (order is kept: a chunk never overtakes the
  one before it, as on a real TCP connection).
- ``drop_rate``: per forwarded chunk, the probability that the whole connection is
  closed instead (a FIN both ways; the chunk is lost).
- ``reset_rate``: the same, closing with ``SO_LINGER`` 0, i.e. a TCP RST both ways.
- ``blackhole``: connections are accepted but nothing is forwarded in either direction;
  bytes are kept, as a partitioned network's retransmissions would be, and flow on when
  the blackhole is lifted. A connection accepted during the blackhole is connected
  upstream only when it is lifted, and only if its client is still there.

``drop_all(reset=...)`` closes every open connection at once. Counters (``accepted``,
``dropped``, ``resets``, ``chunks``, ``upstream_failures``) say what happened. Only
127.0.0.1 is ever bound; ``stop()`` closes the listener and every connection and ends
every task the proxy started.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from dataclasses import dataclass, field

__all__ = ["Faults", "TcpProxy"]

HOST = "127.0.0.1"
_CHUNK = 65536
_EOF = b""


@dataclass
class Faults:
    latency: tuple[float, float] | None = None
    drop_rate: float = 0.0
    reset_rate: float = 0.0
    blackhole: bool = False


@dataclass(eq=False)
class _Conn:
    client_r: asyncio.StreamReader
    client_w: asyncio.StreamWriter
    upstream_w: asyncio.StreamWriter | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    closed: bool = False


def _abort(writer: asyncio.StreamWriter | None, reset: bool) -> None:
    if writer is None:
        return
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


class TcpProxy:
    def __init__(self, upstream_port: int, upstream_host: str = HOST, seed: int | None = None):
        self.upstream = (upstream_host, upstream_port)
        self.faults = Faults()
        self.rng = random.Random(seed)
        self.port = 0
        self.accepted = 0
        self.dropped = 0
        self.resets = 0
        self.chunks = 0
        self.upstream_failures = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._flowing.set()
        for conn in list(self._conns):
            self._close(conn, reset=False)
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def __aenter__(self) -> TcpProxy:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def set_faults(
        self,
        *,
        latency: tuple[float, float] | None = None,
        drop_rate: float = 0.0,
        reset_rate: float = 0.0,
        blackhole: bool = False,
    ) -> None:
        """Replace every fault at once (what is not named is off)."""
        self.faults = Faults(latency, drop_rate, reset_rate, blackhole)
        if blackhole:
            self._flowing.clear()
        else:
            self._flowing.set()

    def clear(self) -> None:
        self.set_faults()

    def drop_all(self, reset: bool = False) -> int:
        n = 0
        for conn in list(self._conns):
            self._close(conn, reset=reset)
            n += 1
        return n

    # --- internals -----------------------------------------------------------------------

    def _close(self, conn: _Conn, reset: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        _abort(conn.client_w, reset)
        _abort(conn.upstream_w, reset)
        current = asyncio.current_task()
        for task in conn.tasks:
            if task is not current:
                task.cancel()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        self.accepted += 1
        conn = _Conn(client_r, client_w)
        self._conns.add(conn)
        try:
            await self._serve(conn)
        except asyncio.CancelledError:
            pass
        finally:
            self._close(conn, reset=False)
            self._handlers.discard(handler)

    async def _serve(self, conn: _Conn) -> None:
        up_queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        reader = asyncio.create_task(self._read(conn.client_r, up_queue))
        conn.tasks.add(reader)
        if not self._flowing.is_set():
            # Accepted during a blackhole: connect upstream only once it lifts, and only
            # if the client is still there (it kept the connection open).
            await self._flowing.wait()
            if reader.done():
                return
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            self.upstream_failures += 1
            return
        conn.upstream_w = upstream_w
        if conn.closed:
            _abort(upstream_w, False)
            return
        down_queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        pumps = [
            reader,
            asyncio.create_task(self._read(upstream_r, down_queue)),
            asyncio.create_task(self._write(conn, up_queue, upstream_w)),
            asyncio.create_task(self._write(conn, down_queue, conn.client_w)),
        ]
        conn.tasks.update(pumps)
        # Both writers finish after forwarding an EOF; then the connection is over.
        await asyncio.gather(pumps[2], pumps[3], return_exceptions=True)

    async def _read(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                delay = 0.0
                if data and self.faults.latency is not None:
                    lo, hi = self.faults.latency
                    delay = self.rng.uniform(lo, hi)
                queue.put_nowait((time.monotonic() + delay, data))
                if not data:
                    return
        except (OSError, asyncio.IncompleteReadError):
            queue.put_nowait((time.monotonic(), _EOF))

    async def _write(
        self, conn: _Conn, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        while True:
            due, data = await queue.get()
            await self._flowing.wait()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._flowing.wait()  # a blackhole may have started meanwhile
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                    else:
                        writer.close()
                return
            roll = self.rng.random()
            if roll < self.faults.reset_rate:
                self.resets += 1
                self._close(conn, reset=True)
                return
            if roll < self.faults.reset_rate + self.faults.drop_rate:
                self.dropped += 1
                self._close(conn, reset=False)
                return
            self.chunks += 1
            try:
                writer.write(data)
                await writer.drain()
            except (OSError, RuntimeError):
                self._close(conn, reset=False)
                return
