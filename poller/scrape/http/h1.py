"""One HTTP/1.1 client connection as an ``asyncio.Protocol``; llhttp parses the answer.

``Connection.exchange`` writes a request's bytes and returns the answer. The bytes go to
llhttp (``httptools.HttpResponseParser``, the parser of Node.js and uvicorn) as they
arrive, in ``data_received``; its callbacks below keep the status, the headers and the
body's pieces, and hold the limits llhttp does not have:

- the body stops past ``max_body_bytes``, counted as each piece arrives (inside a chunk
  too), and a declared ``Content-Length`` over it is never read: the connection is
  dropped and the caller sees a body or a declared size over its cap;
- the head (interim 1xx heads included) is capped at ``MAX_HEAD_BYTES`` and
  ``MAX_HEADERS`` fields;
- ``Transfer-Encoding`` is one ``chunked`` or nothing (llhttp would read other codings
  until the server closes, or apply ``chunked`` twice);
- a 101 is refused: a scrape asks for no upgrade.

Interim 1xx answers are skipped by llhttp's own loop (no recursion); 204 and 304 have
no body; an answer without a length ends when the server closes. Bytes after a complete
answer (other than the empty lines llhttp skips) end the connection, not the answer.
Every parser error is an ``httpx.RemoteProtocolError`` (``transport_errors``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httptools

from poller.scrape.http import transport_errors as errors

__all__ = ["MAX_HEADERS", "MAX_HEAD_BYTES", "Connection", "Reply", "Stale"]

#: Status line plus headers; more is not an engine's answer.
MAX_HEAD_BYTES = 64 * 1024
#: Header fields in one answer (interim ones included).
MAX_HEADERS = 256

_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")

#: Body pieces kept as they came before they are gathered in one buffer.
_FEW = 32

#: (status, reason, headers, body) of one answer.
Reply = tuple[int, bytes, list[tuple[bytes, bytes]], bytes]

Stale = errors.Stale


class _Halt(Exception):
    """Raised in a parser callback to stop llhttp; the outcome is already decided."""


class Connection(asyncio.Protocol):
    """One connection: writes a request, parses its answer as it arrives."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body = max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.reusable = False
        self.idle_since = 0.0  # loop time it went back to the pool
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Any] | None = None
        self._start()

    def _start(self) -> None:
        """The state of one exchange."""
        self._status = 0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._pieces: list[bytes] = []
        self._many: bytearray | None = None  # the body, once it came in many pieces
        self._size = 0
        self._length: int | None = None
        self._chunked = False
        self._fields = 0
        self._field_bytes = 0
        self._head_bytes = 0
        self._head_done = False
        self._interim = False
        self._done = False
        self._got_bytes = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.reusable = True

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self._drop()  # bytes nobody asked for: the connection cannot be trusted
            return
        self._got_bytes = True
        if not self._head_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # on_headers_complete refuses a 101 first;
            # kept so that no parser outcome can escape into asyncio's "Fatal error" path
            self._fail(errors.protocol("an upgrade answer to a request that asked for none"))
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _Halt):
                if self._done:  # bytes past a complete answer: the answer stands
                    self._drop()
                return
            self._fail(errors.parser_error(exc))
        else:
            if not self._head_done and self._head_bytes > MAX_HEAD_BYTES:
                self._fail(errors.protocol(f"response head over {MAX_HEAD_BYTES // 1024} KiB"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost finishes the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._head_done and self._length is None and not self._chunked:
            self._finish(keep_alive=False)  # a body that ends when the server closes
        else:
            self._waiter = None
            waiter.set_exception(errors.lost(exc, self._got_bytes, self._head_done))

    # --- llhttp callbacks (httptools calls them by name) -------------------------------

    def on_message_begin(self) -> None:
        if self._done:
            raise _Halt  # a second answer to one request: the stream is not ours to read

    def on_status(self, reason: bytes) -> None:
        if _CONTROL.search(reason):  # llhttp lets them through; nothing sane sends one
            self._halt(errors.protocol("a control character in the status line"))
        self._reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        self._field_bytes += len(name) + len(value)
        if self._fields > MAX_HEADERS or self._field_bytes > MAX_HEAD_BYTES:
            self._halt(errors.protocol(f"head over {MAX_HEADERS} header fields or 64 KiB"))
        if self._head_done:
            return  # a chunked body's trailer fields: counted, not kept
        key = name.lower()
        if key == b"content-length":
            self._length = int(value)  # llhttp checked it: digits, once, no overflow
        elif key == b"transfer-encoding":
            if self._chunked or value.strip().lower() != b"chunked":
                self._halt(errors.protocol("Transfer-Encoding other than one 'chunked'"))
            self._chunked = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 101:
            self._halt(errors.protocol("101 Switching Protocols to a request without Upgrade"))
        if status < 200:
            self._interim = True  # its real answer follows
            return
        self._status, self._head_done = status, True
        length = self._length
        if length is not None and length > self.max_body and status not in (204, 304):
            # The caller reports the declared size; the body is never read.
            self._finish(keep_alive=False)
            raise _Halt

    def on_body(self, piece: bytes) -> None:
        # A page comes in a few pieces (one per read, or per chunk): kept as they are and
        # joined once. Past _FEW pieces (tiny chunks) they go into one buffer instead, so
        # a body of 1-byte chunks costs its bytes, not an object per byte.
        if self._many is not None:
            self._many += piece
        elif len(self._pieces) < _FEW:
            self._pieces.append(piece)
        else:
            self._many = bytearray().join([*self._pieces, piece])
            self._pieces = []
        self._size += len(piece)
        if self._size > self.max_body:  # the caller sees a body over its cap
            self._finish(keep_alive=False)
            raise _Halt

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self._reason, self._headers = b"", []
            self._length, self._chunked = None, False
            return
        self._finish(keep_alive=self._parser.should_keep_alive())

    # --- one exchange -------------------------------------------------------------------

    async def exchange(self, wire: bytes, timeout_s: float | None) -> Reply:
        assert self.transport is not None
        self.reusable = False  # until this exchange ends well
        self._start()
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(wire)
        try:
            if timeout_s is None:
                return await waiter  # type: ignore[no-any-return]
            async with asyncio.timeout(timeout_s):
                return await waiter  # type: ignore[no-any-return]
        except TimeoutError:
            self._drop()
            raise errors.read_timeout(timeout_s or 0.0) from None
        except BaseException:  # cancelled (the caller's deadline), or a failure above
            self._drop()
            raise

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    def _drop(self) -> None:
        self._waiter = None
        self.abort()

    def _halt(self, exc: Exception) -> None:
        self._fail(exc)
        raise _Halt

    def _fail(self, exc: Exception) -> None:
        waiter = self._waiter
        self._drop()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _finish(self, *, keep_alive: bool) -> None:
        waiter, self._waiter = self._waiter, None
        self._done = True
        pieces, self._pieces = self._pieces, []
        if self._many is not None:
            body, self._many = bytes(self._many), None
        else:
            body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        transport = self.transport
        self.reusable = keep_alive and transport is not None and not transport.is_closing()
        if not keep_alive and transport is not None:
            transport.close()  # a halted parse aborts it instead (data_received)
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, self._reason, self._headers, body))
