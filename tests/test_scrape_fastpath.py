"""The scrape request path's shortcuts (issue 13): a request prepared once per endpoint and
sent straight to the transport, and the body read in few pieces. Each shortcut must give
the same result as building everything afresh."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from poller.errors import FetchError
from poller.registry import Endpoint
from poller.scrape.http import Scraper

# Bigger than aiohttp's 16 KB slices and than one socket read: arrives in several pieces.
BIG = b"".join(b'vllm:x{i="%d"} %d\n' % (i, i) for i in range(20_000))


async def handler(request: web.Request) -> web.StreamResponse:
    mode = request.match_info["mode"]
    if mode == "headers":
        return web.json_response(dict(request.headers))
    if mode == "big":
        return web.Response(body=BIG)
    if mode == "big-chunked":  # no Content-Length, written in odd-sized pieces
        response = web.StreamResponse()
        await response.prepare(request)
        for start in range(0, len(BIG), 7_001):
            await response.write(BIG[start : start + 7_001])
        return response
    return web.Response(status=404)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/{mode}/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.fixture(params=["asyncio", "aiohttp", "httpcore"])
async def scraper(request: pytest.FixtureRequest) -> AsyncIterator[Scraper]:
    s = Scraper(max_body_bytes=1_000_000, http_client=request.param)
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
