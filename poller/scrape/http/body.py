"""A response body read raw and decoded (gzip, deflate) in steps bounded by the cap.

httpx would inflate a whole network chunk before the caller could count it (a 64 KB gzip
bomb is 64 MiB decoded); here every step stops once the cap is passed.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import httpx

from poller.errors import FetchError

__all__ = ["Decoder", "once", "raw_chunks"]


async def once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def raw_chunks(response: httpx.Response) -> AsyncIterable[bytes]:
    """The response's undecoded body as the transport yields it: iterated directly
    rather than through ``aiter_raw`` (one generator layer less per chunk)."""
    stream = response.stream
    if isinstance(stream, httpx.AsyncByteStream):
        return stream
    return response.aiter_raw()


class Decoder:
    """Content-Encoding identity, gzip or deflate, decoded in bounded steps."""

    def __init__(self, encoding: str, endpoint_id: str) -> None:
        self.encoding = encoding.strip().lower()
        self.endpoint_id = endpoint_id
        self._zlib: Any = None
        self._fed = False  # compressed bytes came in
        if self.encoding in ("gzip", "x-gzip", "deflate"):
            self._zlib = zlib.decompressobj(wbits=47)  # gzip or zlib header, detected
        elif self.encoding not in ("", "identity"):
            raise FetchError(
                "parse", f"unsupported Content-Encoding {encoding[:40]!r}", endpoint=endpoint_id
            )

    def feed(self, raw: bytes, room: int) -> list[bytes]:
        """Decoded pieces of ``raw``, stopping once more than ``room`` bytes came out."""
        if self._zlib is None:
            return [raw]
        self._fed = self._fed or bool(raw)
        out: list[bytes] = []
        try:
            data = raw
            while data and room > 0:
                piece = self._zlib.decompress(data, room)
                out.append(piece)
                room -= len(piece)
                data = self._zlib.unconsumed_tail
        except zlib.error as exc:
            raise FetchError(
                "parse", f"cannot decode {self.encoding} body: {exc}", endpoint=self.endpoint_id
            ) from None
        return out

    def finish(self) -> None:
        """``parse`` failure when a compressed body ended before its stream did: a page
        cut short (an engine or proxy that died mid-body after a flush) would parse
        cleanly and sum only the series that arrived. An empty body is left to the
        parser, which names it."""
        if self._zlib is not None and self._fed and not self._zlib.eof:
            raise FetchError("parse", f"truncated {self.encoding} body", endpoint=self.endpoint_id)
