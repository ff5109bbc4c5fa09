"""A non-2xx answer keeps its status and the engine's message (poller check, failures)."""

from __future__ import annotations

import gzip

import httpx
import pytest

from poller.errors import FetchError
from poller.schema.endpoint import Endpoint
from poller.scrape.http.client import Scraper

LLAMA_501 = (
    b'{"error":{"code":501,"message":"This server does not support metrics endpoint. '
    b'Start it with `--metrics`","type":"not_supported_error"}}'
)


async def answer(status: int, body: bytes, **headers: str) -> FetchError:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers=headers)

    scraper = Scraper(
        max_body_bytes=100_000, transport_factory=lambda e: httpx.MockTransport(handler)
    )
    try:
        with pytest.raises(FetchError) as err:
            await scraper.fetch(Endpoint(id="e", url="http://engine:8080"), "/metrics", 5.0)
    finally:
        await scraper.aclose()
    return err.value


@pytest.mark.parametrize(
    ("status", "body", "reason", "message"),
    [
        (
            501,
            LLAMA_501,
            "http_status",
            "This server does not support metrics endpoint. Start it with `--metrics`",
        ),
        (401, b'{"detail": "Invalid API key"}', "auth", "Invalid API key"),
        (400, b'{"message": "model not found", "code": 400}', "http_status", "model not found"),
        (400, b'{"error": "model name is missing"}', "http_status", "model name is missing"),
        (
            503,
            b"\r\n\n  Service Unavailable \r\nretry later\n",
            "http_status",
            "Service Unavailable",
        ),
        (500, b'{"error": {"code": 500}}', "http_status", '{"error": {"code": 500}}'),
        (404, b"", "http_status", ""),
        (502, b"bad\x00gate\x1bway\xff", "http_status", "bad gate way\ufffd"),
    ],
)
async def test_status_and_first_line(status: int, body: bytes, reason: str, message: str) -> None:
    err = await answer(status, body)
    assert (err.reason, err.status, err.body) == (reason, status, message)
    assert err.detail.startswith(f"HTTP {status}")
    assert err.detail.endswith(f": {message}" if message else f"HTTP {status}")


async def test_long_and_compressed_bodies_stay_bounded() -> None:
    err = await answer(500, b"x" * 50_000 + b"\nnext")
    assert err.body == "x" * 200
    # an error body is never inflated (it has no cap of its own)
    err = await answer(500, gzip.compress(b"boom"), **{"Content-Encoding": "gzip"})
    assert (err.status, err.body, err.detail) == (500, "", "HTTP 500")


async def test_redirects_keep_a_plain_detail() -> None:
    # Same-origin redirects are followed (3 at most); the redirect's own body is not an
    # engine's error message and stays out of the detail.
    err = await answer(302, b"302: Found", Location="/elsewhere")
    assert (err.reason, err.status, err.body) == ("http_status", 302, "")
    assert err.detail == "HTTP 302: more than 3 redirects"
