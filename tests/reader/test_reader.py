from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from poller.config import RedisSettings
from poller.errors import StoreUnreachable
from poller.reader import StatsReader, SyncStatsReader
from poller.reader.legacy import pick
from poller.reader.view import EndpointView, View
from poller.reader.view.cache import ViewCache
from poller.reader.view.decode import LazyEndpoints, build_view
from poller.reader.view.follow import Action, FollowProtocol
from poller.redis.connection import subscribe
from poller.schema.endpoint import Endpoint
from poller.schema.keys import SCHEMA_VERSION
from poller.store.store import RedisStore
from tests.support.redisproc import RedisCluster, RedisProcess

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


async def age(store: RedisStore, endpoint_id: str, by_ms: int) -> None:
    """Make an endpoint's view record ``by_ms`` older (written and expiring that much
    earlier), as if that time had passed: readers judge records by these times."""
    record = await store.client.hget(store.keys.view_stats, endpoint_id)
    header, _, body = record.partition("|")
    scraped_ms, interval_ms, expires_ms, rest = header.split(" ", 3)
    older = f"{int(scraped_ms) - by_ms} {interval_ms} {int(expires_ms) - by_ms} {rest}"
    await store.client.hset(store.keys.view_stats, endpoint_id, f"{older}|{body}")


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
    for endpoint_id in ("stale", "expired"):  # 100 ms pass, on the records' clock
        await age(rstore, endpoint_id, 100)

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


async def test_a_malformed_record_reads_as_absent_and_says_so_once(
    rstore: RedisStore, reader: StatsReader, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = await setup(rstore, "a", "b")
    await write(rstore, "a", tokens["a"], running=1)
    await write(rstore, "b", tokens["b"], running=2)
    view_stats = f"{{{NS}}}:view:stats"
    for endpoint_id in ("a", "b"):  # a foreign writer's garbage in the record's JSON part
        header = (await rstore.client.hget(view_stats, endpoint_id)).partition("|")[0]
        await rstore.client.hset(view_stats, endpoint_id, header + '|{"running": "many"}')
    with caplog.at_level("DEBUG", logger="poller.reader.view"):
        view = await reader.snapshot()
        assert view["a"].stats is None and view["b"].stats is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) <= 1  # once per kind of problem in a process, not per endpoint
    assert any("malformed stats of endpoint" in r.getMessage() for r in caplog.records)


async def test_freshness_bound_is_per_endpoint_and_overridable(
    rstore: RedisStore, real_client: aioredis.Redis
) -> None:
    t = await setup(rstore, "fast", "slow")
    await write(rstore, "fast", t["fast"], interval_ms=100)
    await write(rstore, "slow", t["slow"], interval_ms=10_000)
    for endpoint_id in ("fast", "slow"):
        await age(rstore, endpoint_id, 350)
    view = await StatsReader(real_client, NS).snapshot()
    assert (view["fast"].state, view["slow"].state) == ("stale", "fresh")
    strict = await StatsReader(real_client, NS, stale_after_ms=100).snapshot()
    assert strict["slow"].state == "stale"


def spy_snapshots(reader: StatsReader | SyncStatsReader) -> list[Any]:
    """Record every reply of the reader's snapshot script."""
    replies: list[Any] = []
    script = reader._snapshot

    if isinstance(reader, StatsReader):

        async def spy(**kwargs: Any) -> Any:
            replies.append(await script(**kwargs))
            return replies[-1]

        reader._snapshot = spy
    else:
        reader._snapshot = lambda **kwargs: replies.append(script(**kwargs)) or replies[-1]
    return replies


async def test_snapshot_skips_the_registry_it_holds(
    rstore: RedisStore, reader: StatsReader, real_client: aioredis.Redis
) -> None:
    """The registry is left out while (epoch, rev) is the one held; a change of either
    brings it back, and the view is the same either way."""
    await setup(rstore, "a", "b")
    replies = spy_snapshots(reader)
    first, second = await reader.snapshot(), await reader.snapshot()
    assert replies[0][3] != 0 and replies[1][3] == 0
    assert list(second.endpoints) == list(first.endpoints) == ["a", "b"]
    assert second["a"].entry == first["a"].entry and second["a"].entry is not None

    await rstore.put_endpoint(Endpoint(id="c", url="http://127.0.0.1:10"))
    third, fourth = await reader.snapshot(), await reader.snapshot()
    assert replies[2][3] != 0 and replies[3][3] == 0
    assert sorted(third.endpoints) == sorted(fourth.endpoints) == ["a", "b", "c"]

    # Redis lost everything; the registry came back other, at the same revision: the new
    # epoch (the first heartbeat's) tells.
    await real_client.flushall()
    await rstore.heartbeat("p1", 5000)
    for endpoint_id in ("x", "y", "z"):
        await rstore.put_endpoint(Endpoint(id=endpoint_id, url="http://127.0.0.1:9"))
    after = await reader.snapshot()
    assert after.rev == fourth.rev and replies[4][3] != 0
    assert sorted(after.endpoints) == ["x", "y", "z"]

    # No epoch at all (no poller has run yet): nothing to trust, every snapshot reads it.
    await real_client.delete(rstore.keys.epoch)
    await reader.snapshot(), await reader.snapshot()
    assert replies[5][3] != 0 and replies[6][3] != 0


def test_sync_snapshot_skips_the_registry_it_holds(redis_server: RedisProcess) -> None:
    async def prepare(*ids: str, flush: bool = False) -> None:
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        if flush:
            await client.flushall()
        await setup(RedisStore(client, NS), *ids)
        await client.aclose()

    reader = SyncStatsReader.from_url(redis_server.url, NS)
    try:
        asyncio.run(prepare("a", flush=True))
        replies = spy_snapshots(reader)
        assert list(reader.snapshot().endpoints) == list(reader.snapshot().endpoints) == ["a"]
        asyncio.run(prepare("b"))
        assert sorted(reader.snapshot().endpoints) == ["a", "b"]
        assert [r[3] == 0 for r in replies] == [False, True, False]
    finally:
        reader.close()


def test_a_reply_without_the_registry_needs_the_one_held() -> None:
    reply = ["1", "0", "3", 0, [], [], [], "e1"]
    with pytest.raises(ValueError, match="none was held"):
        build_view(reply)
    view = build_view(reply, held=("e1", "3", {"a": '{"url": "http://127.0.0.1:9"}'}))
    assert list(view.endpoints) == ["a"] and view["a"].state == "unknown"


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
    async with reader.router() as router:
        cache = router.cache
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
                "{r}:lost-updates",
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


async def wait_for(cond, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``cond`` until it holds. The bound only ends a test that would otherwise hang:
    what these tests wait for is an event (a message, a resync), never a deadline."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_cached_mode_survives_a_redis_restart(own_redis: RedisProcess) -> None:
    # Redis is killed, not frozen: every call fails at once (refused, closed), so the
    # socket timeouts only bound calls that should succeed; generous for a loaded machine.
    client = aioredis.Redis.from_url(
        own_redis.url, decode_responses=True, socket_timeout=5.0, socket_connect_timeout=5.0
    )
    store = RedisStore(client, NS)
    t = await setup(store, "a")
    await write(store, "a", t["a"])
    # The reader has a client of its own, as a gateway has; the writer plays the poller,
    # which reconnects after the restart (its idle pooled connection died with Redis).
    reader = StatsReader(
        aioredis.Redis.from_url(
            own_redis.url, decode_responses=True, socket_timeout=5.0, socket_connect_timeout=5.0
        ),
        NS,
        resync_s=0.3,
    )
    async with reader.router() as router:
        cache = router.cache
        assert cache.get("a") is not None and cache.get("a").state == "fresh"  # type: ignore[union-attr]
        own_redis.stop()
        await wait_for(lambda: not cache.healthy)
        stale = cache.get("a")
        assert stale is not None and stale.state == "stale"  # never "fresh" while blind
        assert cache.view().counts()["fresh"] == 0
        own_redis.start()
        await client.connection_pool.disconnect()  # the poller's reconnect
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
        )
    await client.aclose()
    await reader.aclose()


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
        with reader.router() as router:
            cache = router.cache
            assert cache.healthy and cache.get("a") is not None

            async def more() -> None:
                client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
                store = RedisStore(client, NS)
                holder = await store.lease_holder("b")
                assert holder is not None
                await write(store, "b", holder[1], running=8)
                await client.aclose()

            asyncio.run(more())
            deadline = time.monotonic() + 30  # ends a hang; the wait is for the message
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
        async with StatsReader(client, NS).router() as router:
            cache = router.cache
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
    assert pick(v) in {"a", "b", "c"}  # the better of two random (tests/reader/test_pick.py)
    assert pick(v, candidates=["b", "c"]) == "c"  # equal queues: the lower KV
    assert pick(v, candidates=["a", "b", "busy", "missing"]) == "b"
    assert pick(v, candidates=["busy", "full", "gone", "old"], when_saturated="none") is None
    assert pick(v, candidates=["gone", "old"]) is None
    assert pick(view_of()) is None


def test_pick_prefers_the_model_or_a_loaded_adapter() -> None:
    v = view_of(
        entry("idle"),
        entry("llama", waiting="3", models="llama"),
        entry("lora", waiting="4", lora_running="sql-lora"),
    )
    assert pick(v, model="llama") == "llama"
    assert pick(v, model="sql-lora") == "lora"
    assert pick(v, model="unknown-model") is None  # never an endpoint of another model


# --- leaving the cache under load (the Python 3.11 hang) ---------------------------------------


async def test_leaving_cached_never_hangs_under_load(redis_server: RedisProcess) -> None:
    """Many readers enter and leave ``cached()`` while updates flow. With a socket timeout
    set, redis-py reads through ``asyncio.wait_for``, and Python 3.11's ``wait_for`` can
    swallow the cancel that lands as the read completes: the old ``cached()`` (one cancel,
    then an unbounded wait) hung there forever."""
    writer_client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await writer_client.flushall()
    store = RedisStore(writer_client, NS)
    ids = [f"e{i}" for i in range(40)]
    tokens = await setup(store, *ids)
    stop = asyncio.Event()

    async def writer() -> None:
        n, deadline = 0, time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline and n < 200_000:
            n += 1
            await asyncio.gather(*(write(store, e, tokens[e], running=n) for e in ids[:8]))

    async def reader_loop(k: int) -> None:
        # Any socket timeout sends redis-py's reads through wait_for (the path under test);
        # a generous one never turns a slow answer on a loaded machine into an error.
        client = aioredis.Redis.from_url(
            redis_server.url, decode_responses=True, socket_timeout=10.0
        )
        try:
            for i in range(6):
                async with StatsReader(client, NS, resync_s=0.05).router() as router:
                    cache = router.cache
                    await asyncio.sleep(0.01 * ((k + i) % 5))
                    assert cache.loaded
        finally:
            await client.aclose()

    feed = asyncio.create_task(writer())
    readers = [asyncio.create_task(reader_loop(k)) for k in range(16)]
    done, pending = await asyncio.wait(readers, timeout=60)
    stop.set()
    await feed
    for task in pending:
        task.cancel()
    await writer_client.aclose()
    assert not pending, f"{len(pending)} of {len(readers)} readers hung leaving cached()"
    for task in done:
        task.result()


# --- the update channel and the protocol -------------------------------------------------------


async def test_writes_publish_their_record_on_the_update_channel(store: RedisStore) -> None:
    """On fakeredis, real Redis (batched or not) and Cluster (SPUBLISH to the slot's shard)."""
    k = store.keys
    t = await setup(store, "a")
    async with subscribe(store.client, shard_channels=(k.updates,)) as pubsub:
        await write(store, "a", t["a"], running=3)
        await fail(store, "a", t["a"])
        await fail(store, "a", t["a"])
        await store.remove_endpoint("a")
        got: list[str] = []
        deadline = time.monotonic() + 30  # ends a hang; the wait is for the messages
        while len(got) < 4 and time.monotonic() < deadline:
            message = await pubsub.get_message(timeout=0.2)
            if message is not None:
                got.append(str(message["data"]))
    stats, failure1, failure2, removed = got
    assert stats.startswith("stats a 1 ") and "|" in stats
    assert '"running":"3"' in stats and '"seq":"1"' in stats
    assert failure1.startswith("failure a 1 ") and failure2.startswith("failure a 2 ")
    assert '"reason":"timeout"' in failure2
    assert removed.startswith("endpoints ")
    # the record is exactly what the view hash held at that moment
    assert stats.split(" ", 3)[3].startswith(stats.split(" ", 4)[3])


async def test_cached_reader_applies_updates_without_reading(
    rstore: RedisStore, real_client: aioredis.Redis
) -> None:
    t = await setup(rstore, "a", "b")
    reader = StatsReader(real_client, NS, resync_s=60)
    calls = count_calls(reader)
    async with reader.router() as router:
        cache = router.cache
        await wait_for(lambda: cache.loaded)  # entering waits 2 s at most: a loaded machine
        assert calls == {"snapshot": 1, "read": 0}
        for n in range(1, 21):
            await write(rstore, "a", t["a"], running=n)
        await fail(rstore, "b", t["b"], "auth")
        await wait_for(lambda: (e := cache.get("a")) is not None and e.stats.running == 20)  # type: ignore[union-attr]
        await wait_for(lambda: (e := cache.get("b")) is not None and e.state == "failing")
        b = cache.get("b")
        assert b is not None and b.failure is not None and b.failure.reason == "auth"
        assert calls == {"snapshot": 1, "read": 0}
        # a write whose update never arrived (published on another channel): the next
        # update shows a gap in seq, and the reader reads that one endpoint back
        await rstore._write_stats(
            keys=lost_keys(rstore, "a"),
            args=[f"p1 {t['a']}", 10_000, 10_000, "a", *flat(fields(running=21))],
        )
        await write(rstore, "a", t["a"], running=22)
        await wait_for(lambda: calls["read"] == 1)
        a = cache.get("a")
        assert a is not None and a.stats is not None and a.stats.running == 22
        assert a.stats.seq == 22 and calls["snapshot"] == 1


def flat(d: dict[str, str]) -> list[str]:
    return [x for kv in d.items() for x in kv]


def lost_keys(store: RedisStore, endpoint_id: str) -> list[str]:
    k = store.keys
    return [
        k.lease(endpoint_id),
        k.stats(endpoint_id),
        k.failure(endpoint_id),
        "{r}:lost-events",  # events and updates go to channels nobody follows
        k.view_stats,
        k.view_failures,
        "{r}:lost-updates",
    ]


def count_calls(reader: Any) -> dict[str, int]:
    """Count the reader's snapshots and one-endpoint reads (wrapping its scripts)."""
    calls = {"snapshot": 0, "read": 0}
    for name, attr in (("snapshot", "_snapshot"), ("read", "_get_records")):
        script = getattr(reader, attr)

        def counted(*args: Any, _s: Any = script, _n: str = name, **kw: Any) -> Any:
            calls[_n] += 1
            return _s(*args, **kw)

        setattr(reader, attr, counted)
    return calls


def test_sync_reader_follows_the_same_protocol(redis_server: RedisProcess) -> None:
    """The threaded face: updates applied without reads, a gap read back, a removal."""

    async def run(coro: Any) -> Any:
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            return await coro(RedisStore(client, NS))
        finally:
            await client.aclose()

    async def flush(store: RedisStore) -> dict[str, int]:
        await store.client.flushall()
        return await setup(store, "a", "b")

    tokens = asyncio.run(run(flush))
    reader = SyncStatsReader.from_url(redis_server.url, NS, resync_s=60)
    calls = count_calls(reader)

    def until(cond: Any) -> None:
        deadline = time.monotonic() + 30  # ends a hang; the waits are for messages
        while not cond():
            assert time.monotonic() < deadline, "condition not met in time"
            time.sleep(0.01)

    try:
        with reader.router() as router:
            cache = router.cache
            until(lambda: cache.loaded)  # entering waits 2 s at most: a loaded machine
            assert calls == {"snapshot": 1, "read": 0}

            async def writes(store: RedisStore) -> None:
                for n in range(1, 6):
                    await write(store, "a", tokens["a"], running=n)

            asyncio.run(run(writes))
            until(lambda: (e := cache.get("a")) is not None and e.stats.running == 5)  # type: ignore[union-attr]
            assert calls == {"snapshot": 1, "read": 0}

            async def gap(store: RedisStore) -> None:
                await store._write_stats(
                    keys=lost_keys(store, "a"),
                    args=[f"p1 {tokens['a']}", 10_000, 10_000, "a", *flat(fields(running=6))],
                )
                await write(store, "a", tokens["a"], running=7)
                await store.remove_endpoint("b")

            asyncio.run(run(gap))
            until(lambda: calls["read"] == 1 and cache.get("b") is None)
            a = cache.get("a")
            assert a is not None and a.stats is not None and a.stats.seq == 7
    finally:
        reader.close()


def test_sync_reader_notices_a_frozen_redis(own_redis: RedisProcess) -> None:
    """The 1 s probe is part of the shared protocol: the sync face has it too."""
    reader = SyncStatsReader.from_settings(
        RedisSettings(url=own_redis.url, namespace=NS, socket_timeout_s=0.5)
    )
    # A namespace a poller wrote (one without a schema key is never healthy).
    reader.client.set(reader.keys.schema, SCHEMA_VERSION)
    try:
        with reader.router() as router:
            cache = router.cache
            assert cache.healthy
            own_redis.pause()
            try:
                deadline = time.monotonic() + 5
                while cache.healthy:
                    assert time.monotonic() < deadline, "a frozen Redis went unnoticed"
                    time.sleep(0.02)
            finally:
                own_redis.resume()
    finally:
        reader.close()


def stats_update(endpoint_id: str, seq: int, at_ms: int, running: int = 1) -> str:
    body = fields(running=running) | {
        "seq": str(seq),
        "scraped_at_ms": str(at_ms),
        "poller": "p1",
        "token": "7",
    }
    record = f"{at_ms} 1000 {at_ms + 3000} p1 7|{json.dumps(body, separators=(',', ':'))}"
    return f"stats {endpoint_id} {seq} {record}"


def failure_update(endpoint_id: str, count: int, at_ms: int) -> str:
    body = {"reason": "timeout", "detail": "", "missing": "", "since_ms": str(at_ms)}
    body |= {"at_ms": str(at_ms), "count": str(count), "poller": "p1", "token": "7"}
    record = f"{at_ms} {at_ms + 3000} p1 7|{json.dumps(body, separators=(',', ':'))}"
    return f"failure {endpoint_id} {count} {record}"


def loaded_protocol() -> FollowProtocol:
    proto = FollowProtocol(ViewCache(), resync_s=5.0, probe_s=1.0)
    stats = {"a": stats_update("a", 5, 10_000).split(" ", 3)[3]}
    view = View(10_000, 3, LazyEndpoints({"a": "{}", "b": "{}"}, stats, {}, 10_000))
    proto.loaded(view, now=100.0)
    return proto


def test_protocol_applies_orders_and_reads_back_only_on_gaps() -> None:
    proto = loaded_protocol()
    cache = proto.cache
    assert proto.message(stats_update("a", 5, 10_000), 100.0) is None  # already held
    assert proto.message(stats_update("a", 4, 9_000), 100.0) is None  # crossed the snapshot
    assert proto.message(stats_update("a", 6, 10_000, running=6), 100.0) is None  # same ms
    assert cache.get("a").stats.running == 6  # type: ignore[union-attr]
    assert proto.message(failure_update("a", 1, 10_500), 100.0) is None
    assert cache.get("a").state == "failing"  # type: ignore[union-attr]
    assert proto.message(failure_update("a", 3, 10_700), 100.0) == Action("read", "a")
    assert proto.message(stats_update("a", 7, 10_400), 100.0) is None  # older than the failure
    assert proto.message(stats_update("a", 7, 11_000, running=7), 100.0) is None
    a = cache.get("a")
    assert a is not None and a.failure is None and a.stats is not None and a.stats.running == 7
    assert proto.message(stats_update("a", 9, 12_000), 100.0) == Action("read", "a")
    assert proto.message(stats_update("a", 1, 20_000), 100.0) is None  # hash expired: restart
    assert (proto.applied, proto.read_backs) == (4, 2)


def test_protocol_control_messages_and_timers() -> None:
    proto = loaded_protocol()
    assert proto.message("endpoints 3", 100.0) is None  # the revision we hold
    assert proto.message("endpoints 4", 100.0) == Action("snapshot")
    assert proto.message("released a", 100.0) is None  # no record changes
    assert proto.message(stats_update("new", 1, 11_000), 100.0) is None  # not registered yet
    assert proto.cache.get("new") is None
    for junk in ("", "stats", "stats a x 1|{}", "stats a 2 no-bar", "hello world"):
        assert proto.message(junk, 100.0) is None
    assert proto.due(100.5) is None and proto.wait_s(100.5) == pytest.approx(0.25)
    assert proto.due(101.0) == Action("probe")  # quiet for a second: probe
    assert proto.probed(3) is None and proto.probed(4) == Action("snapshot")
    assert proto.due(105.0) == Action("snapshot")  # resync_s
    assert 0 < proto.lost(OSError("gone")) <= 2.0 / 3 and not proto.cache.healthy


async def test_cached_reader_follows_updates_through_pubsub_when_it_has_no_feed(
    rstore: RedisStore, reader: StatsReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose connections feed.py cannot copy (open_feed gives None) is followed
    through redis-py's PubSub, with the same protocol."""

    async def no_feed(*args: object) -> None:
        return None

    import poller.reader.reader as module

    subscribed: list[object] = []
    original = module.subscribe

    def counting(*args: Any, **kwargs: Any) -> Any:
        subscribed.append(kwargs.get("shard_channels"))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "open_feed", no_feed)
    monkeypatch.setattr(module, "subscribe", counting)
    t = await setup(rstore, "a")
    await write(rstore, "a", t["a"], running=1)
    async with reader.router() as router:
        cache = router.cache
        for running in (2, 3, 4):
            await write(rstore, "a", t["a"], running=running)
        await wait_for(
            lambda: (
                (e := cache.get("a")) is not None and e.stats is not None and e.stats.running == 4
            )
        )


def test_protocol_says_cannot_reach_before_the_first_view_and_lost_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reader that never read a view has not lost Redis: it never reached it."""
    never = FollowProtocol(ViewCache(), resync_s=5.0, probe_s=1.0)
    with caplog.at_level("WARNING", logger="poller.reader.protocol"):
        never.lost(StoreUnreachable("connection refused"))
        never.lost(StoreUnreachable("connection refused"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["reader cannot reach Redis, no view read from it yet: connection refused"]
    caplog.clear()
    proto = loaded_protocol()
    with caplog.at_level("WARNING", logger="poller.reader.protocol"):
        proto.lost(StoreUnreachable("connection reset"))
    assert [r.getMessage() for r in caplog.records] == [
        "reader lost Redis, serving the last view: connection reset"
    ]
