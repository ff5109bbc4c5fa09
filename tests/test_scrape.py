"""Scraping against a real local HTTP server, with both HTTP stacks under httpx."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from redisproc import free_port

from poller.errors import FetchError
from poller.registry import Endpoint
from poller.scrape.http import Scraper

PAGE = (Path(__file__).parent / "data" / "vllm-v1-synthetic-61k.txt").read_bytes()


async def streamed(request: web.Request, mode: str) -> web.StreamResponse:
    response = web.StreamResponse()
    if mode == "cut":
        response.content_length = len(PAGE)
    await response.prepare(request)
    if mode == "drip":
        for _ in range(100):
            await response.write(b"# drip\n")
            await asyncio.sleep(0.05)
    elif mode == "big-chunked":
        for _ in range(64):
            await response.write(b"x" * 65536)
    else:  # cut: half a page, then the connection drops
        await response.write(PAGE[:1000])
        assert request.transport is not None
        request.transport.close()
    return response


async def gzip_page(request: web.Request) -> web.Response:
    if request.headers.get("Accept-Encoding") == "gzip":
        return web.Response(body=gzip.compress(PAGE), headers={"Content-Encoding": "gzip"})
    return web.Response(body=PAGE)


async def delayed(seconds: float) -> web.Response:
    await asyncio.sleep(seconds)
    return web.Response(body=PAGE)


async def handler(request: web.Request) -> web.StreamResponse:
    mode = request.match_info["mode"]
    simple = {
        "ok": lambda: web.Response(body=PAGE, content_type="text/plain"),
        "headers": lambda: web.json_response(dict(request.headers)),
        "status500": lambda: web.Response(status=500, text="boom"),
        "status401": lambda: web.Response(status=401),
        "redirect": lambda: web.Response(status=302, headers={"Location": "/ok/metrics"}),
        "big-declared": lambda: web.Response(body=b"x" * 300_000),
        "brotli": lambda: web.Response(body=b"\x0b\x02", headers={"Content-Encoding": "br"}),
    }
    if mode in simple:
        return simple[mode]()
    if mode == "gzip":
        return await gzip_page(request)
    if mode in ("slow", "hang"):
        return await delayed(0.5 if mode == "slow" else 30)
    if mode in ("drip", "big-chunked", "cut"):
        return await streamed(request, mode)
    return web.Response(status=404)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/{mode}/metrics", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.fixture(params=["aiohttp", "httpcore"])
async def scraper(request: pytest.FixtureRequest) -> AsyncIterator[Scraper]:
    s = Scraper(max_body_bytes=200_000, http_client=request.param)
    yield s
    await s.aclose()


def ep(base: str, mode: str, **extra: object) -> Endpoint:
    return Endpoint.model_validate({"id": mode, "url": f"{base}/{mode}", **extra})


async def test_fetch_ok_and_keeps_the_connection(scraper: Scraper, server: str) -> None:
    for _ in range(3):
        fetched = await scraper.fetch(ep(server, "ok"), "/metrics", 2.0)
        assert fetched.body == PAGE and fetched.status == 200
        assert fetched.content_type.startswith("text/plain")


async def test_headers_sent(scraper: Scraper, server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEY_VAR", "s3cret")
    fetched = await scraper.fetch(ep(server, "headers", api_key_env="KEY_VAR"), "/metrics", 2.0)
    import json

    headers = json.loads(fetched.body)
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["Accept-Encoding"] == "identity"
    assert headers["Accept"].startswith("text/plain;version=0.0.4")


async def test_gzip_only_when_asked(scraper: Scraper, server: str) -> None:
    plain = await scraper.fetch(ep(server, "gzip"), "/metrics", 2.0)
    zipped = await scraper.fetch(ep(server, "gzip", accept_gzip=True), "/metrics", 2.0)
    assert plain.body == PAGE and zipped.body == PAGE


@pytest.mark.parametrize(
    ("mode", "reason", "words"),
    [
        ("status500", "http_status", "HTTP 500"),
        ("status401", "auth", "HTTP 401"),
        ("redirect", "http_status", "HTTP 302"),
        ("slow", "timeout", "0.2s"),
        ("hang", "timeout", "0.2s"),
        ("drip", "timeout", "0.2s"),
        ("big-chunked", "too_large", "200000-byte cap"),
        ("big-declared", "too_large", "300000+ bytes"),
        ("cut", "unreachable", ""),
        ("brotli", "parse", "unsupported Content-Encoding 'br'"),
    ],
)
async def test_failures_map_to_reasons(
    scraper: Scraper, server: str, mode: str, reason: str, words: str
) -> None:
    with pytest.raises(FetchError) as err:
        await scraper.fetch(ep(server, mode), "/metrics", 0.2)
    assert err.value.reason == reason, err.value
    assert words in err.value.detail


async def test_refused_is_unreachable(scraper: Scraper) -> None:
    endpoint = Endpoint(id="gone", url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(FetchError) as err:
        await scraper.fetch(endpoint, "/metrics", 1.0)
    assert err.value.reason == "unreachable"


async def test_timeout_is_overall_not_per_read(scraper: Scraper, server: str) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(FetchError):
        await scraper.fetch(ep(server, "drip"), "/metrics", 0.3)
    assert loop.time() - started < 2.0  # the drip would take 5 s
