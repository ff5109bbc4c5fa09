"""The scrape request path's shortcuts: a request prepared once per endpoint and
sent straight to the transport, and the body read in few pieces. Each shortcut must give
the same result as building everything afresh."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from poller.errors import FetchError
from poller.schema.endpoint import Endpoint
from poller.scrape.http.client import Scraper
from tests.support.httpserver import HTTPServer, answer, echo_headers, routes

# Bigger than one socket read: arrives in several pieces.
BIG = b"".join(b'vllm:x{i="%d"} %d\n' % (i, i) for i in range(20_000))


def big_chunked() -> list[bytes]:
    """No Content-Length: odd-sized chunks, each written on its own."""
    pieces = [BIG[start : start + 7_001] for start in range(0, len(BIG), 7_001)]
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [head, *(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces), b"0\r\n\r\n"]


SCRIPT = routes(
    {
        "/headers/metrics": echo_headers,
        "/big/metrics": answer(200, BIG),
        "/big-chunked/metrics": big_chunked(),
    }
)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async with HTTPServer(SCRIPT) as running:
        yield running.url


@pytest.fixture
async def scraper() -> AsyncIterator[Scraper]:
    s = Scraper(max_body_bytes=1_000_000)
    yield s
    await s.aclose()


def ep(url: str, **extra: object) -> Endpoint:
    return Endpoint.model_validate({"id": "e1", "url": url, **extra})


async def test_big_body_arrives_whole_every_time(scraper: Scraper, server: str) -> None:
    for mode in ("big", "big-chunked", "big", "big-chunked"):
        fetched = await scraper.fetch(ep(f"{server}/{mode}"), "/metrics", 5.0)
        assert fetched.body == BIG


async def test_body_cap_still_holds_with_big_reads(server: str) -> None:
    scraper = Scraper(max_body_bytes=len(BIG) - 1)
    try:
        for mode in ("big", "big-chunked"):
            with pytest.raises(FetchError) as err:
                await scraper.fetch(ep(f"{server}/{mode}"), "/metrics", 5.0)
            assert err.value.reason == "too_large"
    finally:
        await scraper.aclose()


async def test_rotated_api_key_is_sent(
    scraper: Scraper, server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = ep(f"{server}/headers", api_key_env="LLMGW_KEY_FASTPATH")
    for key in ("first", "first", "second"):
        monkeypatch.setenv("LLMGW_KEY_FASTPATH", key)
        fetched = await scraper.fetch(endpoint, "/metrics", 5.0)
        assert json.loads(fetched.body)["Authorization"] == f"Bearer {key}"


async def test_changed_url_or_path_is_used(scraper: Scraper, server: str) -> None:
    fetched = await scraper.fetch(ep(f"{server}/big"), "/metrics", 5.0)
    assert fetched.body == BIG
    fetched = await scraper.fetch(ep(f"{server}/headers"), "/metrics", 5.0)
    assert "Accept" in json.loads(fetched.body)
    with pytest.raises(FetchError) as err:
        await scraper.fetch(ep(f"{server}/big"), "/other", 5.0)
    assert err.value.status == 404


async def test_allowlist_checked_for_a_changed_host(server: str) -> None:
    scraper = Scraper(max_body_bytes=1_000_000, allowed_hosts=["127.0.0.1"])
    try:
        assert (await scraper.fetch(ep(f"{server}/big"), "/metrics", 5.0)).body == BIG
        moved = server.replace("127.0.0.1", "localhost")
        for _ in range(2):
            with pytest.raises(FetchError) as err:
                await scraper.fetch(ep(f"{moved}/big"), "/metrics", 5.0)
            assert err.value.reason == "config"
    finally:
        await scraper.aclose()


async def test_discard_forgets_the_prepared_request(scraper: Scraper, server: str) -> None:
    await scraper.fetch(ep(f"{server}/big"), "/metrics", 5.0)
    await scraper.discard("e1")
    assert (await scraper.fetch(ep(f"{server}/big"), "/metrics", 5.0)).body == BIG
