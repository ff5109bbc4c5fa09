"""The operator's page: HTML rendering (escaping, filters, sorting) without a browser, the
routes on a real HealthServer, and the whole thing in headless Chromium against Redis, the
simulator and a `poller run` process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from poller._version import __version__
from poller.reader.reader import StatsReader
from poller.schema.endpoint import Endpoint
from poller.schema.keys import Keys
from poller.service.web.health import HealthServer, Response
from poller.service.web.page import CSP, OperatorPage
from poller.service.web.render import (
    COLUMNS,
    Fleet,
    Query,
    parse_query,
    render_main,
    render_page,
    select,
)
from poller.store.store import RedisStore
from poller_lab.bench_fleet import sync_registry
from poller_lab.embedded import http_json, start_sim
from tests.support.cdp import Browser
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess

HOSTILE = "<script>window.__pwned=1</script>\"'&"


def endpoint(
    endpoint_id: str,
    state: str = "fresh",
    engine: str | None = "vllm",
    running: int | None = 1,
    waiting: int = 0,
    kv: float | None = 0.5,
    age_ms: int | None = 100,
    **extra: Any,
) -> dict[str, Any]:
    stats = None
    if running is not None:
        stats = {"engine": engine, "running": running, "waiting": waiting, "kv_cache_usage": kv}
        stats.update(extra.pop("stats", {}))
    return {
        "id": endpoint_id,
        "state": state,
        "engine": engine,
        "age_ms": age_ms,
        "owner": extra.pop("owner", "p0"),
        "token": 1,
        "stats": stats,
        "failure": extra.pop("failure", None),
        "url": extra.pop("url", "http://10.0.0.1:8000"),
        "labels": extra.pop("labels", {}),
        "registry_engine": extra.pop("registry_engine", engine),
    }


def view(*endpoints: dict[str, Any], **extra: Any) -> dict[str, Any]:
    counts = {s: sum(e["state"] == s for e in endpoints) for s in ("fresh", "stale", "failing")}
    return {
        "schema": 1,
        "now_ms": 1_000_000,
        "rev": 7,
        "pollers": ["p0", "p1"],
        "counts": {**counts, "unknown": 0},
        "endpoints": list(endpoints),
        **extra,
    }


FLEET = Fleet("p0", "9.9.9", 2000, schema="1", expiries={"p0": 1_001_500, "p1": 1_000_400})


class Rows(HTMLParser):
    """The endpoint rows of a rendered page: data-id, data-state, and cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        self.scripts = 0
        self._cell: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "tr" and "endpoint" in (a.get("class") or "").split():
            self.rows.append({"id": a["data-id"], "state": a["data-state"], "cells": {}})
        elif tag == "td" and self.rows:
            self._cell = (a.get("class") or "").split()[-1]
            self.rows[-1]["cells"].setdefault(self._cell, "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None and self.rows:
            self.rows[-1]["cells"][self._cell] += data


def rows_of(html: str) -> list[dict[str, Any]]:
    parser = Rows()
    parser.feed(html)
    return parser.rows


# --- rendering ---------------------------------------------------------------------------


def test_every_untrusted_value_is_escaped() -> None:
    failure = {"reason": "http_status", "detail": HOSTILE, "since_ms": 990_000, "missing": []}
    hostile = endpoint(
        HOSTILE,
        "failing",
        engine=HOSTILE,
        owner=HOSTILE,
        failure=failure,
        stats={"lora_running": [HOSTILE], "lora_max": 2},
        url=HOSTILE,
        labels={HOSTILE: HOSTILE},
    )
    html = render_page(
        view(hostile, sources=[{"source": HOSTILE, "targets": 3}]),
        Fleet(HOSTILE, "1", 2000, expiries={}),
        Query(),
    )
    assert "<script>window" not in html
    assert "\"'&" not in html  # quotes cannot close an attribute
    parser = Rows()
    parser.feed(html)
    assert parser.scripts == 1  # only the page's own script file
    [row] = parser.rows
    assert row["id"] == HOSTILE
    assert row["cells"]["engine"] == row["cells"]["owner"] == HOSTILE
    # the id, then its URL and labels
    assert row["cells"]["id"] == HOSTILE * 2 + f"{HOSTILE}={HOSTILE}"
    assert HOSTILE in row["cells"]["failure"] and HOSTILE in row["cells"]["lora"]


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40))
def test_any_text_comes_back_as_the_same_text(text: str) -> None:
    failure = {"reason": text, "detail": text, "since_ms": 0, "missing": []}
    html = render_main(
        view(endpoint(text, "failing", engine=text, owner=text, failure=failure)),
        FLEET,
        Query(),
    )
    parser = Rows()
    parser.feed(html)
    parser.close()
    [row] = parser.rows
    # HTML parsers normalise \r and NUL in text; everything else must survive as text.
    clean = text.replace("\r\n", "\n").replace("\r", "\n").replace("\0", "\ufffd")
    assert row["id"] == text and parser.scripts == 0
    assert row["cells"]["engine"] in (text, clean) and row["cells"]["owner"] in (text, clean)


def test_rows_carry_the_same_state_and_numbers_as_the_view() -> None:
    failure = {"reason": "contract", "detail": "", "since_ms": 940_000, "missing": ["kv"]}
    html = render_main(
        view(
            endpoint("a", running=3, waiting=2, kv=0.256),
            endpoint("b", "failing", failure=failure),
            endpoint("c", "unknown", engine=None, running=None, age_ms=None, owner=None),
        ),
        FLEET,
        Query(),
    )
    rows = {r["id"]: r for r in rows_of(html)}
    assert rows["a"]["state"] == "fresh" and rows["a"]["cells"]["running"] == "3"
    assert rows["a"]["cells"]["waiting"] == "2" and rows["a"]["cells"]["kv"] == "25.6"
    assert rows["b"]["state"] == "failing"
    assert rows["b"]["cells"]["failure"].startswith("contract for 1m00s")
    assert "missing kv" in rows["b"]["cells"]["failure"]
    assert rows["c"]["cells"]["running"] == "-" and rows["c"]["cells"]["age"] == "-"
    assert "registry rev 7" in html and "schema 1" in html
    # The fleet: leases held counted from owners, heartbeat age from the expiry.
    assert re.search(r'data-id="p0">.*?leases">2<.*?beat">0.5s<.*?expires">1.5s<', html)
    assert re.search(r'data-id="p1">.*?leases">0<.*?beat">1.6s<', html)


def test_each_poller_shows_its_own_version_and_ttl_from_the_members_info() -> None:
    infos = {"p1": {"version": "8.0.0", "member_ttl_ms": 6000}, "p0": {"version": 7}}
    fleet = Fleet("p0", "9.9.9", 2000, expiries={"p0": 1_001_500, "p1": 1_000_400}, infos=infos)
    html = render_main(view(endpoint("a")), fleet, Query())
    # p1 heartbeats with a 6 s TTL: 0.4 s left means it beat 5.6 s ago, and it says 8.0.0.
    assert re.search(r'data-id="p1">.*?beat">5.6s<.*?version">8.0.0<', html)
    # The serving poller knows its own version; an absurd info value is not used.
    assert re.search(r'data-id="p0">.*?beat">0.5s<.*?version">9.9.9<', html)


def test_a_draining_poller_says_so_in_the_fleet() -> None:
    infos = {"p1": {"version": "1", "member_ttl_ms": 2000, "draining": True}, "p2": {}}
    expiries = {"p0": 1_001_500, "p1": 1_001_500, "p2": 1_001_500}
    fleet = Fleet("p0", "1", 2000, expiries=expiries, infos=infos, drains={"p1", "p2"})
    v = view(endpoint("a"))
    html = render_main({**v, "pollers": ["p0", "p1", "p2"]}, fleet, Query())
    assert re.search(r'class="poller self" data-id="p0">.*?state">serving<', html)
    assert re.search(r'class="poller draining" data-id="p1">.*?state">draining<', html)
    # requested, not acknowledged (yet, or a poller version that does not drain)
    assert re.search(r'class="poller draining" data-id="p2">.*?state">drain requested<', html)


def test_sleeping_shows_where_the_stats_say_so_and_only_then() -> None:
    asleep = endpoint("asleep", stats={"sleeping": 1})
    awake = endpoint("awake", stats={"sleeping": 0})
    old = endpoint("old")  # stats without the field at all
    stale_asleep = endpoint("stale-asleep", "stale", stats={"sleeping": 1})
    rows = {
        r["id"]: r["state"]
        for r in rows_of(render_main(view(asleep, awake, old, stale_asleep), FLEET, Query()))
    }
    assert rows == {"asleep": "sleeping", "awake": "fresh", "old": "fresh", "stale-asleep": "stale"}
    only = rows_of(render_main(view(asleep, awake), FLEET, parse_query("state=sleeping")))
    assert [r["id"] for r in only] == ["asleep"]


def test_filters_by_state_and_engine() -> None:
    v = view(
        endpoint("a", engine="vllm"),
        endpoint("b", "failing", engine="sglang"),
        endpoint("c", "failing", engine="vllm"),
    )
    ids = lambda qs: [r["id"] for r in rows_of(render_main(v, FLEET, parse_query(qs)))]  # noqa: E731
    assert ids("") == ["a", "b", "c"]
    assert ids("state=failing") == ["b", "c"]
    assert ids("engine=vllm") == ["a", "c"]
    assert ids("state=failing&engine=vllm") == ["c"]
    assert ids("state=stale") == []
    assert "no endpoint matches" in render_main(v, FLEET, parse_query("state=stale"))


@pytest.mark.parametrize("column", COLUMNS)
def test_sorts_by_every_column_both_ways_with_missing_values_last(column: str) -> None:
    lora = lambda names: {"lora_running": names, "lora_max": 4}  # noqa: E731
    rows = [
        endpoint("b", "stale", engine="vllm", running=5, waiting=0, kv=0.9, age_ms=300,
                 owner="p1", stats={"prefix_cache_hit_rate": 0.1, **lora(["x"])}),
        endpoint("a", "failing", engine="tgi", running=1, waiting=7, kv=0.2, age_ms=100,
                 owner="p0", stats={"prefix_cache_hit_rate": 0.8, **lora(["x", "y"])}),
        endpoint("c", "fresh", engine="sglang", running=3, waiting=3, kv=0.5, age_ms=200,
                 owner="p2", stats={"prefix_cache_hit_rate": 0.5, **lora([])}),
        endpoint("d", "unknown", engine=None, running=None, age_ms=None, owner=None),
    ]  # fmt: skip
    expected = {
        "id": "abcd",
        "engine": "cabd",  # sglang, tgi, vllm; no engine last
        "state": "abdc",  # failing, stale, unknown, fresh
        "owner": "abcd",
        "running": "acbd",
        "waiting": "bcad",
        "kv": "acbd",
        "hit": "bcad",
        "lora": "cbad",
        "age": "acbd",
    }[column]
    up = [e["id"] for e in select(rows, Query(sort=column))]
    down = [e["id"] for e in select(rows, Query(sort=column, order="desc"))]
    assert "".join(up) == expected
    known = expected.rstrip("d") if column not in ("id", "state") else expected
    if column == "id":
        assert "".join(down) == "dcba"
    elif column == "state":
        assert "".join(down) == expected[::-1]
    else:
        assert "".join(down) == known[::-1] + "d"  # missing values stay last


def test_sort_links_keep_the_filters_and_toggle_the_order() -> None:
    html = render_main(view(endpoint("a")), FLEET, parse_query("state=fresh&engine=vllm&sort=kv"))
    links = dict(re.findall(r'<th class="(\w+)"><a class="sort" href="([^"]*)"', html))
    assert links["kv"] == "?state=fresh&amp;engine=vllm&amp;sort=kv&amp;order=desc"
    assert links["running"] == "?state=fresh&amp;engine=vllm&amp;sort=running&amp;order=desc"
    assert links["owner"] == "?state=fresh&amp;engine=vllm&amp;sort=owner"
    assert Query().link() == "?"
    assert parse_query("sort=kv&order=desc") == Query(sort="kv", order="desc")


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("state=bogus", "unknown state 'bogus': one of fresh, stale, failing, unknown, sleeping"),
        ("sort=nope", "unknown sort column 'nope'"),
        ("order=up", "unknown order 'up': asc or desc"),
        ("engine=%3Cx%3E", "invalid engine '<x>'"),
        ("colour=red", "unknown query parameter 'colour'"),
    ],
)
def test_bad_query_is_a_one_line_error(query: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        parse_query(query)
    assert "\n" not in str(info.value)


def test_sources_render_when_present_and_are_omitted_otherwise() -> None:
    assert 'id="sources"' not in render_main(view(endpoint("a")), FLEET, Query())
    listed = render_main(
        view(endpoint("a"), sources=[{"name": "dns-a", "targets": 3, "failure": None}]),
        FLEET,
        Query(),
    )
    assert 'id="sources"' in listed and "<td>dns-a</td><td>3</td><td>-</td>" in listed
    keyed = render_main(view(endpoint("a"), sources={"dns-b": {"targets": 2}}), FLEET, Query())
    assert "<td>dns-b</td><td>2</td>" in keyed
    nested = render_main(
        view(endpoint("a"), sources=[{"name": "srv", "failure": {"reason": "<nxdomain>"}}]),
        FLEET,
        Query(),
    )
    assert "<td>reason: &lt;nxdomain&gt;</td>" in nested


def test_unreachable_redis_says_so() -> None:
    html = render_page(None, Fleet("p0", "1", 2000, reachable=False, error="Redis down"), Query())
    assert "unreachable" in html and "Redis down" in html and "endpoint-table" not in html


# --- the routes on a real HealthServer ----------------------------------------------------


def get(port: int, path: str) -> tuple[int, dict[str, str], str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


async def test_routes_serve_the_page_its_files_and_the_same_view_as_the_reader() -> None:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    store = RedisStore(client, "pg")
    await store.ensure_schema()
    await store.heartbeat("p0", 5000)
    for endpoint_id in ("a", "b", "c"):
        await store.put_endpoint(Endpoint(id=endpoint_id, url="http://127.0.0.1:9"))
    tokens = {a.endpoint_id: a.token for a in await store.acquire_leases("p0", ["a", "b"], 10_000)}
    fields = {"engine": "vllm", "running": "4", "waiting": "1", "interval_ms": "60000"}
    assert (await store.write_stats("a", "p0", tokens["a"] or 0, fields, lease_ttl_ms=10_000,
                                    stats_ttl_ms=10_000)).accepted  # fmt: skip
    assert (await store.write_failure("b", "p0", tokens["b"] or 0, reason="timeout",
                                      detail="1 s", lease_ttl_ms=10_000,
                                      failure_ttl_ms=10_000)).accepted  # fmt: skip
    await store.heartbeat("p1", 5000)  # another poller, whose version comes from Redis
    page = OperatorPage(client, "pg", "p0", 2000)
    health = HealthServer(
        "127.0.0.1", 0, ready=lambda: True, registry=CollectorRegistry(), raw_routes=page.routes()
    )
    port = await health.start()
    try:
        status, headers, html = await asyncio.to_thread(get, port, "/")
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert headers["Content-Security-Policy"] == CSP
        assert re.search(
            r'data-id="p1">.*?beat">[0-9.]+s<.*?version">' + re.escape(__version__), html
        )
        assert "script-src 'self'" in CSP and "style-src 'self'" in CSP
        expected = (await StatsReader(client, "pg").snapshot()).to_dict()
        states = {e["id"]: e["state"] for e in expected["endpoints"]}
        assert states == {"a": "fresh", "b": "failing", "c": "unknown"}
        assert {r["id"]: r["state"] for r in rows_of(html)} == states
        for path, ctype in (
            ("/static/page.js", "text/javascript"),
            ("/static/page.css", "text/css"),
        ):
            status, headers, body = await asyncio.to_thread(get, port, path)
            assert status == 200 and headers["Content-Type"].startswith(ctype) and body
            assert headers["X-Content-Type-Options"] == "nosniff"
        status, headers, body = await asyncio.to_thread(get, port, "/?state=bogus")
        assert status == 400 and body.startswith("unknown state 'bogus'")
        assert body.count("\n") == 1
        status, _, _ = await asyncio.to_thread(get, port, "/static/other.js")
        assert status == 404
    finally:
        await health.stop()
        await client.aclose()


async def test_a_failing_raw_route_is_a_500_and_the_server_lives_on() -> None:
    async def broken(query: str) -> Response:
        raise KeyError(query)

    async def echo(query: str) -> Response:
        return Response(200, "text/plain", query.encode(), (("X-Test", "1"),))

    health = HealthServer(
        "127.0.0.1",
        0,
        ready=lambda: True,
        registry=CollectorRegistry(),
        raw_routes={"/broken": broken, "/echo": echo},
    )
    port = await health.start()
    try:
        status, _, body = await asyncio.to_thread(get, port, "/broken?x=1")
        assert status == 500 and body == "internal error\n"
        status, headers, body = await asyncio.to_thread(get, port, "/echo?a=1&b=%3C")
        assert status == 200 and body == "a=1&b=%3C" and headers["X-Test"] == "1"
        status, _, body = await asyncio.to_thread(get, port, "/healthz")
        assert status == 200 and body == "ok\n"
    finally:
        await health.stop()


@pytest.mark.slow  # seconds of the client's connection attempts to a closed port
async def test_page_says_redis_is_unreachable_with_503() -> None:
    client = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    page = OperatorPage(client, "pg", "p0", 2000)
    response = await page.page("")
    assert response.status == 503 and b"unreachable" in response.body
    await client.aclose()


async def test_the_page_reads_the_view_through_the_reader_it_is_given() -> None:
    """The page and /v1/view share one StatsReader: the page's view is its snapshot, the
    fleet table's heartbeats and drains are the members' records."""
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    store = RedisStore(client, "pg")
    await store.ensure_schema()
    await store.heartbeat("p0", 5000)
    await store.heartbeat("p1", 5000)
    await client.hset(Keys("pg").members_drain, "p1", '{"since_ms": 1, "by": "cli"}')
    await store.put_endpoint(Endpoint(id="a", url="http://127.0.0.1:9"))

    class Counting(StatsReader):
        snapshots = 0

        async def snapshot(self) -> Any:
            self.snapshots += 1
            return await super().snapshot()

    reader = Counting(client, "pg")
    page = OperatorPage(client, "pg", "p0", 2000, reader=reader)
    try:
        view, fleet = await page.read()
        assert reader.snapshots == 1 and page.reader is reader
        assert view is not None and [e["id"] for e in view["endpoints"]] == ["a"]
        assert view["pollers"] == ["p0", "p1"] and fleet.schema == "1"
        assert fleet.expiries is not None and set(fleet.expiries) == {"p0", "p1"}
        assert fleet.infos is not None and fleet.infos["p1"]["member_ttl_ms"] == 5000
        assert fleet.drains == {"p1"}
        response = await page.page("")
        assert response.status == 200 and reader.snapshots == 2
        assert b"drain requested" in response.body
    finally:
        await client.aclose()


async def test_another_schema_version_is_a_503_that_says_so() -> None:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    await client.set(Keys("pg").schema, "2")
    try:
        response = await OperatorPage(client, "pg", "p0", 2000).page("")
        assert response.status == 503 and b"Redis holds schema 2" in response.body
    finally:
        await client.aclose()


# --- in a real browser ---------------------------------------------------------------------

ROWS_JS = """Array.from(document.querySelectorAll('tr.endpoint')).map(r => ({
  id: r.querySelector('td.id').firstChild.textContent, state: r.dataset.state,
  failure: r.querySelector('td.failure').textContent,
  background: getComputedStyle(r).backgroundColor}))"""


# Chromium and a poller process on a loaded 2-core machine: every wait for the page to
# change gets ample headroom (each is milliseconds to a second when idle).
PAGE_WAIT_S = 60


@pytest.mark.slow
@pytest.mark.chromium
async def test_in_headless_chromium(own_redis: RedisProcess, tmp_path: Path) -> None:
    ns = "page"
    sim, admin, registry = start_sim(tmp_path, 7, "vllm,sglang,llamacpp,tgi", cpu=None)
    poller = None
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        entries = json.loads(registry.read_text())
        first, late = entries[:6], entries[6]
        registry.write_text(json.dumps(first))
        await sync_registry(own_redis.url, ns, registry)
        failing = first[1]["id"]
        await asyncio.to_thread(
            http_json, f"{admin}/admin/endpoints/{failing}/fault", {"mode": "http500"}
        )
        poller = PollerProc("p0", own_redis.url, ns, tmp_path).start()
        reader = StatsReader(client, ns)

        async def settled() -> bool:
            states = (await reader.snapshot()).counts()
            return states["fresh"] == 5 and states["failing"] == 1

        await until(settled, PAGE_WAIT_S, "five fresh endpoints and one failing")
        url = f"http://127.0.0.1:{poller.health_port}/"
        async with Browser() as browser:
            await browser.goto(url)
            await browser.wait_js(
                "document.getElementById('live').className === 'ok'",
                PAGE_WAIT_S,
                "the first refresh",
            )
            # The page and `poller status --json` agree (both move: compare until they meet,
            # since a loaded machine may flip a state between the two reads).
            rows: dict[str, Any] = {}
            expected: dict[str, str] = {}

            async def agree() -> bool:
                nonlocal rows, expected
                rows = {r["id"]: r for r in await browser.js(ROWS_JS)}
                snapshot = (await reader.snapshot()).to_dict()
                expected = {e["id"]: e["state"] for e in snapshot["endpoints"]}
                return {i: r["state"] for i, r in rows.items()} == expected

            try:
                await until(agree, PAGE_WAIT_S, "the page to show the reader's states", 0.5)
            except AssertionError:
                raise AssertionError(f"page {rows} vs reader {expected}") from None
            assert rows[failing]["state"] == "failing"
            assert rows[failing]["failure"].startswith("http_status for")
            fresh = next(r for r in rows.values() if r["state"] == "fresh")
            assert rows[failing]["background"] != fresh["background"]

            # A registry change shows up without a reload (the marker would be gone).
            await browser.js("window.__marker = 42")
            store = RedisStore(client, ns)
            await store.put_endpoint(Endpoint.model_validate(late))
            await browser.wait_js(
                f"!!document.querySelector('tr.endpoint[data-id=\"{late['id']}\"]')",
                PAGE_WAIT_S,
                "the new endpoint's row",
            )
            # A foreign writer's id carrying markup is text, never code.
            keys = Keys(ns)
            await client.hset(keys.endpoints, HOSTILE, json.dumps({"url": "http://127.0.0.1:9"}))
            await client.incr(keys.endpoints_rev)
            found = await browser.wait_js(
                "Array.from(document.querySelectorAll('tr.endpoint td.id'))"
                f".some(td => td.firstChild.textContent === {json.dumps(HOSTILE)})",
                PAGE_WAIT_S,
                "the hostile id as text",
            )
            assert found
            assert await browser.js("window.__marker") == 42
            assert await browser.js("typeof window.__pwned") == "undefined"
            assert await browser.js("document.scripts.length") == 1
            # The load pictures grow from what the page observed.
            await browser.wait_js(
                "Array.from(document.querySelectorAll('td.load svg polyline.run'))"
                ".some(p => p.getAttribute('points').split(' ').length >= 3)",
                PAGE_WAIT_S,
                "a load picture with three samples",
            )
            # Sorting by a header link: in place, shareable in the address bar.
            await browser.js("document.querySelector('th.running a.sort').click()")
            await browser.wait_js(
                "location.search === '?sort=running&order=desc' && "
                "document.querySelector('th.running a').textContent.includes('▼')",
                PAGE_WAIT_S,
                "the table sorted by running",
            )
            running = await browser.js(
                "Array.from(document.querySelectorAll('tr.endpoint td.running'))"
                ".map(td => td.textContent).filter(t => t !== '-').map(Number)"
            )
            assert len(running) >= 5 and running == sorted(running, reverse=True)
            # Filtering with the form: in place too, and the link says so.
            await browser.js(
                "{ const s = document.querySelector('#filters select[name=state]');"
                "s.value = 'failing'; s.dispatchEvent(new Event('change', {bubbles: true})); }"
            )
            await browser.wait_js(
                "location.search === '?state=failing&sort=running&order=desc' && "
                "document.querySelectorAll('tr.endpoint').length === 1",
                PAGE_WAIT_S,
                "only the failing row",
            )
            assert await browser.js("document.querySelector('tr.endpoint').dataset.id") == failing
            assert await browser.js("window.__marker") == 42
            await browser.js("history.back()")
            await browser.wait_js(
                "document.querySelectorAll('tr.endpoint').length === 8",
                PAGE_WAIT_S,
                "every row again",
            )
            shot = await browser.screenshot(tmp_path / "operator-page.png")
            assert shot.stat().st_size > 10_000
            if os.environ.get("POLLER_PAGE_SCREENSHOT"):  # refreshes docs/operator-page.png
                shutil.copy(shot, os.environ["POLLER_PAGE_SCREENSHOT"])
            # No CSP violation, no script error, no failed request: a clean console.
            assert not browser.log, browser.log
            # And the policy holds: markup that slipped in could not run inline code.
            await browser.js(
                "{ const s = document.createElement('script');"
                "s.textContent = 'window.__inline = 1'; document.body.append(s); }"
            )
            assert await browser.js("typeof window.__inline") == "undefined"
            await until(
                lambda: any("Content Security Policy" in line for line in browser.log),
                PAGE_WAIT_S,
                "Chromium's report of the blocked inline script",
            )

            # Scripts off: the plain page, filtered by the link, reloads itself.
            await browser.send("Emulation.setScriptExecutionDisabled", session=True, value=True)
            await browser.goto(url + "?state=failing")
            await browser.send("Emulation.setScriptExecutionDisabled", session=True, value=False)
            rows = await browser.js(ROWS_JS)
            assert [r["id"] for r in rows] == [failing]
            assert (await browser.js("document.getElementById('live').textContent")).startswith(
                "scripts off"
            )
            assert not await browser.js("document.querySelector('td.load svg')")
    finally:
        if poller is not None:
            poller.cleanup()
        sim.stop()
        await client.aclose()


def test_rows_show_url_labels_and_the_registry_engine_of_a_failing_endpoint() -> None:
    failure = {"reason": "unreachable", "detail": "refused", "since_ms": 990_000, "missing": []}
    never_read = endpoint(
        "a", "failing", engine=None, running=None, failure=failure, registry_engine="sglang",
        url="http://10.0.0.9:30000", labels={"zone": "b", "pool": "x"},
    )  # fmt: skip
    default_engine = endpoint("b", "unknown", engine=None, running=None, registry_engine=None)
    rows = {
        r["id"]: r for r in rows_of(render_main(view(never_read, default_engine), FLEET, Query()))
    }
    assert rows["a"]["cells"]["id"] == "ahttp://10.0.0.9:30000pool=x,zone=b"
    assert rows["a"]["cells"]["engine"] == "sglang"
    assert rows["b"]["cells"]["engine"] == "default"  # the pollers' scrape.default_engine


def test_ages_have_one_format() -> None:
    from poller.service.web.format import fmt_age

    assert [fmt_age(ms) for ms in (None, 0, 7_200, 12_345, 59_999, 60_000, 245_000, 7_380_000)] == [
        "-", "0.0s", "7.2s", "12.3s", "59.9s", "1m00s", "4m05s", "2h03m",
    ]  # fmt: skip
