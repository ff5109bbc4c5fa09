"""The engine-size fields (``kv_capacity_tokens``, ``waiting_by_reason``): their hash form,
absence, and the way they reach readers (the stats hash, the view record, the update feed)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from poller.reader import StatsReader
from poller.reader.view.records import _fields
from poller.redis.connection import subscribe
from poller.schema.endpoint import Endpoint
from poller.schema.records import STATS_HEADER, parse_update, split
from poller.schema.stats import EndpointStats, Signals, format_counts, stats_fields
from poller.store.store import RedisStore

NS = "sf"


def hash_of(signals: Signals) -> dict[str, str]:
    fields = stats_fields(signals, prefix_cache_hit_rate=None, scrape_ms=1.0, interval_ms=1000)
    return {**fields, "scraped_at_ms": "1", "poller": "p", "token": "1", "seq": "1"}


def test_published_fields_round_trip() -> None:
    signals = Signals(
        "vllm", 1, 4, kv_capacity_tokens=2_097_152, waiting_by_reason={"capacity": 3, "deferred": 1}
    )
    h = hash_of(signals)
    assert h["kv_capacity_tokens"] == "2097152"
    assert h["waiting_by_reason"] == "capacity:3,deferred:1"
    stats = EndpointStats.from_hash(h)
    assert stats.kv_capacity_tokens == 2_097_152
    assert stats.waiting_by_reason == {"capacity": 3, "deferred": 1}
    assert stats.to_dict()["waiting_by_reason"] == {"capacity": 3, "deferred": 1}
    hash(stats)  # still usable in sets and as a key


def test_unpublished_fields_are_absent_not_zero() -> None:
    h = hash_of(Signals("tgi", 0, 0))
    assert "kv_capacity_tokens" not in h and "waiting_by_reason" not in h
    stats = EndpointStats.from_hash(h)
    assert stats.kv_capacity_tokens is None and stats.waiting_by_reason == {}
    # a published zero is a number, not an absence
    h = hash_of(Signals("vllm", 0, 0, kv_capacity_tokens=0, waiting_by_reason={"capacity": 0}))
    assert (h["kv_capacity_tokens"], h["waiting_by_reason"]) == ("0", "capacity:0")


def test_reason_names_that_cannot_be_written_are_left_out() -> None:
    assert format_counts({"a,b": 1, "c:d": 2, "ok": 3}) == "ok:3"
    assert format_counts({"a,b": 1}) == ""
    assert format_counts({"deferred": 1, "capacity": 2}) == "capacity:2,deferred:1"
    assert "waiting_by_reason" not in hash_of(Signals("vllm", 0, 1, waiting_by_reason={"a,b": 1}))


@pytest.mark.parametrize("bad", ["capacity", "capacity:x", ":3", "capacity:-1", "a:1,b"])
def test_a_malformed_map_is_an_error_naming_it(bad: str) -> None:
    h = {**hash_of(Signals("vllm", 0, 0)), "waiting_by_reason": bad}
    with pytest.raises(ValueError, match="reason:count"):
        EndpointStats.from_hash(h)


@pytest.mark.parametrize("field", ["kv_cache_usage", "prefix_cache_queries_total"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_number_that_is_not_finite_is_malformed(field: str, bad: str) -> None:
    """No poller writes one (an engine's NaN is absent): another writer's would make
    the counters' reset check and the load compare with NaN, always false."""
    h = {**hash_of(Signals("vllm", 0, 0)), field: bad}
    with pytest.raises(ValueError, match="finite number"):
        EndpointStats.from_hash(h)


@pytest.mark.parametrize("digit", ["\u00b2", "\u0663", "\uff11"])  # superscript, Arabic, fullwidth
def test_numbers_in_other_scripts_are_malformed_not_fatal(digit: str) -> None:
    """Another writer's header or map with a character ``str.isdigit`` takes: the
    record is malformed (None), the map an error naming it, never a crash."""
    from poller.schema.records import json_int, written_ms

    assert split(f"1 1000 {digit} poller-0 17|{{}}", 0, STATS_HEADER) is None
    assert split(f"1 1000 99 poller-0 1{digit}|{{}}", 0, STATS_HEADER) is not None  # token
    assert parse_update(f"stats a {digit} 1 1000 99 p 1|{{}}") is None
    assert written_ms(f"{digit} 1000") == -1
    assert json_int(f'1 2|{{"seq":"{digit}"}}', "seq") is None
    h = {**hash_of(Signals("vllm", 0, 0)), "waiting_by_reason": f"capacity:{digit}"}
    with pytest.raises(ValueError, match="reason:count"):
        EndpointStats.from_hash(h)


async def test_the_fields_reach_every_reader_path(store: RedisStore) -> None:
    """The stats hash, the ``P:view:stats`` record (snapshots) and the ``P:updates`` message."""
    await store.heartbeat("p1", 5000)
    await store.put_endpoint(Endpoint(id="a", url="http://127.0.0.1:9"))
    (acquired,) = await store.acquire_leases("p1", ["a"], 10_000)
    assert acquired.token is not None
    signals = Signals("vllm", 2, 4, kv_capacity_tokens=65_536, waiting_by_reason={"capacity": 4})
    fields = stats_fields(signals, prefix_cache_hit_rate=None, scrape_ms=1.0, interval_ms=1000)
    async with subscribe(store.client, shard_channels=(store.keys.updates,)) as pubsub:
        result = await store.write_stats(
            "a", "p1", acquired.token, fields, lease_ttl_ms=10_000, stats_ttl_ms=10_000
        )
        assert result.accepted
        message = None
        deadline = time.monotonic() + 10
        while message is None and time.monotonic() < deadline:
            message = await pubsub.get_message(timeout=0.2)
    assert message is not None
    update = parse_update(str(message["data"]))
    assert update is not None and update.kind == "stats"
    head_body = split(update.record, 0, STATS_HEADER)
    assert head_body is not None
    from_feed = EndpointStats.from_hash(_fields(head_body[1]))
    record = await store.client.hget(store.keys.view_stats, "a")
    assert record == update.record
    from_hash = EndpointStats.from_hash(await store.client.hgetall(store.keys.stats("a")))
    for stats in (from_feed, from_hash):
        assert stats.kv_capacity_tokens == 65_536 and stats.waiting_by_reason == {"capacity": 4}


async def test_the_reader_decodes_them(real_client: aioredis.Redis) -> None:
    store = RedisStore(real_client, NS)
    await store.heartbeat("p1", 5000)
    for endpoint_id in ("big", "plain"):
        await store.put_endpoint(Endpoint(id=endpoint_id, url="http://127.0.0.1:9"))
    leases = {
        a.endpoint_id: a.token for a in await store.acquire_leases("p1", ["big", "plain"], 10_000)
    }
    for endpoint_id, signals in (
        ("big", Signals("vllm", 1, 2, kv_capacity_tokens=1024, waiting_by_reason={"deferred": 2})),
        ("plain", Signals("tgi", 1, 0)),
    ):
        token = leases[endpoint_id]
        assert token is not None
        fields = stats_fields(signals, prefix_cache_hit_rate=None, scrape_ms=1.0, interval_ms=1000)
        await store.write_stats(
            endpoint_id, "p1", token, fields, lease_ttl_ms=10_000, stats_ttl_ms=10_000
        )
    view = await StatsReader(real_client, NS).snapshot()
    big, plain = view["big"].stats, view["plain"].stats
    assert big is not None and plain is not None
    assert (big.kv_capacity_tokens, big.waiting_by_reason) == (1024, {"deferred": 2})
    assert (plain.kv_capacity_tokens, plain.waiting_by_reason) == (None, {})


async def test_a_cached_reader_gets_them_from_the_update_feed(real_client: aioredis.Redis) -> None:
    store = RedisStore(real_client, NS + "-cached")
    await store.heartbeat("p1", 5000)
    await store.put_endpoint(Endpoint(id="a", url="http://127.0.0.1:9"))
    (acquired,) = await store.acquire_leases("p1", ["a"], 10_000)
    assert acquired.token is not None
    async with StatsReader(real_client, NS + "-cached", resync_s=60).router() as router:
        cache = router.cache
        signals = Signals("vllm", 1, 3, kv_capacity_tokens=4096, waiting_by_reason={"deferred": 3})
        fields = stats_fields(signals, prefix_cache_hit_rate=None, scrape_ms=1.0, interval_ms=1000)
        await store.write_stats(
            "a", "p1", acquired.token, fields, lease_ttl_ms=10_000, stats_ttl_ms=10_000
        )
        deadline = time.monotonic() + 10  # generous: the update is an event, not a timer
        while (entry := cache.get("a")) is None or entry.stats is None:
            assert time.monotonic() < deadline, "the update never reached the cache"
            await asyncio.sleep(0.01)
        assert entry.stats.kv_capacity_tokens == 4096
        assert entry.stats.waiting_by_reason == {"deferred": 3}
