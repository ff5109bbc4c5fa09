"""The transport's parser (llhttp in poller/scrape/http/h1.py) against h11, on random answers.

Hypothesis builds answers, valid and not (interim 1xx heads, every framing, cut or long
bodies, corrupted head bytes), splits them at random points into reads, and feeds them
to one ``h1.Connection`` and to h11. The verdicts (a page and its body, or an error)
must agree, except where the transport is deliberately stricter than h11, each case
named in ``stricter_than_h11``, or, in one case, more lenient (empty lines before the
status line, which llhttp skips as RFC 9112 section 2.2 allows).
"""

from __future__ import annotations

import asyncio
import re

import h11
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.scrape.http.h1 import Connection

Verdict = tuple[str, int, bytes]  # ("ok", status, body) or ("error", 0, b"")
ERROR: Verdict = ("error", 0, b"")


def h11_verdict(pieces: list[bytes]) -> Verdict:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/metrics", headers=[("Host", "e")]))
    conn.send(h11.EndOfMessage())
    status, body = 0, b""
    try:
        for piece in [*pieces, b""]:  # b"": the server closed the connection
            conn.receive_data(piece)
            while True:
                event = conn.next_event()
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return ("ok", status, body)
                elif isinstance(event, h11.InformationalResponse):
                    if event.status_code == 101:
                        return ERROR
                elif event is h11.NEED_DATA:
                    break
                else:  # PAUSED after a complete answer is returned above; closed early
                    return ERROR
    except h11.RemoteProtocolError:
        return ERROR
    return ERROR


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def our_verdict(pieces: list[bytes]) -> Verdict:
    async def exchange() -> Verdict:
        conn = Connection(1 << 20)
        transport = _Transport()
        conn.connection_made(transport)
        pending = asyncio.ensure_future(conn.exchange(b"GET /metrics HTTP/1.1\r\n\r\n", None))
        await asyncio.sleep(0)
        for piece in pieces:
            if pending.done() or transport.closed:
                break
            conn.data_received(piece)
        if not pending.done():
            conn.connection_lost(None)
        try:
            status, _, _, body = await pending
        except httpx.RemoteProtocolError:
            return ERROR
        return ("ok", status, body)

    return asyncio.run(exchange())


_BARE_LF = re.compile(rb"(?<!\r)\n")
_FOLD = re.compile(rb"\r\n[ \t]")
_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)")
_CL = re.compile(rb"\r\ncontent-length:", re.IGNORECASE)
_TE = re.compile(rb"\r\ntransfer-encoding:", re.IGNORECASE)
_VERSION = re.compile(rb"HTTP/(\d\.\d)")


def stricter_than_h11(head: bytes) -> str | None:
    """Why llhttp (or the transport) refuses a head h11 accepts; None if it should not."""
    if _BARE_LF.search(head):
        return "a line ended by a bare LF"
    if _FOLD.search(head):
        return "obsolete line folding"
    if _CTL.search(head):
        return "a control character (or a bare CR) in a header"
    if len(_CL.findall(head)) > 1:
        return "more than one Content-Length, even equal ones"
    if _CL.search(head) and _TE.search(head):
        return "Content-Length with Transfer-Encoding"
    if any(v not in (b"1.0", b"1.1", b"2.0") for v in _VERSION.findall(head)):
        return "an HTTP version llhttp does not know"
    return None


TOKENS = st.text("abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12)
BODIES = st.binary(max_size=300).map(lambda b: bytes(c for c in b if c not in b"\r\n"))


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, int]:
    """(answer, length of its head section), built from HTTP pieces, maybe corrupted."""
    interim = draw(
        st.lists(
            st.sampled_from(
                [
                    b"HTTP/1.1 100 Continue\r\n\r\n",
                    b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
                ]
            ),
            max_size=3,
        )
    )
    status = draw(
        st.sampled_from(
            [b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 200"]
            + [b"HTTP/1.1 204 No Content", b"HTTP/1.1 304 Not Modified"]
            + [b"HTTP/1.1 2000 OK", b"HTTP/1.1 20 OK", b"HTTX/1.1 200 OK", b"SSH-2.0-x"]
        )
    )
    fields = [
        b"%s: %s" % (n.encode(), v.encode())
        for n, v in draw(st.lists(st.tuples(TOKENS, TOKENS), max_size=4))
    ]
    body = draw(BODIES)
    framing = draw(
        st.sampled_from(["length", "short", "long", "chunked", "bad-chunk", "close", "bad-length"])
    )
    if framing in ("length", "short", "long"):
        declared = len(body) + {"length": 0, "short": 5, "long": -min(len(body), 3)}[framing]
        fields.append(b"Content-Length: %d" % declared)
    elif framing == "bad-length":
        fields.append(b"Content-Length: " + draw(st.sampled_from([b"-1", b"+3", b"3a", b""])))
    elif framing in ("chunked", "bad-chunk"):
        fields.append(b"Transfer-Encoding: chunked")
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        ext = draw(st.sampled_from([b"", b";x=1"]))
        chunks = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in parts if p)
        trailer = draw(st.sampled_from([b"", b"T: 1\r\n"]))
        if framing == "bad-chunk":
            chunks = draw(st.sampled_from([b"zz\r\nab\r\n", b"3\r\nabcX", b"-1\r\n"]))
        body = chunks + b"0\r\n" + trailer + b"\r\n"
    head = b"".join(interim) + b"\r\n".join([status, *fields]) + b"\r\n\r\n"
    if draw(st.booleans()):  # corrupt one byte of the head
        at = draw(st.integers(0, len(head) - 1))
        byte = draw(
            st.sampled_from([b":", b" ", b"\t", b"\r", b"\n", b"\x00", b"\x7f", b"x", b"9"])
        )
        head = head[:at] + byte + head[at + 1 :]
    return head + body, len(head)


@settings(max_examples=400, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(answer=answers(), cuts=st.lists(st.integers(min_value=1, max_value=2000), max_size=6))
def test_verdict_and_body_agree_with_h11(answer: tuple[bytes, int], cuts: list[int]) -> None:
    data, head_size = answer
    points = sorted({c for c in cuts if c < len(data)})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    ours, theirs = our_verdict(pieces), h11_verdict(pieces)
    if ours == theirs:
        return
    head = data[:head_size]
    if ours == ERROR and stricter_than_h11(head):
        return
    if theirs == ERROR and ours[0] == "ok" and data.startswith((b"\r\n", b"\n")):
        return  # empty lines before the status line: skipped by llhttp
    raise AssertionError(f"ours {ours!r}, h11 {theirs!r} for {data!r}")
