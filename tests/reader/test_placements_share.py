"""Gateway replicas share their prefix placements through Redis: a placement one replica
made is used by another's pick, ``share_placements=False`` keeps each to its own, Redis
lost means local placements, and the stream stays within its caps."""

from __future__ import annotations

import random
from typing import Any

import redis
import redis.asyncio as aioredis

from poller.reader import RoutingOptions, StatsReader, SyncStatsReader, ViewCache, prompt_of
from poller.reader.exchange.exchange import Exchange
from poller.reader.load.fleet import FleetLoad
from poller.reader.prefix.blocks import block_ids
from poller.reader.prefix.outbox import ENTRY_MAX
from poller.reader.prefix.placements import Placements
from poller.reader.router import Router
from poller.schema.keys import Keys
from poller.schema.lua import lua
from poller.store.store import RedisStore
from tests.reader.test_reader import setup, write
from tests.support.procs import until
from tests.support.redisproc import RedisProcess

NS = "prefix"
CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant. " * 40},
    {"role": "user", "content": "Summarise the following document. " + "lorem ipsum " * 200},
]


async def _fleet(url: str, n: int = 4) -> None:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    store = RedisStore(client, NS)
    ids = [f"e{i}" for i in range(n)]
    tokens = await setup(store, *ids)
    for endpoint_id in ids:
        await write(store, endpoint_id, tokens[endpoint_id], models="m", kv_capacity_tokens="65536")
    await client.aclose()


def _ready(cache: ViewCache, n: int = 4) -> bool:
    return all((e := cache.get(f"e{i}")) is not None and e.state == "fresh" for i in range(n))


async def test_a_placement_one_replica_made_is_used_by_anothers_pick(
    redis_server: RedisProcess,
) -> None:
    """Replica A (asyncio) sends a conversation's first turn somewhere; replica B
    (threaded) gets the next turn and sends it to the same engine, from A's placements
    read on its exchange. A third replica with ``share_placements=False`` neither writes
    nor reads them."""
    await _fleet(redis_server.url)
    a = StatsReader.from_url(redis_server.url, NS)
    b = SyncStatsReader.from_url(redis_server.url, NS)
    c = StatsReader.from_url(redis_server.url, NS)
    first = prompt_of(CONVERSATION)
    ids = block_ids(first, "m")
    async with a.router(replica_id="gw-a", rng=random.Random(1)) as router_a:
        with b.router(replica_id="gw-b") as router_b:
            async with c.router(
                RoutingOptions(share_placements=False), replica_id="gw-c"
            ) as router_c:
                for router in (router_a, router_b, router_c):
                    await until(lambda r=router: _ready(r.cache), 30, "the fleet fresh")
                with router_a.pick("m", prompt=first) as ticket:
                    chosen = ticket.id
                await until(
                    lambda: router_b.placements.matches(ids) == [(chosen, len(ids))],
                    30,
                    "a's placement in b",
                )
                assert router_b.placements_shared and router_a.placements_shared
                turn = [*CONVERSATION, {"role": "assistant", "content": "It says " * 150}]
                turn.append({"role": "user", "content": "And the second part?"})
                # Seeds whose load-only choice is another engine too: the placement decides.
                blind = set()
                for seed in range(8):
                    router_b.rng.seed(seed)
                    with router_b.pick("m") as ticket:
                        blind.add(ticket.id)
                assert blind - {chosen}
                for seed in range(8):
                    router_b.rng.seed(seed)
                    with router_b.pick("m", prompt=prompt_of(turn)) as ticket:
                        assert ticket.id == chosen
                # B's placement of the longer prompt reaches A (the new blocks only).
                longer = block_ids(prompt_of(turn), "m")
                assert len(longer) > len(ids)  # blocks new to everyone
                await until(
                    lambda: dict(router_a.placements.matches(longer)).get(chosen) == len(longer),
                    30,
                    "b's placement in a",
                )
                assert router_b.placements.ids_written == len(longer) - len(ids)
                assert not router_c.placements.sharing and not router_c.placements_shared
                assert router_c.placements.matches(ids) == []
                assert router_c.placements.ids_read == 0
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    writers = {e[1]["@"] for e in client.xrange(Keys(NS).gateways_placements)}
    assert writers == {"gw-a", "gw-b"}
    assert 0 < client.pttl(Keys(NS).gateways_placements) <= 600_000
    client.close()
    await a.aclose()
    await c.aclose()
    b.close()


class _Lost:
    """A client whose scripts fail as a Redis that went away does."""

    def register_script(self, source: str) -> Any:
        def call(**kw: Any) -> Any:
            raise redis.ConnectionError("Connection refused")

        return call


def test_redis_lost_means_local_placements_and_the_router_says_so() -> None:
    cache = ViewCache()
    placements = Placements()
    exchange = Exchange(_Lost(), "k1", cache, FleetLoad("g1"), placements, "k2", "k0")
    router = Router(cache, placements=placements, exchange=exchange)
    assert placements.sharing and not router.placements_shared
    ids = block_ids("a system prompt " * 40, "m")
    placements.record("e1", ids)
    for _ in range(3):
        keys, args, pages = exchange.prepare()
        assert keys == ["k1", "k0", "k1:load", "k1:changed", "k1:alive", "k2"]
        assert args[6]  # the placements ride on the call
        try:
            exchange.script(keys=keys, args=args)
        except redis.ConnectionError as exc:
            exchange.failed(exc, pages)
    # Nothing lost: queued again for when Redis is back, and used locally meanwhile.
    assert placements.take_outbox().split(" ")[0] == "e1"
    assert placements.matches(ids) == [("e1", len(ids))]
    assert not router.placements_shared


def test_the_stream_is_capped_by_length_and_age_and_one_placement_costs_bytes(
    redis_server: RedisProcess,
) -> None:
    """The share script's stream: ``MAXLEN`` entries of at most ``ENTRY_MAX`` ids each,
    trimmed by age and expiring with it; the bytes per placement printed."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.config_set("stream-node-max-entries", "10")  # so '~' trims close to the cap
    keys = Keys("cap")
    share = client.register_script(lua("share"))
    table = Placements()
    table.sharing = True
    rng = random.Random(2)
    maxlen = 40
    for i in range(200):
        table.record(f"e{i % 16}", [rng.getrandbits(64) for _ in range(ENTRY_MAX)])
        body = table.take_outbox()
        args = [f"gw-{i % 4}", 800, "", 1, "", 10, body, "0-0", maxlen, 600_000, 1]
        share(keys=keys.share(placements=True), args=args)
    length = client.xlen(keys.gateways_placements)
    assert maxlen <= length <= maxlen + 10, length
    used = client.memory_usage(keys.gateways_placements) or 0
    per = used / (length * ENTRY_MAX)
    print(f"stream: {length} entries, {used} bytes, {per:.1f} bytes per placement")
    assert per < 16  # base64 of 8 bytes is 10.7; the stream's own overhead is small
    # By age: entries older than the age given are trimmed at the next write (a whole
    # node of them: the approximate trim drops whole nodes).
    aged = Keys("aged")
    for n in range(1, 11):
        client.xadd(aged.gateways_placements, {"@": "old", "p": ""}, id=f"1-{n}")
    args = ["gw-0", 800, "", 1, "", 10, "e1 AAAAAAAAAAE=", "0-0", maxlen, 1000, 1]
    share(keys=aged.share(placements=True), args=args)
    assert client.xrange(aged.gateways_placements, "-", "1-10") == []
    assert client.xlen(aged.gateways_placements) == 1
    assert 0 < client.pttl(aged.gateways_placements) <= 1000
    client.close()


def test_a_replica_reads_the_others_entries_once_and_never_its_own(
    redis_server: RedisProcess,
) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys("own")
    share = client.register_script(lua("share"))
    both = keys.share(placements=True)

    def call(replica: str, body: str, last: str) -> list[Any]:
        args = [replica, 800, "", 1, "", 10, body, last, 100, 600_000, 10]
        return list(share(keys=both, args=args)[7])

    assert call("a", "e1 AAAAAAAAAAE=", "")[1:] == []  # its own entry only
    first = call("b", "", "")  # a new replica: the newest entries, oldest first
    assert first[2:] == ["e1 AAAAAAAAAAE="]
    again = call("b", "", first[0])
    assert again == [first[0]]  # nothing new: the same last id, no entries
    client.xadd(keys.gateways_placements, {"other": "writer"})  # not ours to read
    call("a", "e2 AAAAAAAAAAI=", "")
    assert call("b", "", first[0])[2:] == ["e2 AAAAAAAAAAI="]
    client.close()


class _Answers:
    """A client whose share script answers as Redis would with no one else around."""

    def register_script(self, source: str) -> Any:
        def call(keys: list[str], args: list[Any]) -> Any:
            head = ["0", "0", 0, 1, 0, 1, 0]
            return [*head, [args[7] or "0-0"]] if len(keys) > 5 else head

        return call


def _record(now_ms: int, queries: int, hits: int) -> str:
    import json

    fields = {
        "engine": "vllm",
        "running": "0",
        "waiting": "0",
        "interval_ms": "1000",
        "scraped_at_ms": str(now_ms),
        "poller": "p1",
        "token": "1",
        "seq": "1",
        "models": "m",
        "prefix_cache_queries_total": str(queries),
        "prefix_cache_hits_total": str(hits),
    }
    return f"{now_ms} 1000 {now_ms + 3_600_000} p1 1|{json.dumps(fields)}"


def test_the_exchange_voids_an_engines_placements_when_its_counters_go_back() -> None:
    """No pick needed: the exchange reads every page that changed, and an engine whose
    prefix-cache counters went back (a restart) holds nothing of what was placed."""
    from poller.reader.view import View
    from poller.reader.view.decode import LazyEndpoints

    now = 1_764_500_000_000
    cache = ViewCache(stale_after_ms=3_600_000)
    entries = {e: "{}" for e in ("e1", "e2")}
    stats = {"e1": _record(now, 900, 300), "e2": _record(now, 50, 10)}
    cache.load(View(now, 1, LazyEndpoints(entries, stats, {}, now)))
    placements = Placements()
    exchange = Exchange(_Answers(), "k1", cache, FleetLoad("g1"), placements, "k2")

    def once() -> None:
        keys, args, pages = exchange.prepare()
        exchange.answered(exchange.script(keys=keys, args=args), pages)

    once()  # the counters as they are now
    ids = block_ids("a long shared system prompt " * 40, "m")
    placements.record("e1", ids)
    placements.record("e2", ids)
    cache.set_stats("e1", _record(now + 1000, 920, 310))  # grew: nothing happens
    once()
    assert dict(placements.matches(ids)) == {"e1": len(ids), "e2": len(ids)}
    cache.set_stats("e1", _record(now + 2000, 12, 3))  # went back: restarted
    once()
    assert placements.matches(ids) == [("e2", len(ids))]
    assert placements.invalidated == 1 and placements.answered_within(1.0)
