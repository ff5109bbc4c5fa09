"""One HTTP/1.1 client connection as an ``asyncio.Protocol`` (the transport is wire.py).

``Connection.exchange`` writes a request's bytes and returns the parsed answer; the answer
is parsed as it arrives, in ``data_received``: the status line and headers once, then the
body by ``Content-Length``, ``chunked`` framing, or until the server closes. Interim 1xx
answers are skipped; 204, 304 and 101 have no body. Past ``max_body_bytes`` (or with a
``Content-Length`` over it) the body stops there and the connection is not reused: the
caller sees a body or a declared size over its cap. Anything that is not HTTP/1.x framing
we can trust is ``httpx.RemoteProtocolError``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

__all__ = ["MAX_HEAD_BYTES", "Connection", "Reply", "Stale"]

#: Status line plus headers; more is not an engine's answer.
MAX_HEAD_BYTES = 64 * 1024

#: (status, reason, headers, body) of one answer.
Reply = tuple[int, bytes, list[tuple[bytes, bytes]], bytes]


class Stale(Exception):
    """The connection closed before any byte of the response."""


# Parser states.
_IDLE, _HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _TRAILER, _UNTIL_CLOSE = range(7)


class Connection(asyncio.Protocol):
    """One connection: writes a request, parses its response as it arrives."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body = max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.reusable = False
        self.idle_since = 0.0  # loop time it went back to the pool
        self._waiter: asyncio.Future[Any] | None = None
        self._state = _IDLE
        self._buf = bytearray()
        self._scanned = 0  # how far the head was searched for its end
        self._pieces: list[bytes] = []
        self._size = 0
        self._remaining = 0
        self._head: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None
        self._keep_alive = True
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
        try:
            self._feed(data)
        except httpx.RemoteProtocolError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost finishes the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():
            return
        if self._state == _UNTIL_CLOSE:
            self._waiter = waiter
            self._finish()
        elif not self._got_bytes:
            waiter.set_exception(Stale())
        elif exc is not None:
            waiter.set_exception(httpx.ReadError(f"connection lost: {exc}"))
        else:
            what = "headers" if self._state == _HEAD else "body"
            waiter.set_exception(
                httpx.RemoteProtocolError(
                    f"server closed the connection in the middle of the {what}"
                )
            )

    # --- one exchange -------------------------------------------------------------------

    async def exchange(self, wire: bytes, timeout_s: float | None) -> Reply:
        assert self.transport is not None
        self.reusable = False  # until this exchange ends well
        self._state, self._scanned, self._size = _HEAD, 0, 0
        self._buf.clear()
        self._pieces = []
        self._head, self._keep_alive, self._got_bytes = None, True, False
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(wire)
        try:
            if timeout_s is None:
                return await waiter  # type: ignore[no-any-return]
            async with asyncio.timeout(timeout_s):
                return await waiter  # type: ignore[no-any-return]
        except TimeoutError:
            self._drop()
            raise httpx.ReadTimeout(f"no complete response within {timeout_s:g}s") from None
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

    def _fail(self, exc: Exception) -> None:
        waiter = self._waiter
        self._drop()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _finish(self) -> None:
        waiter, self._waiter = self._waiter, None
        assert self._head is not None
        status, reason, headers = self._head
        pieces, self._pieces = self._pieces, []
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self._state = _IDLE
        self._buf.clear()  # a connection holds nothing between exchanges
        self.reusable = self._keep_alive and self.transport is not None
        if not self._keep_alive and self.transport is not None:
            self.transport.close()
        if waiter is not None and not waiter.done():
            waiter.set_result((status, reason, headers, body))

    # --- parsing ------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._state == _HEAD:
            buf = self._buf
            seen: bytes | bytearray = data
            if buf:
                buf += data
                seen = buf
            end = seen.find(b"\r\n\r\n", max(0, self._scanned - 3))
            if end < 0 or end > MAX_HEAD_BYTES:
                if len(seen) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError("response headers over 64 KiB")
                if not buf:
                    buf += data
                self._scanned = len(buf)
                return
            head, rest = bytes(seen[:end]), bytes(seen[end + 4 :])
            buf.clear()
            self._scanned = 0
            self._start_body(head)
            if self._state == _HEAD:  # an interim 1xx answer: its real one follows
                if rest:
                    self._feed(rest)
                return
            data = rest
        self._body(data)

    def _start_body(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status, reason, http10 = _status_line(lines[0])
        if 100 <= status < 200 and status != 101:
            return  # stay in _HEAD
        headers, length, encodings, connection = _header_fields(lines)
        self._head = (status, reason, headers)
        tokens = {t.strip() for t in connection.split(b",")}
        self._keep_alive = b"keep-alive" in tokens if http10 else b"close" not in tokens
        chunked = False
        if encodings:
            chunked = encodings.rsplit(b",", 1)[-1].strip() == b"chunked"
            length = None  # Transfer-Encoding wins over Content-Length (RFC 9112 6.3)
            self._keep_alive = self._keep_alive and chunked
        if status in (101, 204, 304):
            self._finish()
        elif chunked:
            self._state = _CHUNK_SIZE
        elif length is None:
            self._state, self._keep_alive = _UNTIL_CLOSE, False
        elif length > self.max_body:
            # The caller reports the declared size; the body is never read.
            self._keep_alive = False
            self._finish()
        elif length == 0:
            self._finish()
        else:
            self._state, self._remaining = _LENGTH, length

    def _take(self, piece: bytes) -> bool:
        """Keep a piece of the body; False once past the cap (the caller reports it)."""
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size > self.max_body:
            self._keep_alive = False
            self._finish()
            return False
        return True

    def _body(self, data: bytes) -> None:
        state = self._state
        if state == _LENGTH:
            if len(data) >= self._remaining:
                if len(data) > self._remaining:
                    raise httpx.RemoteProtocolError("more bytes than the Content-Length")
                self._pieces.append(data)
                self._finish()
            elif data:
                self._pieces.append(data)
                self._remaining -= len(data)
        elif state == _UNTIL_CLOSE:
            if data:
                self._take(data)
        elif state in (_CHUNK_SIZE, _CHUNK_DATA, _TRAILER):
            self._buf += data
            self._chunks()
        elif data:
            raise httpx.RemoteProtocolError("bytes after the end of the response")

    def _chunks(self) -> None:
        buf = self._buf
        pos = 0
        while self._state != _IDLE:
            if self._state == _CHUNK_SIZE:
                step = self._chunk_size(buf, pos)
            elif self._state == _CHUNK_DATA:
                step = self._chunk_data(buf, pos)
            else:
                step = self._trailer(buf, pos)
            if step < 0:
                break
            pos = step
        if self._state != _IDLE:  # a finished response cleared the buffer already
            del buf[:pos]

    def _chunk_size(self, buf: bytearray, pos: int) -> int:
        """The position after a chunk-size line, or -1 until it is all here."""
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            if len(buf) - pos > 1024:
                raise httpx.RemoteProtocolError("chunk size line too long")
            return -1
        size_text = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
        if not size_text or not all(c in b"0123456789abcdefABCDEF" for c in size_text):
            raise httpx.RemoteProtocolError("invalid chunk size")
        size = int(size_text, 16)
        self._state, self._remaining = (_CHUNK_DATA, size) if size else (_TRAILER, 0)
        return eol + 2

    def _chunk_data(self, buf: bytearray, pos: int) -> int:
        end = pos + self._remaining
        if len(buf) < end + 2:
            return -1
        if buf[end : end + 2] != b"\r\n":
            raise httpx.RemoteProtocolError("chunk not followed by CRLF")
        self._state = _CHUNK_SIZE
        return end + 2 if self._take(bytes(buf[pos:end])) else -1

    def _trailer(self, buf: bytearray, pos: int) -> int:
        """Trailer fields (ignored), then the empty line that ends the response."""
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            if len(buf) - pos > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError("trailers over 64 KiB")
            return -1
        if eol > pos:
            return eol + 2
        if eol + 2 != len(buf):
            raise httpx.RemoteProtocolError("bytes after the end of the response")
        self._finish()
        return -1


def _header_fields(
    lines: list[bytes],
) -> tuple[list[tuple[bytes, bytes]], int | None, bytes, bytes]:
    """(headers, Content-Length, Transfer-Encoding, Connection) of a response head."""
    headers: list[tuple[bytes, bytes]] = []
    length: int | None = None
    encodings = connection = b""
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or b"\x00" in line:
            raise httpx.RemoteProtocolError("malformed response header line")
        value = value.strip(b" \t")
        key = name.lower()
        if key == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise httpx.RemoteProtocolError("invalid or conflicting Content-Length")
            length = int(value)
        elif key == b"transfer-encoding":
            encodings = value.lower()
        elif key == b"connection":
            connection = value.lower()
        headers.append((name, value))
    return headers, length, encodings, connection


def _status_line(line: bytes) -> tuple[int, bytes, bool]:
    """(status, reason, HTTP/1.0) of ``HTTP/1.x SSS reason``; anything else is an error."""
    version, _, rest = line.partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise httpx.RemoteProtocolError("not an HTTP/1.x status line")
    return int(code), reason, version == b"HTTP/1.0"
