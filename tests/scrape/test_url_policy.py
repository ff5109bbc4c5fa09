"""Endpoint URL policy: schemes, credentials, redirects, and ``scrape.allowed_hosts``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import fakeredis
import httpx
import pytest

from poller.config import HostAllowlist, Settings, load_settings
from poller.errors import ConfigError, FetchError
from poller.schema.endpoint import Endpoint, endpoint_from_json
from poller.scrape.http.client import Scraper
from poller.service.worker import Worker
from poller.store.store import RedisStore
from poller.util.logs import text_of
from tests.support.httpserver import HTTPServer, Request, answer

VLLM = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n"

ALLOWLIST = (
    "10.0.0.0/8",
    "192.168.7.5",  # a bare address is a /32
    "fd00::/8",
    "[::1]",  # brackets are tolerated
    "gw.internal",
    "*.engines.internal",
    "Mixed.Case.Example.",  # case and a trailing dot do not matter
)


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("10.1.2.3", True),
        ("11.0.0.1", False),
        ("192.168.7.5", True),
        ("192.168.7.6", False),
        ("fd12:3456::1", True),
        ("fe80::1", False),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:10.0.0.1", True),  # IPv4-mapped: connects to 10.0.0.1
        ("::ffff:11.0.0.1", False),
        ("gw.internal", True),
        ("GW.Internal.", True),
        ("x.gw.internal", False),  # an exact name does not allow its subdomains
        ("a.engines.internal", True),
        ("a.b.engines.internal", True),  # any depth under the wildcard
        ("engines.internal", False),  # but not the apex
        ("evilengines.internal", False),
        ("engines.internal.evil.com", False),
        ("mixed.case.example", True),
        # IPv4 in forms getaddrinfo accepts but ipaddress does not: never a name match
        ("10.1", False),
        ("0x0a000001", False),
        ("167772161", False),
        ("012.0.0.1", False),
        ("", False),
    ],
)
def test_allowlist_matching(host: str, allowed: bool) -> None:
    assert HostAllowlist.parse(ALLOWLIST).allows(host) is allowed


def test_names_and_addresses_do_not_imply_each_other() -> None:
    """Nothing is resolved: a CIDR does not allow names, a name does not allow addresses."""
    by_cidr = HostAllowlist.parse(["127.0.0.0/8"])
    assert by_cidr.allows("127.0.0.1") and not by_cidr.allows("localhost")
    by_name = HostAllowlist.parse(["localhost"])
    assert by_name.allows("localhost") and not by_name.allows("127.0.0.1")
    assert not by_name.allows("::1")


def test_empty_allowlist_allows_everything() -> None:
    empty = HostAllowlist.parse([])
    assert empty.empty and empty.allows("anything.example") and empty.allows("10.1")


def test_ipv6_with_a_zone_matches_its_network() -> None:
    link_local = HostAllowlist.parse(["fe80::/10"])
    assert link_local.allows("fe80::1%25eth0") and link_local.allows("fe80::1")


@pytest.mark.parametrize(
    "entry",
    [
        "*",
        "*.",
        "a*.b",
        "*.10.0",
        "http://gw.internal",
        "gw.internal:8000",
        "a..b",
        "-a.b",
        "10.0.0.0/33",
        "10.1",
        "gw internal",
    ],
)
def test_bad_allowlist_entries_are_config_errors(entry: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(None, {"scrape.allowed_hosts": [entry]}, {})
    assert str(err.value).startswith("scrape.allowed_hosts: ") and repr(entry) in str(err.value)


def test_allowlist_from_env_toml_and_defaults(tmp_path: Path) -> None:
    env = {"POLLER_SCRAPE__ALLOWED_HOSTS": "10.0.0.0/8, *.engines.internal,,"}
    assert load_settings(None, None, env).scrape.allowed_hosts == (
        "10.0.0.0/8",
        "*.engines.internal",
    )
    assert Settings().scrape.allowed_hosts == ()
    config = tmp_path / "p.toml"
    config.write_text('[scrape]\nallowed_hosts = ["gw.internal", "fd00::/8"]\n')
    assert load_settings(config, None, {}).scrape.allowed_hosts == ("gw.internal", "fd00::/8")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://10.0.0.5/x", "scheme must be http or https"),
        ("file:///etc/passwd", "scheme must be http or https"),
        ("http://user:pw@10.0.0.5:8000", "credentials in the URL are not allowed"),
        ("http://user@10.0.0.5:8000", "credentials in the URL are not allowed"),
        ("http://10.0.0.5:8000/?x=1", "query or fragment"),
    ],
)
def test_registry_url_rules_stay(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        endpoint_from_json("e1", json.dumps({"url": url}))


# --- the scrape path ----------------------------------------------------------------------


class Engine:
    """A local HTTP server that counts requests per path."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.url = ""

    def handle(self, request: Request) -> bytes:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        return answer(200, VLLM)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    async with HTTPServer(e.handle) as server:
        e.url = server.url
        yield e


class Origin:
    """A local HTTP server that records the Authorization header of every request."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization)
        self.port = 0
        self.redirects: dict[str, tuple[int, str]] = {}  # path -> (status, Location)

    def handle(self, request: Request) -> bytes:
        self.seen.append((request.path, request.header("Authorization")))
        hop = request.path.removeprefix("/hop/").removesuffix("/metrics")
        if request.path.startswith("/hop/") and hop.isdigit() and int(hop) > 0:
            # 301, 302, 303, 307, 308 in turn: every kind of redirect is followed alike.
            status = (301, 302, 303, 307, 308)[int(hop) % 5]
            return answer(status, headers={"Location": f"/hop/{int(hop) - 1}/metrics"})
        if request.path in self.redirects:
            status, location = self.redirects[request.path]
            return answer(status, headers={"Location": location} if location else {})
        return answer(200, VLLM)


@pytest.fixture
async def origins() -> AsyncIterator[tuple[Origin, Origin]]:
    """Two servers on 127.0.0.1: two origins that differ by port."""
    a, b = Origin(), Origin()
    async with HTTPServer(a.handle) as server_a, HTTPServer(b.handle) as server_b:
        a.port, b.port = server_a.port, server_b.port
        yield a, b


KEY = "Bearer redirect-test-key"


async def _fetch(url: str) -> Exception | int:
    scraper = Scraper(max_body_bytes=100_000)
    endpoint = Endpoint(id="e", url=url, api_key_env="LLMGW_KEY_REDIRECT_TEST")
    try:
        return (await scraper.fetch(endpoint, "/metrics", 5.0)).status
    except FetchError as exc:
        return exc
    finally:
        await scraper.aclose()


@pytest.fixture(autouse=True)
def _redirect_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_KEY_REDIRECT_TEST", KEY.removeprefix("Bearer "))


async def test_three_redirects_within_the_origin_are_followed_with_the_key(
    origins: tuple[Origin, Origin],
) -> None:
    a, _ = origins
    assert await _fetch(f"http://127.0.0.1:{a.port}/hop/3") == 200
    assert a.seen == [(f"/hop/{n}/metrics", KEY) for n in (3, 2, 1, 0)]


async def test_a_fourth_redirect_fails(origins: tuple[Origin, Origin]) -> None:
    a, _ = origins
    err = await _fetch(f"http://127.0.0.1:{a.port}/hop/4")
    assert isinstance(err, FetchError) and err.reason == "http_status"
    assert err.detail == "HTTP 302: more than 3 redirects" and err.status == 302  # /hop/1's
    assert [path for path, _ in a.seen] == [f"/hop/{n}/metrics" for n in (4, 3, 2, 1)]


@pytest.mark.parametrize("elsewhere", ["port", "host", "scheme"])
async def test_a_redirect_to_another_origin_fails_and_never_gets_the_key(
    origins: tuple[Origin, Origin], elsewhere: str
) -> None:
    a, b = origins
    target, named = {
        # another port of the same address: a different server (b records what it gets)
        "port": (f"http://127.0.0.1:{b.port}/metrics", f"http://127.0.0.1:{b.port}"),
        # another host name for the same server: a's own log shows it was never asked
        "host": (f"http://localhost:{a.port}/landed", f"http://localhost:{a.port}"),
        "scheme": (f"https://127.0.0.1:{a.port}/landed", f"https://127.0.0.1:{a.port}"),
    }[elsewhere]
    a.redirects["/metrics"] = (302, "/go")  # same origin first: the check is made per hop
    a.redirects["/go"] = (307, target)
    err = await _fetch(f"http://127.0.0.1:{a.port}")
    assert isinstance(err, FetchError) and err.reason == "http_status" and err.status == 307
    assert err.detail.startswith(f"HTTP 307 redirect to {named}, another origin: not followed")
    assert a.seen == [("/metrics", KEY), ("/go", KEY)]
    assert b.seen == []


async def test_a_redirect_without_a_location_fails(origins: tuple[Origin, Origin]) -> None:
    a, _ = origins
    a.redirects["/metrics"] = (302, "")
    err = await _fetch(f"http://127.0.0.1:{a.port}")
    assert isinstance(err, FetchError) and err.reason == "http_status"
    assert err.detail == "HTTP 302 redirect without a usable Location"


async def test_a_redirect_to_the_same_origin_with_default_port_is_followed() -> None:
    # http://h/ and http://h:80/ are one origin; checked without a network (MockTransport).
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.path == "/metrics":
            return httpx.Response(302, headers={"Location": "http://gw.internal:80/real"})
        return httpx.Response(200, content=VLLM)

    scraper = Scraper(
        max_body_bytes=100_000, transport_factory=lambda _: httpx.MockTransport(handle)
    )
    try:
        fetched = await scraper.fetch(Endpoint(id="e", url="http://gw.internal"), "/metrics", 2.0)
    finally:
        await scraper.aclose()
    assert fetched.status == 200 and seen[-1].endswith("/real")


async def test_disallowed_host_is_never_contacted(engine: Engine) -> None:
    scraper = Scraper(max_body_bytes=100_000, allowed_hosts=["localhost", "10.0.0.0/8"])
    try:
        with pytest.raises(FetchError) as err:
            await scraper.fetch(Endpoint(id="e", url=engine.url), "/metrics", 2.0)
        assert err.value.reason == "config"
        assert err.value.detail == "host 127.0.0.1 is not in scrape.allowed_hosts"
        assert engine.hits == {}
        allowed = Endpoint(id="e", url=engine.url.replace("127.0.0.1", "localhost"))
        assert (await scraper.fetch(allowed, "/metrics", 2.0)).status == 200
    finally:
        await scraper.aclose()
    assert engine.hits == {"/metrics": 1}


class Recorder:
    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def factory(self, endpoint: Endpoint) -> httpx.AsyncBaseTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return httpx.Response(200, content=VLLM)

        return httpx.MockTransport(handle)


async def test_worker_writes_a_config_failure_for_a_disallowed_endpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder()
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    settings = Settings.model_validate(
        {"id": "p1", "scrape": {"allowed_hosts": ["*.engines.internal", "10.0.0.0/8"]}}
    )
    worker = Worker(settings, RedisStore(client, "t"), transport_factory=recorder.factory)
    try:
        # Written straight into the hash, as a foreign writer would: the policy is applied
        # where the poller scrapes, not where entries are written.
        await client.hset(
            "{t}:endpoints",
            mapping={
                "outside": json.dumps({"url": "http://169.254.169.254"}),
                "inside": json.dumps({"url": "http://a.engines.internal:8000"}),
            },
        )
        await worker.store.ensure_schema()
        await worker.step()
        assert set(worker.owned) == {"outside", "inside"}
        caplog.set_level("WARNING", logger="poller.service.reporting")
        await worker.scrape_once("outside")
        await worker.scrape_once("inside")
        failure = await client.hgetall("{t}:failure:outside")
        assert failure["reason"] == "config"
        assert failure["detail"] == "host 169.254.169.254 is not in scrape.allowed_hosts"
        assert [str(r.url) for r in recorder.requests] == ["http://a.engines.internal:8000/metrics"]
        assert (await worker.store.read_stats("inside"))["running"] == "1"
        assert any("169.254.169.254" in text_of(r) for r in caplog.records)
    finally:
        await worker.jobs.stop()
        await worker.scraper.aclose()
        await client.aclose()
