from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redisproc import RedisCluster, RedisProcess

from poller.reader import StatsReader, SyncStatsReader
from poller.reader.pick import pick
from poller.reader.view import EndpointView, View
from poller.redis.store import RedisStore
from poller.registry import Endpoint

NS = "r"


def fields(
    running: int = 1, waiting: int = 0, kv: float = 0.5, interval_ms: int = 1000, **extra: str
) -> dict[str, str]:
    return {
        "engine": "vllm",
        "running": str(running),
        "waiting": str(waiting),
        "kv_cache_usage": str(kv),
        "interval_ms": str(interval_ms),
        "scrape_ms": "1.5",
        **extra,
    }


async def setup(store: RedisStore, *ids: str) -> dict[str, int]:
    tokens = {}
    await store.heartbeat("p1", 5000)
    for endpoint_id in ids:
        await store.put_endpoint(Endpoint(id=endpoint_id, url="http://127.0.0.1:9"))
    for acquired in await store.acquire_leases("p1", list(ids), 10_000):
        assert acquired.token is not None
        tokens[acquired.endpoint_id] = acquired.token
    return tokens


async def write(store: RedisStore, endpoint_id: str, token: int, **kw: object) -> None:
    result = await store.write_stats(
        endpoint_id,
        "p1",
        token,
        fields(**kw),  # type: ignore[arg-type]
        lease_ttl_ms=10_000,
        stats_ttl_ms=10_000,
    )
    assert result.accepted


async def fail(store: RedisStore, endpoint_id: str, token: int, reason: str = "timeout") -> None:
    result = await store.write_failure(
        endpoint_id,
        "p1",
        token,
        reason=reason,
        detail="d",
        lease_ttl_ms=10_000,
        failure_ttl_ms=10_000,
    )
    assert result.accepted


@pytest.fixture
async def rstore(real_client: aioredis.Redis) -> RedisStore:
    return RedisStore(real_client, NS)


@pytest.fixture
def reader(real_client: aioredis.Redis) -> StatsReader:
    return StatsReader(real_client, NS)


async def test_states_for_every_case(rstore: RedisStore, reader: StatsReader) -> None:
    t = await setup(
        rstore, "never", "fresh", "stale", "failing", "failing-new", "recovered", "expired"
    )
    await write(rstore, "fresh", t["fresh"], running=7)
    await write(rstore, "stale", t["stale"], interval_ms=10)  # stale after 20 ms
    await write(rstore, "failing", t["failing"])
    await fail(rstore, "failing", t["failing"])
    await fail(rstore, "failing-new", t["failing-new"], "auth")
    await fail(rstore, "recovered", t["recovered"])
    await write(rstore, "recovered", t["recovered"])
    await rstore.write_stats(
        "expired", "p1", t["expired"], fields(), lease_ttl_ms=10_000, stats_ttl_ms=50
    )
    await asyncio.sleep(0.1)

    view = await reader.snapshot()
    states = {e: v.state for e, v in view.endpoints.items()}
    assert states == {
        "never": "unknown",
        "fresh": "fresh",
        "stale": "stale",
        "failing": "failing",
        "failing-new": "failing",
        "recovered": "fresh",
        "expired": "unknown",
    }
    fresh = view["fresh"]
    assert fresh.stats is not None and fresh.stats.running == 7 and fresh.owner == "p1"
    assert fresh.token == t["fresh"] and fresh.age_ms is not None and 0 <= fresh.age_ms < 1000
    assert view["stale"].age_ms is not None and view["stale"].age_ms >= 50
    failing = view["failing"]
    assert failing.failure is not None and failing.failure.reason == "timeout"
    assert failing.stats is not None  # last good stats, shown with their age
    assert view["failing-new"].stats is None and view["failing-new"].failure is not None
    assert view.pollers == ["p1"]
    assert view.counts() == {"fresh": 2, "stale": 1, "failing": 2, "unknown": 2}
    one = await reader.get("failing")
    assert one is not None and one.state == "failing"
    assert await reader.get("nope") is None
    assert await reader.live_pollers() == ["p1"]


async def test_freshness_bound_is_per_endpoint_and_overridable(
    rstore: RedisStore, real_client: aioredis.Redis
) -> None:
    t = await setup(rstore, "fast", "slow")
    await write(rstore, "fast", t["fast"], interval_ms=100)
    await write(rstore, "slow", t["slow"], interval_ms=10_000)
    await asyncio.sleep(0.35)
    view = await StatsReader(real_client, NS).snapshot()
    assert (view["fast"].state, view["slow"].state) == ("stale", "fresh")
    strict = await StatsReader(real_client, NS, stale_after_ms=100).snapshot()
    assert strict["slow"].state == "stale"


async def test_snapshot_is_atomic(rstore: RedisStore, reader: StatsReader) -> None:
    t = await setup(rstore, "e")
    stop = asyncio.Event()

    async def writer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            await write(rstore, "e", t["e"], running=n, waiting=n, kv=0.5 if n % 2 else 0.25)

    task = asyncio.create_task(writer())
    seen = set()
    for _ in range(200):
        stats = (await reader.snapshot())["e"].stats
        if stats is not None:
            assert stats.running == stats.waiting  # never half of one write
            assert stats.seq == stats.running
            seen.add(stats.seq)
    stop.set()
    await task
    assert len(seen) > 5


async def test_cached_mode_follows_events_and_resyncs(
    rstore: RedisStore, real_client: aioredis.Redis
) -> None:
    t = await setup(rstore, "a", "b")
    reader = StatsReader(real_client, NS, resync_s=0.5)
    async with reader.cached() as cache:
        assert cache.healthy and sorted(cache.ids()) == ["a", "b"]
        a = cache.get("a")
        assert a is not None and a.state == "unknown"
        await write(rstore, "a", t["a"], running=3)
        await wait_for(lambda: (e := cache.get("a")) is not None and e.state == "fresh")
        # a missed event (a write whose message never arrived) is corrected by the resync
        k = rstore.keys
        await rstore._write_stats(
            keys=[
                k.lease("a"),
                k.stats("a"),
                k.failure("a"),
                "{r}:lost-events",
                k.view_stats,
                k.view_failures,
            ],
            args=[
                f"p1 {t['a']}",
                10_000,
                10_000,
                "a",
                *[x for kv in fields(running=42).items() for x in kv],
            ],
        )
        await wait_for(
            lambda: (
                (e := cache.get("a")) is not None and e.stats is not None and e.stats.running == 42
            ),
            timeout_s=3,
        )
        # registry changes arrive as a full resync
        await rstore.put_endpoint(Endpoint(id="c", url="http://127.0.0.1:9"))
        await wait_for(lambda: cache.get("c") is not None)
        await rstore.remove_endpoint("b")
        await wait_for(lambda: cache.get("b") is None)
        # ages grow between events
        first = cache.get("a")
        await asyncio.sleep(0.05)
        second = cache.get("a")
        assert first and second and first.age_ms is not None and second.age_ms is not None
        assert second.age_ms >= first.age_ms + 40


async def wait_for(cond, timeout_s: float = 2.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_cached_mode_survives_a_redis_restart(own_redis: RedisProcess) -> None:
    client = aioredis.Redis.from_url(
        own_redis.url, decode_responses=True, socket_timeout=0.5, socket_connect_timeout=0.5
    )
    store = RedisStore(client, NS)
    t = await setup(store, "a")
    await write(store, "a", t["a"])
    reader = StatsReader(client, NS, resync_s=0.3)
    async with reader.cached() as cache:
        assert cache.get("a") is not None and cache.get("a").state == "fresh"  # type: ignore[union-attr]
        own_redis.stop()
        await wait_for(lambda: not cache.healthy, timeout_s=5)
        stale = cache.get("a")
        assert stale is not None and stale.state == "stale"  # never "fresh" while blind
        assert cache.view().counts()["fresh"] == 0
        own_redis.start()
        t = await setup(store, "a")
        await write(store, "a", t["a"], running=9)
        await wait_for(
            lambda: (
                cache.healthy
                and (e := cache.get("a")) is not None
                and e.state == "fresh"
                and e.stats is not None
                and e.stats.running == 9
            ),
            timeout_s=8,
        )
    await client.aclose()


def test_sync_reader(redis_server: RedisProcess) -> None:
    async def prepare() -> None:
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        await client.flushall()
        store = RedisStore(client, NS)
        t = await setup(store, "a", "b")
        await write(store, "a", t["a"], running=5)
        await client.aclose()

    asyncio.run(prepare())
    reader = SyncStatsReader.from_url(redis_server.url, NS, resync_s=0.3)
    try:
        view = reader.snapshot()
        assert view["a"].state == "fresh" and view["b"].state == "unknown"
        assert reader.live_pollers() == ["p1"]
        a = reader.get("a")
        assert a is not None and a.stats is not None and a.stats.running == 5
        with reader.cached() as cache:
            assert cache.healthy and cache.get("a") is not None

            async def more() -> None:
                client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
                store = RedisStore(client, NS)
                holder = await store.lease_holder("b")
                assert holder is not None
                await write(store, "b", holder[1], running=8)
                await client.aclose()

            asyncio.run(more())
            deadline = time.monotonic() + 3
            while (e := cache.get("b")) is None or e.state != "fresh":
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        reader.close()


async def test_snapshot_on_cluster(redis_cluster: RedisCluster) -> None:
    client = aioredis.RedisCluster.from_url(redis_cluster.url, decode_responses=True)
    try:
        await client.flushall(target_nodes=aioredis.RedisCluster.PRIMARIES)
        store = RedisStore(client, NS)
        t = await setup(store, "a", "b")
        await write(store, "a", t["a"], running=4)
        view = await StatsReader(client, NS).snapshot()
        assert view["a"].state == "fresh" and view["b"].state == "unknown"
        async with StatsReader(client, NS).cached() as cache:
            await write(store, "b", t["b"], running=6)
            await wait_for(lambda: (e := cache.get("b")) is not None and e.state == "fresh")
    finally:
        await client.aclose()


# --- picker -------------------------------------------------------------------------------------


def entry(endpoint_id: str, state: str = "fresh", **kw: str) -> EndpointView:
    raw = fields(**kw) | {"scraped_at_ms": "1000", "poller": "p", "token": "1", "seq": "1"}
    return EndpointView(
        endpoint_id,
        state=state,
        age_ms=0,
        owner="p",
        token=1,  # type: ignore[arg-type]
        raw=("", raw, {}),
    )


def view_of(*entries: EndpointView) -> View:
    return View(1000, 1, {e.id: e for e in entries})


def test_pick_least_loaded_and_skips_saturated() -> None:
    v = view_of(
        entry("busy", waiting="5"),
        entry("full", kv="0.8"),
        entry("a", waiting="2"),
        entry("b", waiting="1", kv="0.7"),
        entry("c", waiting="1", kv="0.2"),
        entry("gone", state="failing"),
        entry("old", state="stale"),
    )
    assert pick(v) == "c"
    assert pick(v, candidates=["a", "b", "busy", "missing"]) == "b"
    assert pick(v, candidates=["busy", "full", "gone", "old"]) is None
    assert pick(view_of()) is None


def test_pick_prefers_the_model_or_a_loaded_adapter() -> None:
    v = view_of(
        entry("idle"),
        entry("llama", waiting="3", models="llama"),
        entry("lora", waiting="4", lora_running="sql-lora"),
    )
    assert pick(v, model="llama") == "llama"
    assert pick(v, model="sql-lora") == "lora"
    assert pick(v, model="unknown-model") == "idle"
