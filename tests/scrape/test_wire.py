"""The poller's own HTTP/1.1 transport (poller/scrape/http/wire.py, h1.py): framing,
keep-alive, caps, timeouts and cancellation, against the scripted test server.

Malformed and hostile answers, through ``Scraper.fetch``, are test_http_faults.py's; TLS
is test_tls.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.scrape.http.h1 import Connection
from poller.scrape.http.wire import WireTransport
from tests.support.httpserver import HTTPServer, Request
from tests.support.procs import until

BODY = b"vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


@asynccontextmanager
async def client(max_body_bytes: int = 1 << 20) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        transport=WireTransport(max_body_bytes=max_body_bytes), trust_env=False
    ) as c:
        yield c


async def test_keeps_one_connection_alive_for_many_requests() -> None:
    seen: list[bytes] = []

    def script(r: Request) -> bytes:
        seen.append(r.head)
        return OK

    async with HTTPServer(script) as server, client() as c:
        for _ in range(3):
            response = await c.get(server.url + "/a/metrics?model=x", headers={"X-K": "v"})
            assert response.status_code == 200 and response.content == BODY
    assert server.connections == 1
    assert seen[0].startswith(b"GET /a/metrics?model=x HTTP/1.1\r\n")
    assert b"\r\nX-K: v\r\n" in seen[0] and b"\r\nHost: 127.0.0.1:" in seen[0]


async def test_chunked_body_with_extensions_and_trailers() -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1A\r\n" + b"z" * 26 + b"\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    async with HTTPServer(lambda r: answer) as server, client() as c:
        for _ in range(2):
            response = await c.get(server.url)
            assert response.content == b"hello" + b"z" * 26
            assert response.headers["content-type"] == "text/plain"
    assert server.connections == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.0 200 OK\r\n\r\n" + BODY,  # HTTP/1.0: the body ends when the server closes
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
        b"HTTP/1.1 200 OK\r\n\r\n" + BODY,  # no length: the body ends when the server closes
    ],
    ids=["http10-until-close", "connection-close", "http11-until-close"],
)
async def test_answers_that_end_the_connection_are_not_reused(answer: bytes) -> None:
    async with HTTPServer(lambda r: [answer, None]) as server, client() as c:
        for _ in range(2):
            response = await c.get(server.url)
            assert response.content == BODY
    assert server.connections == 2


async def test_http10_keep_alive_is_reused() -> None:
    answer = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (
        len(BODY),
        BODY,
    )
    async with HTTPServer(lambda r: answer) as server, client() as c:
        for _ in range(2):
            assert (await c.get(server.url)).content == BODY
    assert server.connections == 1


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    # Each answer is followed by the server hanging up; the next request opens a new one.
    async with HTTPServer(lambda r: [OK, None]) as server, client() as c:
        transport = c._transport
        assert isinstance(transport, WireTransport)
        assert (await c.get(server.url)).content == BODY
        (pooled,) = [conn for conns in transport._idle.values() for conn in conns]
        # The close arrives while the connection is idle: the pool sees it before reuse.
        await until(lambda: not pooled.reusable, 30, "the pooled connection to see the close")
        assert (await c.get(server.url)).content == BODY
    assert server.connections == 2


async def test_a_reused_connection_closed_as_the_request_went_out_is_retried_once() -> None:
    # The server reads the second request, then closes without a byte: the race between
    # its keep-alive timeout and our request. The transport retries on a new connection.
    async with HTTPServer(lambda r: OK if r.n == 1 else None) as server, client() as c:
        assert (await c.get(server.url)).content == BODY
        assert (await c.get(server.url)).content == BODY  # no sleep: sent on the old one
    assert server.connections == 2


async def test_a_new_connection_closed_without_an_answer_is_an_error() -> None:
    async with HTTPServer(lambda r: None) as server, client() as c:
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await c.get(server.url)
    assert server.connections == 1  # not retried: nothing says a new one would fare better


async def test_interim_answers_are_skipped_and_204_has_no_body() -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    answers = {1: early + OK, 2: b"HTTP/1.1 204 No Content\r\n\r\n", 3: OK}
    async with HTTPServer(lambda r: answers[r.n]) as server, client() as c:
        assert (await c.get(server.url)).content == BODY
        empty = await c.get(server.url)
        assert empty.status_code == 204 and empty.content == b""
        assert (await c.get(server.url)).content == BODY
    assert server.connections == 1


async def test_a_declared_length_over_the_cap_is_not_read() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000
    async with HTTPServer(lambda r: answer) as server, client(max_body_bytes=1000) as c:
        response = await c.get(server.url)
        assert response.headers["content-length"] == "5000" and response.content == b""
        await c.get(server.url)
    assert server.connections == 2  # dropped: the rest of that body is never read


async def test_a_chunked_body_over_the_cap_stops_past_it() -> None:
    chunk = b"400\r\n" + b"x" * 1024 + b"\r\n"
    answer: list[bytes | None] = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
    answer += [chunk] * 50
    async with HTTPServer(lambda r: answer) as server, client(max_body_bytes=3000) as c:
        response = await c.get(server.url)
        assert 3000 < len(response.content) <= 3000 + 1024
        await c.get(server.url)
    assert server.connections == 2


async def test_bytes_past_the_content_length_end_the_connection_not_the_answer() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef"
    async with HTTPServer(lambda r: answer) as server, client() as c:
        for _ in range(2):
            assert (await c.get(server.url)).content == b"abc"
    assert server.connections == 2  # never reused: its next answer would be "def..."


async def test_a_read_timeout_drops_the_connection() -> None:
    release = asyncio.Event()

    def script(r: Request) -> bytes | None:
        return OK if r.n > 1 or release.is_set() else b"HTTP/1.1 200 OK\r\n"  # headers unfinished

    async with HTTPServer(script) as server, client() as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.get(server.url, timeout=httpx.Timeout(5.0, read=0.2))
        release.set()
        assert (await c.get(server.url)).content == BODY
    assert server.connections == 2


async def test_cancelling_a_request_drops_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc"  # then nothing
    received = bytearray()
    stalled = asyncio.Event()  # the client has read the whole partial answer
    data_received = Connection.data_received

    def spy(self: Connection, data: bytes) -> None:
        data_received(self, data)
        received.extend(data)
        if bytes(received) == partial:
            stalled.set()

    monkeypatch.setattr(Connection, "data_received", spy)
    async with HTTPServer(lambda r: [partial]) as server, client() as c:
        task = asyncio.create_task(c.get(server.url))
        await asyncio.wait_for(stalled.wait(), 30)
        assert not task.done()  # cancelled mid-body
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: server.closed_by_client, 30, "the server to see the close")
        assert server.closed_by_client == 1


async def test_connect_refused_is_a_connect_error_with_its_cause() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with client() as c:
        with pytest.raises(httpx.ConnectError) as caught:
            await c.get(f"http://127.0.0.1:{port}/metrics")
    assert isinstance(caught.value.__cause__, OSError)


async def test_a_header_value_with_a_line_break_is_refused_without_quoting_it() -> None:
    async with client() as c:
        with pytest.raises(ValueError) as caught:
            await c.get("http://127.0.0.1:9/metrics", headers={"Authorization": "sk-1\r\nX: y"})
    assert "sk-1" not in str(caught.value) and "authorization" in str(caught.value).lower()


async def test_only_get_without_a_body_is_supported() -> None:
    async with client() as c:
        with pytest.raises(httpx.UnsupportedProtocol):
            await c.post("http://127.0.0.1:9/metrics", content=b"x")


class _Transport(asyncio.Transport):
    """Records what the protocol does to it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n"
    b"7\r\nvllm:nu\r\n30\r\n" + BODY[7:55] + b"\r\n0\r\n\r\n"
)


@settings(max_examples=100, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    answer=st.sampled_from([OK, _CHUNKED]),
    cuts=st.lists(st.integers(min_value=1, max_value=len(_CHUNKED) - 1), max_size=12),
)
def test_any_split_of_an_answer_reads_the_same(answer: bytes, cuts: list[int]) -> None:
    """Headers, chunk sizes and CRLFs split anywhere between data_received calls."""
    from poller.scrape.http.h1 import Connection

    async def exchange() -> tuple[int, bytes, bool]:
        conn = Connection(1 << 20)
        transport = _Transport()
        conn.connection_made(transport)
        pending = asyncio.ensure_future(conn.exchange(b"GET / HTTP/1.1\r\n\r\n", None))
        await asyncio.sleep(0)
        points = sorted({c for c in cuts if c < len(answer)})
        for a, b in zip([0, *points], [*points, len(answer)], strict=True):
            conn.data_received(answer[a:b])
        status, _, _, body = await pending
        return status, body, conn.reusable

    status, body, reusable = asyncio.run(exchange())
    expected = BODY[:55] if answer is _CHUNKED else BODY
    assert (status, body, reusable) == (200, expected, True)


async def test_idle_connections_past_the_keepalive_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An endpoint whose lease moved away leaves no socket open on its engine: idle
    connections older than KEEPALIVE_S are closed, those of other origins too."""
    import poller.scrape.http.wire as wire

    monkeypatch.setattr(wire, "KEEPALIVE_S", 0.2)
    loop = asyncio.get_running_loop()
    async with HTTPServer(lambda r: OK) as a, HTTPServer(lambda r: OK) as b, client() as c:
        transport = c._transport
        assert isinstance(transport, WireTransport)
        await c.get(a.url)
        await c.get(b.url)
        # Time is the behaviour here: wait, on the clock the transport reads, until both
        # idle connections are past the keepalive and the sweep is due.
        pooled = [conn for conns in transport._idle.values() for conn in conns]
        due = max(transport._next_sweep, *(conn.idle_since + wire.KEEPALIVE_S for conn in pooled))
        await until(lambda: loop.time() > due, 30, "the keepalive to pass", interval_s=0.01)
        await c.get(a.url)  # a's old connection is past the keepalive; b's is swept
        await until(
            lambda: a.closed_by_client and b.closed_by_client, 30, "both servers to see a close"
        )
        assert (a.connections, a.closed_by_client, b.closed_by_client) == (2, 1, 1)
        assert list(transport._idle) == [("http", "127.0.0.1", int(a.url.rsplit(":", 1)[1]))]
