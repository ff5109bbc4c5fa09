from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable
from typing import TypeVar

import fakeredis
import pytest
import redis.asyncio as aioredis

from poller._version import __version__
from poller.config import RedisSettings
from poller.errors import SchemaMismatch, StoreError
from poller.schema.endpoint import Endpoint
from poller.schema.keys import Keys
from poller.store.members import this_process
from poller.store.registry import Registry, RegistryStore
from poller.store.store import RedisStore
from tests.support.redisproc import RedisProcess

T = TypeVar("T")

FIELDS = {
    "engine": "vllm",
    "running": "3",
    "waiting": "1",
    "kv_cache_usage": "0.5",
    "scrape_ms": "1.2",
    "interval_ms": "1000",
}


def ep(endpoint_id: str, port: int = 8000, **extra: object) -> Endpoint:
    return Endpoint.model_validate({"id": endpoint_id, "url": f"http://127.0.0.1:{port}", **extra})


async def next_event(pubsub: aioredis.client.PubSub, timeout_s: float = 30.0) -> str:
    """The next published message. Each call blocks until a message arrives (a skipped
    subscribe confirmation returns None early); the bound only ends a test that would hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (left_s := deadline - loop.time()) > 0:
        msg = await pubsub.get_message(timeout=left_s)
        if msg is not None:
            return str(msg["data"])
    raise AssertionError("no event published")


class Around:
    """The clock read before and after a call that sets a TTL: the key's absolute expiry
    must fall between the two readings plus the TTL, however long the calls took (a PTTL
    window would instead need the test to run fast). Redis shares this machine's clock."""

    def __enter__(self) -> Around:
        self.before_ms = math.floor(time.time() * 1000)
        return self

    def __exit__(self, *_: object) -> None:
        self.after_ms = math.ceil(time.time() * 1000)

    async def expires_within(self, client: aioredis.Redis, key: str, ttl_ms: int) -> None:
        expires_ms = await client.pexpiretime(key)
        low, high = self.before_ms + ttl_ms, self.after_ms + ttl_ms
        assert low <= expires_ms <= high, (key, expires_ms - self.before_ms, ttl_ms)


def test_every_key_shares_the_hash_tag() -> None:
    keys = Keys("ns")
    fixed = [keys.schema, keys.endpoints, keys.endpoints_rev, keys.members, keys.fence, keys.events]
    for key in [*fixed, keys.lease("a"), keys.stats("a"), keys.failure("a")]:
        assert key.startswith("{ns}:")
    assert keys.stats("e1") == "{ns}:stats:e1"
    assert keys.lease("e1") == "{ns}:lease:e1"


async def test_schema_is_claimed_and_checked(store: RedisStore) -> None:
    await store.ensure_schema()
    assert await store.client.get("{test}:schema") == "1"
    await store.client.set("{test}:schema", "2")
    with pytest.raises(SchemaMismatch, match="version '2'"):
        await store.ensure_schema()


async def test_acquire_renew_and_report_holder(store: RedisStore) -> None:
    [a] = await store.acquire_leases("p1", ["e1"], 2000)
    assert a.token == 1 and not a.renewed
    with Around() as renewal:
        [again] = await store.acquire_leases("p1", ["e1"], 2000)
    assert again.token == 1 and again.renewed
    [other] = await store.acquire_leases("p2", ["e1"], 2000)
    assert other.token is None and other.holder == "p1 1"
    assert await store.client.get("{test}:lease:e1") == "p1 1"
    # the holder's renewal set the TTL; the refused p2 did not touch it
    await renewal.expires_within(store.client, "{test}:lease:e1", 2000)
    # tokens come from one counter: the next lease gets a larger one
    [b] = await store.acquire_leases("p2", ["e2"], 2000)
    assert b.token == 2


async def test_renew_compares_the_token(store: RedisStore) -> None:
    await store.acquire_leases("p1", ["e1", "e2"], 1000)
    await store.client.set("{test}:lease:e2", "p2 99")  # someone else took it
    with Around() as renewal:
        renewed = await store.renew_leases("p1", {"e1": 1, "e2": 2}, 5000)
    assert renewed == {"e1": True, "e2": False}
    await renewal.expires_within(store.client, "{test}:lease:e1", 5000)


async def test_release_only_our_own_and_publish(store: RedisStore) -> None:
    await store.acquire_leases("p1", ["e1", "e2"], 2000)
    await store.client.set("{test}:lease:e2", "p2 7")
    async with store.subscribe() as pubsub:
        assert await store.release_leases("p1", {"e1": 1, "e2": 2}) == 1
        assert await next_event(pubsub) == "released e1"
    assert await store.client.get("{test}:lease:e1") is None
    assert await store.client.get("{test}:lease:e2") == "p2 7"


async def test_write_stats_accepted(store: RedisStore) -> None:
    [a] = await store.acquire_leases("p1", ["e1"], 500)
    await store.client.hset("{test}:failure:e1", "reason", "timeout")
    async with store.subscribe() as pubsub:
        with Around() as write:
            result = await store.write_stats(
                "e1", "p1", a.token or 0, FIELDS, lease_ttl_ms=2000, stats_ttl_ms=3000
            )
        assert result.accepted and result.value == 1
        assert await next_event(pubsub) == "stats e1 1"
    stats = await store.read_stats("e1")
    now_s, _ = await store.client.time()
    assert abs(int(stats["scraped_at_ms"]) - now_s * 1000) < 2000
    assert stats | FIELDS == stats
    assert (stats["poller"], stats["token"], stats["seq"]) == ("p1", "1", "1")
    await write.expires_within(store.client, "{test}:stats:e1", 3000)
    await write.expires_within(store.client, "{test}:lease:e1", 2000)  # renewed by the write
    assert await store.client.exists("{test}:failure:e1") == 0
    second = await store.write_stats(
        "e1",
        "p1",
        1,
        {"engine": "vllm", "running": "0", "waiting": "0"},
        lease_ttl_ms=2000,
        stats_ttl_ms=3000,
    )
    assert second.value == 2
    stats = await store.read_stats("e1")
    assert "kv_cache_usage" not in stats  # replaced, not merged


async def test_write_with_an_old_token_is_rejected(store: RedisStore) -> None:
    [a] = await store.acquire_leases("p1", ["e1"], 2000)
    # p1's lease lapsed (simulated), p2 took it with a newer token
    await store.client.delete("{test}:lease:e1")
    [b] = await store.acquire_leases("p2", ["e1"], 2000)
    assert b.token is not None and a.token is not None and b.token > a.token
    ok = await store.write_stats("e1", "p2", b.token, FIELDS, lease_ttl_ms=2000, stats_ttl_ms=3000)
    late = await store.write_stats(
        "e1", "p1", a.token, {**FIELDS, "running": "99"}, lease_ttl_ms=2000, stats_ttl_ms=3000
    )
    assert ok.accepted and not late.accepted and late.holder == f"p2 {b.token}"
    late_failure = await store.write_failure(
        "e1", "p1", a.token, reason="timeout", detail="x", lease_ttl_ms=2000, failure_ttl_ms=3000
    )
    assert not late_failure.accepted
    stats = await store.read_stats("e1")
    assert stats["running"] == "3" and stats["poller"] == "p2"
    assert await store.client.exists("{test}:failure:e1") == 0


async def test_write_without_any_lease_is_rejected(store: RedisStore) -> None:
    result = await store.write_stats("e1", "p1", 1, FIELDS, lease_ttl_ms=2000, stats_ttl_ms=3000)
    assert not result.accepted and result.holder == ""
    assert await store.client.exists("{test}:stats:e1", "{test}:lease:e1") == 0


async def test_failure_keeps_since_and_counts(store: RedisStore) -> None:
    [a] = await store.acquire_leases("p1", ["e1"], 2000)
    token = a.token or 0
    kw = {"lease_ttl_ms": 2000, "failure_ttl_ms": 3000}
    # Subscribed before both writes: on a Cluster a message published before the
    # subscription may still reach it (the cluster bus carries it to the other nodes).
    async with store.subscribe() as pubsub:
        await store.write_stats("e1", "p1", token, FIELDS, lease_ttl_ms=2000, stats_ttl_ms=3000)
        assert await next_event(pubsub) == "stats e1 1"
        first = await store.write_failure("e1", "p1", token, reason="timeout", detail="t1", **kw)
        assert await next_event(pubsub) == "failure e1 timeout"
    f1 = await store.read_failure("e1")
    second = await store.write_failure("e1", "p1", token, reason="timeout", detail="t2", **kw)
    f2 = await store.read_failure("e1")
    assert first.value == 1 and second.value == 2
    assert f2["since_ms"] == f1["since_ms"] and int(f2["at_ms"]) >= int(f1["at_ms"])
    assert f2["count"] == "2" and f2["detail"] == "t2" and f2["poller"] == "p1"
    with Around() as write:
        third = await store.write_failure(
            "e1", "p1", token, reason="contract", detail="missing", missing=["a", "b"], **kw
        )
    f3 = await store.read_failure("e1")
    assert third.value == 1 and f3["missing"] == "a,b" and f3["reason"] == "contract"
    await write.expires_within(store.client, "{test}:failure:e1", 3000)
    # the last good stats are left alone
    assert (await store.read_stats("e1"))["running"] == "3"


async def test_heartbeat_prunes_expired_members(store: RedisStore) -> None:
    beat = await store.heartbeat("p1", 5000)
    assert beat.members == ["p1"] and beat.now_ms > 1_600_000_000_000 and beat.epoch
    await store.client.zadd("{test}:members", {"dead": beat.now_ms - 10})
    await store.client.hset("{test}:members:info", "dead", "{}")
    again = await store.heartbeat("p2", 5000)
    assert again.members == ["p1", "p2"] and again.epoch == beat.epoch
    assert await store.client.zscore("{test}:members", "dead") is None
    # Each member's own word beside its score; pruned with it.
    info = await store.client.hgetall("{test}:members:info")
    assert sorted(info) == ["p1", "p2"]
    me = this_process()  # the process heartbeating: its token, host and pid
    expected = {"version": __version__, "member_ttl_ms": 5000, **me.record()}
    assert json.loads(info["p2"]) == expected
    await store.leave("p1")
    assert await store.live_members() == ["p2"]


async def test_registry_revisions_and_events(store: RedisStore) -> None:
    async with store.subscribe() as pubsub:
        rev1 = await store.put_endpoint(ep("a"))
        assert await next_event(pubsub) == f"endpoints {rev1}"
    rev2 = await store.put_endpoint(ep("b", 8001, engine="sglang"))
    assert rev2 == rev1 + 1
    with pytest.raises(StoreError, match="already exists"):
        await store.put_endpoint(ep("a"), replace=False)
    registry = await store.read_registry()
    assert registry.rev == rev2 and sorted(registry.endpoints) == ["a", "b"]
    assert registry.endpoints["b"].engine == "sglang"

    # removing an endpoint deletes its stats, failure and lease
    [lease] = await store.acquire_leases("p1", ["a"], 2000)
    await store.write_stats(
        "a", "p1", lease.token or 0, FIELDS, lease_ttl_ms=2000, stats_ttl_ms=3000
    )
    await store.client.hset("{test}:failure:a", "reason", "x")
    assert await store.remove_endpoint("a") == rev2 + 1
    assert await store.client.exists("{test}:stats:a", "{test}:failure:a", "{test}:lease:a") == 0
    assert await store.remove_endpoint("a") is None


async def test_replace_registry_is_exact_and_idempotent(store: RedisStore) -> None:
    await store.put_endpoint(ep("old"))
    await store.put_endpoint(ep("keep"))
    wanted = {"keep": ep("keep", 9000), "new": ep("new")}
    rev, added, changed, removed = await store.replace_registry(wanted)
    assert (added, changed, removed) == (["new"], ["keep"], ["old"])
    registry = await store.read_registry()
    assert registry.rev == rev and registry.endpoints == wanted
    again = await store.replace_registry(wanted)
    assert again == (rev, [], [], [])
    assert await store.registry_rev() == rev


async def test_concurrent_syncs_converge(store: RedisStore) -> None:
    files = [{f"e{i}": ep(f"e{i}", 8000 + i) for i in range(n, n + 5)} for n in (0, 3)]
    await asyncio.gather(*(store.replace_registry(f) for f in files * 3))
    final = await store.read_registry()
    assert final.endpoints in files  # exactly one of the files, never a mixture


async def test_invalid_foreign_entries_do_not_hide_others(store: RedisStore) -> None:
    await store.put_endpoint(ep("good"))
    await store.client.hset(
        "{test}:endpoints",
        mapping={
            "bad-json": "{nope",
            "bad-engine": '{"url":"http://x:1","engine":"nope"}',
            "bad-type": '{"url": 5}',
            "list": "[1,2]",
        },
    )
    registry = await store.read_registry()
    assert list(registry.endpoints) == ["good"]
    assert set(registry.invalid) == {"bad-json", "bad-engine", "bad-type", "list"}
    assert "unknown engine 'nope'" in registry.invalid["bad-engine"]
    assert "not valid JSON" in registry.invalid["bad-json"]
    assert registry.ids == sorted(["good", "bad-json", "bad-engine", "bad-type", "list"])


async def test_release_leftovers_of_an_earlier_run(store: RedisStore) -> None:
    await store.acquire_leases("pod-0", ["a", "b"], 60_000)
    await store.acquire_leases("pod-1", ["c"], 60_000)
    assert await store.release_leftovers("pod-0", ["a", "b", "c", "d"]) == 2
    assert await store.lease_holder("a") is None
    assert await store.lease_holder("c") == ("pod-1", 3)


# --- real Redis only: time, restarts, pauses, Cluster ---------------------------------------


async def test_paused_writer_is_fenced_after_its_lease_lapses(real_client: aioredis.Redis) -> None:
    store = RedisStore(real_client, "test")
    with Around() as acquired:
        [a] = await store.acquire_leases("p1", ["e1"], 60_000)
    assert a.token is not None
    await acquired.expires_within(real_client, "{test}:lease:e1", 60_000)
    # p1 "paused" past its lease: Redis drops the key, as its TTL would
    await real_client.delete("{test}:lease:e1")
    [b] = await store.acquire_leases("p2", ["e1"], 2000)
    assert b.token is not None
    assert (
        await store.write_stats("e1", "p2", b.token, FIELDS, lease_ttl_ms=2000, stats_ttl_ms=3000)
    ).accepted
    resumed = await store.write_stats(
        "e1", "p1", a.token, {**FIELDS, "running": "42"}, lease_ttl_ms=2000, stats_ttl_ms=3000
    )
    assert not resumed.accepted
    assert (await store.read_stats("e1"))["running"] == "3"


async def test_stats_expire_by_themselves(real_client: aioredis.Redis) -> None:
    """The stats hash and the lease carry the TTLs given (renewed by the write), and the
    view record its expiry on the Redis clock: nothing outlives them."""
    store = RedisStore(real_client, "test")
    [a] = await store.acquire_leases("p1", ["e1"], 60_000)
    # Nearly lapsed (a second left, so a slow machine cannot lose it first): the write
    # renews it to the full lease TTL.
    await real_client.pexpire("{test}:lease:e1", 1000)
    with Around() as write:
        result = await store.write_stats(
            "e1", "p1", a.token or 0, FIELDS, lease_ttl_ms=60_000, stats_ttl_ms=90_000
        )
    assert result.accepted
    await write.expires_within(real_client, "{test}:lease:e1", 60_000)
    await write.expires_within(real_client, "{test}:stats:e1", 90_000)
    scraped_ms, _, expires_ms, *_ = (await real_client.hget("{test}:view:stats", "e1")).split(" ")
    assert int(expires_ms) - int(scraped_ms) == 90_000


async def test_scripts_reload_after_flush_and_restart(own_redis: RedisProcess) -> None:
    store = RedisStore.from_settings(RedisSettings(url=own_redis.url, namespace="t"))
    try:
        [a] = await store.acquire_leases("p1", ["e1"], 5000)
        await store.client.script_flush()
        result = await store.write_stats(
            "e1", "p1", a.token or 0, FIELDS, lease_ttl_ms=5000, stats_ttl_ms=5000
        )
        assert result.accepted
        own_redis.restart()  # empty: no scripts, no keys, the old connection is dead
        # the client reconnects (one retry) and EVALSHA reloads the script; the write
        # itself is rejected, because the lease went with the restart
        after = await store.write_stats(
            "e1", "p1", a.token or 0, FIELDS, lease_ttl_ms=5000, stats_ttl_ms=5000
        )
        assert not after.accepted and after.holder == ""
        [b] = await store.acquire_leases("p1", ["e1"], 5000)
        assert b.token == 1  # a fresh Redis starts the fence again (documented caveat)
        assert (
            await store.write_stats("e1", "p1", 1, FIELDS, lease_ttl_ms=5000, stats_ttl_ms=5000)
        ).accepted
    finally:
        await store.close()


async def test_unreachable_redis_is_a_store_error() -> None:
    from tests.support.redisproc import free_port

    settings = RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.5)
    store = RedisStore.from_settings(settings)
    try:
        with pytest.raises(StoreError, match="unreachable"):
            await store.heartbeat("p1", 1000)
    finally:
        await store.close()


async def test_paused_redis_times_out_as_store_error(own_redis: RedisProcess) -> None:
    # The timeout is what turns the frozen call into an error; the calls before and after
    # the pause must succeed, so it is generous for a loaded machine.
    store = RedisStore.from_settings(RedisSettings(url=own_redis.url, socket_timeout_s=2.0))
    try:
        await store.ping()
        own_redis.pause()
        with pytest.raises(StoreError):
            await store.heartbeat("p1", 1000)
        own_redis.resume()
        assert await store.ping()
    finally:
        own_redis.resume()
        await store.close()


async def test_concurrent_writes_share_a_pipeline(real_client: aioredis.Redis) -> None:
    store = RedisStore(real_client, "test", write_batch_window_s=0.01)
    assert store._batcher is not None
    flushes: list[int] = []
    original = store._batcher._flush

    async def counting(batch):  # type: ignore[no-untyped-def]
        flushes.append(len(batch))
        await original(batch)

    store._batcher._flush = counting  # type: ignore[method-assign]
    ids = [f"e{i}" for i in range(40)]
    acquired = await store.acquire_leases("p1", ids, 5000)
    results = await asyncio.gather(
        *(
            store.write_stats(
                a.endpoint_id, "p1", a.token or 0, FIELDS, lease_ttl_ms=5000, stats_ttl_ms=5000
            )
            for a in acquired
        ),
        store.write_stats("stolen", "p1", 1, FIELDS, lease_ttl_ms=5000, stats_ttl_ms=5000),
    )
    assert [r.accepted for r in results] == [True] * 40 + [False]
    assert sum(flushes) == 41 and len(flushes) <= 2
    await real_client.script_flush()  # NOSCRIPT inside a batch: retried one by one
    again = await asyncio.gather(
        *(
            store.write_stats(
                a.endpoint_id, "p1", a.token or 0, FIELDS, lease_ttl_ms=5000, stats_ttl_ms=5000
            )
            for a in acquired[:5]
        )
    )
    assert all(r.accepted and r.value == 2 for r in again)


async def test_the_registry_is_reached_through_the_stores_own_methods() -> None:
    """The registry calls are the store's private part: callers use ``read_registry``,
    ``put_endpoint``, ... and every one of them goes through the store's ``_call``."""
    seen: list[str] = []

    class Counting(RedisStore):
        async def _call(self, awaitable: Awaitable[T], what: str) -> T:
            seen.append(what)
            return await super()._call(awaitable, what)

    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    store = Counting(client, "reg")
    try:
        assert not hasattr(store, "registry")
        assert isinstance(store._registry, RegistryStore)
        rev = await store.put_endpoint(ep("a"))
        assert await store.registry_rev() == rev
        registry = await store.read_registry()
        assert isinstance(registry, Registry) and registry.ids == ["a"]
        assert await store.remove_endpoint("a") == rev + 1
        assert seen == ["update registry", "GET rev", "read registry", "HEXISTS", "update registry"]
    finally:
        await client.aclose()
