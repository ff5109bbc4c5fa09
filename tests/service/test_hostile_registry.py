"""Registry entries from a foreign or buggy writer, against a real ``poller run``.

One poller runs against a registry full of hostile entries (bad JSON, wrong types, inline
secrets, credentials in URLs, ids with spaces, newlines or a megabyte): each bad entry gets
a config failure naming the problem or is ignored with one short log line, the good
endpoints stay fresh, nothing forges a log line or an event, and the inline secret stays
where its writer put it. A value that is not UTF-8 and a blank page just inside the body
cap do not stop the poller or starve the other endpoints.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from poller.config import RedisSettings
from poller.errors import ConfigError, StoreError
from poller.reader import StatsReader
from poller.reader.view import View
from poller.schema.endpoint import Endpoint, endpoint_from_dict, validate_endpoint_id
from poller.store.store import RedisStore
from poller.util.logs import quote
from poller_lab.sim import EndpointSpec, Simulator
from tests.support.hostile import CAP, NS, MiB, collect_events, dump_redis
from tests.support.httpserver import HTTPServer, answer
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess

pytestmark = pytest.mark.redis_server  # the module-scoped run starts its own redis-server


INLINE_SECRET = "sk-inline-" + secrets.token_hex(12)
FORGED = "2030-01-01 00:00:00,000 level=ERROR logger=poller FORGED by a registry id"
HUGE_ID = "x" * MiB


def _bad_entries(url: str) -> dict[str, tuple[str, str]]:
    """id -> (raw JSON value, what the failure detail must say)."""

    def entry(**fields: Any) -> str:
        return json.dumps({"url": url, **fields})

    return {
        "bad-json": ("{not json", "not valid JSON"),
        "empty-value": ("", "not valid JSON"),
        "deep-nesting": ("[" * 5000, "recursion"),
        "non-object-list": ("[1, 2, 3]", "must be a JSON object"),
        "non-object-string": (json.dumps(url), "must be a JSON object"),
        "json-null": ("null", "must be a JSON object"),
        "wrong-type-url": (json.dumps({"url": 123}), "url: should be a valid string, got 123"),
        "wrong-type-interval": (entry(interval_s="fast"), "interval_s: should be a valid number"),
        "nan-interval": (entry(interval_s=math.nan), "interval_s"),
        # A typo that would scrape the engine hundreds of times a second.
        "tiny-interval": (entry(interval_s=0.001), "interval_s: should be at least 0.05"),
        "wrong-type-labels": (entry(labels={"k": 1}), "labels.k"),
        "unknown-engine": (entry(engine="gpt-5"), "unknown engine 'gpt-5'"),
        "unknown-field": (entry(colour="blue"), "unknown key `colour`"),
        "huge-entry": (entry(labels={"x": "a" * MiB}), "limit 16384"),
        "id-mismatch": (entry(id="good-vllm"), "entry's id 'good-vllm' differs from its key"),
        "inline-api-key": (entry(api_key=INLINE_SECRET), "inline secret field 'api_key'"),
        "inline-headers": (
            entry(headers={"Authorization": f"Bearer {INLINE_SECRET}"}),
            "inline secret field 'headers'",
        ),
        "url-credentials": (
            json.dumps({"url": f"http://alice:{INLINE_SECRET}@127.0.0.1:9"}),
            "credentials in the URL are not allowed",
        ),
        "scheme-ftp": (json.dumps({"url": "ftp://127.0.0.1/x"}), "scheme must be http or https"),
        "scheme-file": (json.dumps({"url": "file:///etc/passwd"}), "got 'file'"),
        "scheme-unix": (json.dumps({"url": "unix:///run/docker.sock"}), "got 'unix'"),
        "bad-env-name": (entry(api_key_env="PATH; rm -rf /"), "is not an environment variable"),
        "bad id": (entry(engine="vllm"), "invalid endpoint id 'bad id'"),
        f"forged\n{FORGED}": (entry(), "invalid endpoint id"),
    }


# Entries the validator accepts but the scraper cannot use: they must fail (config or
# unreachable), never go unrecorded.
BAD_URLS = {
    "url-tab": "http://127.0.0.1:9\t/x",  # urlsplit drops \t\r\n; httpx.InvalidURL later
    "url-newline": "http://127.0.0.1:9\n",
    "url-long-label": "http://a" + "b" * 80 + ".example",  # idna: label too long (aiohttp)
    "url-empty-punycode": "http://xn--:9",  # idna.IDNAError in both clients
}


def _unusable(endpoint_id: str) -> bool:
    try:
        validate_endpoint_id(endpoint_id)
    except ConfigError:
        return True
    return False


# Ids that break keys, events or log lines (spaces, newlines, 1 MB): pollers leave them
# alone and log them once, shortened, instead of failing them under unusable keys.
UNUSABLE = {e for e in [*_bad_entries("http://x"), HUGE_ID] if _unusable(e)}


@dataclass
class RegistryRun:
    view: View
    later: View
    log: str
    events: list[str]
    keys: list[str]
    values: bytes
    exit_code: int | None
    bad: dict[str, str] = field(default_factory=dict)


def _progress(view: View, endpoint_id: str) -> tuple[int, int]:
    """What grows with every scrape of an endpoint: its stats' time, its failure count."""
    entry = view[endpoint_id]
    failure = entry.failure
    scraped_ms = entry.timing.scraped_at_ms if entry.timing is not None else None
    return (scraped_ms or 0, failure.count if failure is not None else 0)


def _rescraped(reader: StatsReader, before: View, ids: list[str]) -> Callable[[], Any]:
    """A condition for ``until``: a snapshot where each of ``ids`` moved on since ``before``."""

    async def check() -> View | None:
        view = await reader.snapshot()
        moved = all(_progress(view, e) > _progress(before, e) for e in ids)
        return view if moved else None

    return check


async def _registry_scenario(server: RedisProcess, log_dir: Path) -> RegistryRun:
    async with Simulator(
        [EndpointSpec("good-vllm", "vllm"), EndpointSpec("good-llama", "llamacpp")], seed=7
    ) as sim:
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        bad = _bad_entries(sim.base_url("good-vllm"))
        raw = {
            e["id"]: json.dumps({k: v for k, v in e.items() if k != "id"}) for e in sim.registry()
        }
        raw |= {endpoint_id: value for endpoint_id, (value, _) in bad.items()}
        raw |= {endpoint_id: json.dumps({"url": url}) for endpoint_id, url in BAD_URLS.items()}
        raw[HUGE_ID] = json.dumps({"url": sim.base_url("good-vllm")})  # a 1 MB hash field
        # A foreign writer: straight HSET into the hash, then the revision bump it owes.
        await client.hset(f"{{{NS}}}:endpoints", mapping=raw)
        await client.incr(f"{{{NS}}}:endpoints:rev")
        events: list[str] = []
        ready = asyncio.Event()
        collector = asyncio.create_task(collect_events(client, NS, events, ready))
        await asyncio.wait_for(ready.wait(), 30)
        reader = StatsReader(client, NS)
        poller = PollerProc("p0", server.url, NS, log_dir).start()
        try:

            async def settled() -> View | None:
                view = await reader.snapshot()
                good = all(view[e].state == "fresh" for e in sim.ids)
                failing = all(
                    (f := view[e].failure) is not None and f.reason == "config"
                    for e in [*bad, HUGE_ID]
                    if e not in UNUSABLE
                )
                return view if good and failing else None

            view = await until(settled, 20, "good endpoints fresh and bad ones failing")
            assert isinstance(view, View)
            # Two more rounds, counted: every endpoint scraped (or failed) twice after `view`.
            tracked = [*sim.ids, *(e for e in [*bad, *BAD_URLS] if e not in UNUSABLE)]
            mid = await until(_rescraped(reader, view, tracked), 30, "every endpoint re-scraped")
            assert isinstance(mid, View)
            later = await until(_rescraped(reader, mid, tracked), 30, "a second round")
            assert isinstance(later, View)
            keys, values = await dump_redis(client)
            poller.signal(signal.SIGTERM)
            exit_code = await asyncio.to_thread(poller.wait, 10)
        finally:
            poller.cleanup()
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)
            await client.aclose()
    log = await asyncio.to_thread(poller.log)
    return RegistryRun(
        view, later, log, events, keys, values, exit_code, {e: d for e, (_, d) in bad.items()}
    )


@pytest.fixture(scope="module")
def registry_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryRun]:
    """One real poller against a registry full of hostile entries, shared by the tests
    below (each asserts one property of the same run)."""
    server = RedisProcess().start()
    try:
        yield asyncio.run(_registry_scenario(server, tmp_path_factory.mktemp("registry")))
    finally:
        server.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize(
    "endpoint_id",
    sorted(_bad_entries("http://x"), key=lambda e: e[:40]),
    ids=lambda e: e[:30].replace("\n", "\\n"),
)
def test_bad_registry_entry_gets_a_config_failure_naming_the_problem(
    registry_run: RegistryRun, endpoint_id: str
) -> None:
    if endpoint_id in UNUSABLE:
        assert registry_run.later[endpoint_id].failure is None
        unusable = f"registry id unusable; ignoring it endpoint={quote(endpoint_id[:100])}"
        assert unusable in registry_run.log
        return
    for view in (registry_run.view, registry_run.later):
        failure = view[endpoint_id].failure
        assert failure is not None and failure.reason == "config"
        assert registry_run.bad[endpoint_id] in failure.detail, failure.detail
        assert len(failure.detail) <= 1000  # the schema's bound, even for the 1 MB id
    assert registry_run.later[endpoint_id].failure.count >= 2  # type: ignore[union-attr]


@pytest.mark.slow
def test_megabyte_id_is_ignored_and_logged_briefly(registry_run: RegistryRun) -> None:
    # No lease, no failure under a 1 MB key, no 1 MB events or log lines: one short line.
    assert registry_run.later[HUGE_ID].failure is None
    assert not [k for k in registry_run.keys if HUGE_ID in k]
    assert max(len(line) for line in registry_run.log.splitlines()) < 2000
    assert not [e for e in registry_run.events if len(e) > 1000]


@pytest.mark.slow
def test_good_endpoints_stay_fresh_next_to_bad_entries(registry_run: RegistryRun) -> None:
    for view in (registry_run.view, registry_run.later):
        assert view["good-vllm"].state == "fresh" and view["good-llama"].state == "fresh"
        assert view["good-vllm"].stats.running >= 0  # type: ignore[union-attr]
    assert registry_run.later.pollers == ["p0"]
    assert registry_run.exit_code == 0  # and it still shuts down cleanly


@pytest.mark.slow
def test_inline_secret_stays_in_the_entry_its_writer_put_it_in(registry_run: RegistryRun) -> None:
    # The foreign writer put it in the registry hash; nothing the poller writes repeats it.
    assert INLINE_SECRET not in registry_run.log
    assert INLINE_SECRET not in registry_run.later.to_json()
    assert not [e for e in registry_run.events if INLINE_SECRET in e]
    outside = [
        line
        for line in registry_run.values.split(b"\n")
        if INLINE_SECRET.encode() in line and not line.startswith(f"{{{NS}}}:endpoints=".encode())
    ]
    assert outside == []


@pytest.mark.slow
def test_id_with_a_space_is_left_alone(registry_run: RegistryRun) -> None:
    # An id the schema forbids would make events ambiguous ("failure bad id config" reads
    # as endpoint "bad"): the poller takes no lease on it and writes nothing under it.
    assert not [k for k in registry_run.keys if k.endswith(":bad id") or k.endswith(":bad")]
    assert 'registry id unusable; ignoring it endpoint="bad id"' in registry_run.log


@pytest.mark.slow
def test_every_event_names_one_registered_id(registry_run: RegistryRun) -> None:
    registered = set(registry_run.view.endpoints)
    odd = []
    for event in registry_run.events:
        parts = event.split(" ")
        kind = parts[0]
        if kind == "endpoints":
            continue
        expected = 3 if kind in ("stats", "failure") else 2
        if len(parts) != expected or parts[1] not in registered:
            odd.append(event[:80])
    assert odd == []


@pytest.mark.slow
def test_registry_ids_cannot_forge_log_lines(registry_run: RegistryRun) -> None:
    assert not [line for line in registry_run.log.splitlines() if line.startswith(FORGED)]


@pytest.mark.slow
@pytest.mark.parametrize("endpoint_id", sorted(BAD_URLS))
def test_url_the_client_rejects_is_a_failure_not_silence(
    registry_run: RegistryRun, endpoint_id: str
) -> None:
    failure = registry_run.later[endpoint_id].failure
    assert failure is not None and failure.reason in ("config", "unreachable"), registry_run.later[
        endpoint_id
    ]


async def test_non_utf8_registry_value_is_an_invalid_entry(redis_server: RedisProcess) -> None:
    # The clients the poller builds (connect()) decode with U+FFFD: the entry is invalid,
    # the others are fine. A caller's own strict client gets a StoreError, not a crash.
    store = RedisStore.from_settings(RedisSettings(url=redis_server.url, namespace="t"))
    try:
        await store.client.flushall()
        await store.client.hset("{t}:endpoints", "ok", json.dumps({"url": "http://127.0.0.1:9"}))
        await store.client.hset("{t}:endpoints", "binary", b'{"url": "http://\xff"}')
        registry = await store.read_registry()
        assert set(registry.endpoints) == {"ok"} and "binary" in registry.invalid
    finally:
        await store.close()
    strict = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        with pytest.raises(StoreError, match="invalid UTF-8"):
            await RedisStore(strict, "t").read_registry()
    finally:
        await strict.aclose()


@pytest.mark.slow
async def test_non_utf8_registry_value_does_not_stop_the_poller(
    own_redis: RedisProcess, tmp_path: Path
) -> None:
    async with Simulator([EndpointSpec("good-vllm", "vllm")], seed=3) as sim:
        client = aioredis.Redis.from_url(own_redis.url)  # bytes: the value is not UTF-8
        await client.hset(
            f"{{{NS}}}:endpoints", "good-vllm", json.dumps({"url": sim.base_url("good-vllm")})
        )
        await client.hset(f"{{{NS}}}:endpoints", "binary", b'{"url": "http://\xff"}')
        reader = StatsReader.from_url(own_redis.url, NS)  # decodes with U+FFFD, like pollers
        with_poller = PollerProc("p0", own_redis.url, NS, tmp_path).start()
        try:

            async def good_fresh() -> bool:
                view = await reader.snapshot()
                binary = view["binary"]
                return view["good-vllm"].state == "fresh" and binary.failure is not None

            await until(good_fresh, 30, "good endpoint scraped despite one binary entry")
        finally:
            with_poller.cleanup()
            await client.aclose()
            await reader.aclose()


@pytest.mark.slow
async def test_page_inside_the_cap_does_not_starve_other_endpoints(
    own_redis: RedisProcess, tmp_path: Path
) -> None:
    blank = b"\n" * (CAP - 1)
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    reader = StatsReader(client, NS)
    try:
        async with (
            HTTPServer(lambda r: answer(200, blank)) as blank_server,
            Simulator([EndpointSpec(f"good-{i}", "vllm") for i in range(3)], seed=4) as sim,
        ):
            store = RedisStore(client, NS)
            for e in sim.registry():
                await store.put_endpoint(endpoint_from_dict(None, e))
            poller = PollerProc("p0", own_redis.url, NS, tmp_path).start()
            try:
                await until(lambda: _all_fresh(reader, sim.ids), 30, "good endpoints fresh")
                await store.put_endpoint(Endpoint(id="blank-page", url=blank_server.url))
                # Watched for six scrapes of the blank page (counted, not timed); the
                # deadline only ends a hang.
                deadline = time.monotonic() + 60
                while True:
                    view = await reader.snapshot()
                    states = {e: view[e].state for e in sim.ids}
                    assert set(states.values()) == {"fresh"}, states
                    if _progress(view, "blank-page")[1] >= 6:
                        break
                    assert time.monotonic() < deadline, "the blank page was not scraped 6 times"
                    await asyncio.sleep(0.1)  # sampling; the count above ends the watch
            finally:
                poller.cleanup()
    finally:
        await client.aclose()


async def _all_fresh(reader: StatsReader, ids: list[str]) -> bool:
    view = await reader.snapshot()
    return all(e in view.endpoints and view[e].state == "fresh" for e in ids)
