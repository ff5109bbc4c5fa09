"""The bounded decoder of response bodies (poller/scrape/http/body.py)."""

from __future__ import annotations

import zlib

import pytest

from poller.errors import FetchError
from poller.scrape.http.body import Decoder

PAGE = b"vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"


def _gzip(data: bytes, *, whole: bool) -> bytes:
    compressor = zlib.compressobj(wbits=31)
    return compressor.compress(data) + compressor.flush(
        zlib.Z_FINISH if whole else zlib.Z_SYNC_FLUSH
    )


def _decode(encoding: str, raw: bytes, step: int = 7) -> bytes:
    decoder = Decoder(encoding, "e1")
    out = [
        piece
        for at in range(0, len(raw), step)
        for piece in decoder.feed(raw[at : at + step], 1 << 20)
    ]
    decoder.finish()
    return b"".join(out)


def test_a_whole_gzip_body_in_small_pieces() -> None:
    assert _decode("gzip", _gzip(PAGE, whole=True)) == PAGE


def test_a_gzip_stream_that_stops_early_is_a_parse_failure() -> None:
    # What arrived decodes to whole lines, but the stream never ended.
    with pytest.raises(FetchError) as raised:
        _decode("gzip", _gzip(PAGE, whole=False))
    assert (raised.value.reason, "truncated gzip body" in str(raised.value)) == ("parse", True)


def test_an_empty_body_is_left_to_the_parser() -> None:
    assert _decode("gzip", b"") == b""


def test_identity_passes_through() -> None:
    assert _decode("identity", PAGE) == PAGE
