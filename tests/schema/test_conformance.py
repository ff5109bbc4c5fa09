"""docs/schema.md is sufficient: a reader written from it alone agrees with StatsReader.

The reading half of this module (down to the marker) imports nothing of ``poller``: it
uses a plain redis-py client and the rules of docs/schema.md, including the field types
of its tables. It follows ``P:updates`` as the document says while a store writes, then
compares every field of every endpoint with ``StatsReader`` (snapshot and cached).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis.asyncio as aioredis

from tests.support.paths import REPO

DOC = (REPO / "docs" / "schema.md").read_text()


def doc_types(marker: str) -> dict[str, str]:
    """field -> type, from the table after ``marker`` in the document."""
    out: dict[str, str] = {}
    for line in DOC[DOC.index(marker) :].splitlines()[3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        out[cells[0].strip("`")] = cells[1].split(" ")[0]
    return out


STATS_TYPES = doc_types("<!-- stats-fields")
FAILURE_TYPES = doc_types("<!-- failure-fields")


def typed(fields: dict[str, str], types: dict[str, str]) -> dict[str, Any]:
    """Numbers are decimal strings, lists comma-separated with no spaces."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        kind = types.get(name, "string")
        if kind == "int":
            out[name] = int(value)
        elif kind == "float":
            out[name] = float(value)
        elif kind == "list":
            out[name] = tuple(value.split(",")) if value else ()
        elif kind == "bool":
            out[name] = value == "1"
        elif kind == "map":
            pairs = (pair.rpartition(":") for pair in value.split(",") if pair)
            out[name] = {key: int(count) for key, _, count in pairs}
        else:
            out[name] = value
    return out


def record(raw: str | None, now_ms: int, header: int) -> tuple[list[str], dict[str, str]] | None:
    """A view record: header fields and JSON; absent when its expiry is not after now."""
    if not raw:
        return None
    head, _, body = raw.partition("|")
    parts = head.split(" ")
    return (parts, json.loads(body)) if int(parts[header - 3]) > now_ms else None


class DocReader:
    """The view, kept as the document says: registry, records, updates."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.p = "{" + namespace + "}"
        self.rev = -1
        self.entries: dict[str, str] = {}
        self.stats: dict[str, str] = {}
        self.failures: dict[str, str] = {}
        self.read_backs = 0
        self.snapshots = 0

    async def snapshot(self) -> None:
        self.snapshots += 1
        p = self.p
        pipe = self.client.pipeline(transaction=True)
        pipe.time().get(f"{p}:endpoints:rev").hgetall(f"{p}:endpoints")
        pipe.hgetall(f"{p}:view:stats").hgetall(f"{p}:view:failures")
        _, rev, self.entries, self.stats, self.failures = await pipe.execute()
        self.rev = int(rev or 0)

    async def read_back(self, endpoint_id: str) -> None:
        self.read_backs += 1
        p = self.p
        pipe = self.client.pipeline(transaction=True)
        pipe.hget(f"{p}:endpoints", endpoint_id)
        pipe.hget(f"{p}:view:stats", endpoint_id).hget(f"{p}:view:failures", endpoint_id)
        entry, stats, failure = await pipe.execute()
        for table, value in ((self.entries, entry), (self.stats, stats), (self.failures, failure)):
            if value is None:
                table.pop(endpoint_id, None)
            else:
                table[endpoint_id] = value

    async def apply(self, message: str) -> None:
        kind, _, rest = message.partition(" ")
        if kind == "endpoints":
            if int(rest) != self.rev:
                await self.snapshot()
            return
        if kind not in ("stats", "failure"):
            return
        endpoint_id, seq_s, raw = rest.split(" ", 2)
        if endpoint_id not in self.entries:
            return
        seq, at = int(seq_s), int(raw.split(" ", 1)[0])
        counter = "seq" if kind == "stats" else "count"
        mine = self.stats if kind == "stats" else self.failures
        other = self.failures if kind == "stats" else self.stats
        held = mine.get(endpoint_id)
        held_at = int(held.split(" ", 1)[0]) if held else -1
        held_seq = int(json.loads(held.partition("|")[2])[counter]) if held else 0
        other_at = int(other[endpoint_id].split(" ", 1)[0]) if endpoint_id in other else -1
        if at < other_at or (at, seq) <= (held_at, held_seq):
            return
        if held and seq != held_seq + 1 and (seq != 1 if kind == "stats" else seq > 1):
            await self.read_back(endpoint_id)
            return
        mine[endpoint_id] = raw
        if kind == "stats":
            self.failures.pop(endpoint_id, None)

    def endpoint(self, endpoint_id: str, now_ms: int) -> dict[str, Any]:
        stats = record(self.stats.get(endpoint_id), now_ms, 5)
        failure = record(self.failures.get(endpoint_id), now_ms, 4)
        owner: str | None = None
        token: int | None = None
        scraped = writer_at = -1
        if stats:
            scraped = writer_at = int(stats[0][0])
            owner, token = stats[0][3], int(stats[0][4])
        if failure and int(failure[0][0]) >= writer_at:
            owner, token = failure[0][2], int(failure[0][3])
        age = None if stats is None else max(0, now_ms - scraped)
        bound = 2 * int(stats[0][1]) if stats else 0
        if failure and (stats is None or int(failure[0][0]) >= scraped):
            state = "failing"
        elif stats is None:
            state = "unknown"
        else:
            state = "fresh" if age is not None and age <= bound else "stale"
        engine = (
            stats[1]["engine"] if stats else json.loads(self.entries[endpoint_id]).get("engine")
        )
        return {
            "id": endpoint_id,
            "state": state,
            "engine": engine,
            "age_ms": age,
            "owner": owner,
            "token": token,
            "stats": None if stats is None else typed(stats[1], STATS_TYPES),
            "failure": None if failure is None else typed(failure[1], FAILURE_TYPES),
        }


async def follow(reader: DocReader, stop: asyncio.Event) -> None:
    pubsub = reader.client.pubsub(ignore_subscribe_messages=True)
    await pubsub.ssubscribe(f"{reader.p}:updates")
    try:
        await reader.snapshot()  # subscribed first: nothing falls between
        while not stop.is_set():
            message = await pubsub.get_message(timeout=0.1)
            if message is not None:
                await reader.apply(str(message["data"]))
    finally:
        await pubsub.aclose()


# --- end of the reading half: below, the poller side and the comparison ------------------------

from poller.reader import StatsReader  # noqa: E402
from poller.schema.endpoint import Endpoint  # noqa: E402
from poller.store.store import RedisStore  # noqa: E402
from tests.support.redisproc import RedisProcess  # noqa: E402

NS = "conf"


def same(doc: dict[str, Any], ours: dict[str, Any]) -> None:
    """Every field; a field the record does not carry must read as absent (None/empty)."""
    assert {k: v for k, v in doc.items() if k not in ("stats", "failure")} == {
        k: v for k, v in ours.items() if k not in ("stats", "failure")
    }
    for part in ("stats", "failure"):
        if doc[part] is None or ours[part] is None:
            assert doc[part] is None and ours[part] is None, (doc["id"], part)
            continue
        for name, value in ours[part].items():
            if name in doc[part]:
                assert doc[part][name] == value, (doc["id"], part, name)
            else:
                assert value in (None, (), {}, "", 0), (doc["id"], part, name, value)
        assert set(doc[part]) <= set(ours[part]), (doc["id"], part)


async def test_a_reader_from_the_document_agrees_with_stats_reader(
    redis_server: RedisProcess,
) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.flushall()
    store = RedisStore(client, NS)
    ids = [f"ep-{i}" for i in range(12)]
    for e in ids:
        engine = "sglang" if e.endswith("3") else None
        await store.put_endpoint(Endpoint(id=e, url="http://127.0.0.1:9", engine=engine))
    await store.heartbeat("p1", 60_000)
    tokens = {a.endpoint_id: a.token for a in await store.acquire_leases("p1", ids, 60_000)}
    doc_reader = DocReader(client, NS)
    stop = asyncio.Event()
    task = asyncio.create_task(follow(doc_reader, stop))

    async def write(e: str, n: int, **extra: str) -> None:
        fields = {"engine": "vllm", "running": str(n), "waiting": str(n % 3), "scrape_ms": "1.5"}
        fields |= {"interval_ms": "60000", **extra}
        result = await store.write_stats(
            e, "p1", tokens[e] or 0, fields, lease_ttl_ms=60_000, stats_ttl_ms=180_000
        )
        assert result.accepted

    async def fail(e: str, reason: str) -> None:
        result = await store.write_failure(
            e, "p1", tokens[e] or 0, reason=reason, detail="HTTP 503", lease_ttl_ms=60_000,
            failure_ttl_ms=180_000, missing=("a|b", "c"),
        )  # fmt: skip
        assert result.accepted

    async with StatsReader(client, NS).router() as router:
        cache = router.cache
        deadline = time.monotonic() + 30
        while doc_reader.rev < 0:  # the document reader has subscribed and snapshot
            assert time.monotonic() < deadline, "the document reader never took its snapshot"
            await asyncio.sleep(0.01)
        await store.remove_endpoint(ids[11])  # first: its snapshot must not do the rest
        for n in range(1, 6):
            for i, e in enumerate(ids[:9]):
                extra = {"kv_cache_usage": "0.42", "models": "m1,m2"} if i % 2 else {}
                extra |= (
                    {"lora_running": "sql-lora", "prefix_cache_hit_rate": "0.5"} if i == 4 else {}
                )
                if i == 2:
                    extra |= {
                        "kv_capacity_tokens": "633600",
                        "waiting_by_reason": "capacity:4,deferred:2",
                    }
                await write(e, n + i, **extra)
        await fail(ids[5], "timeout")
        await fail(ids[5], "timeout")
        await fail(ids[6], "http_status")
        await write(ids[6], 99)  # recovered: the failure record goes
        await fail(ids[9], "auth")  # failing without stats; ids[10:] never written
        await store.remove_endpoint(ids[11])
        # the settled view: both followers have seen the last update (ids[9]'s failure;
        # the channel is ordered, so every earlier message was applied before it)
        deadline = time.monotonic() + 30  # milliseconds when idle
        while (
            ids[11] in doc_reader.entries
            or ids[9] not in doc_reader.failures
            or ids[6] in doc_reader.failures
            or (e := cache.get(ids[6])) is None
            or (e.failure is not None or ids[11] in cache.ids())
            or (f := cache.get(ids[9])) is None
            or f.failure is None
        ):
            assert time.monotonic() < deadline, "followers did not settle"
            await asyncio.sleep(0.02)
        snapshot = await StatsReader(client, NS).snapshot()
        cached_view = cache.view()
    stop.set()
    await task
    assert sorted(doc_reader.entries) == sorted(snapshot.endpoints) == sorted(ids[:11])
    assert (doc_reader.read_backs, doc_reader.snapshots) == (0, 2)  # start + the removal
    states = set()
    for e in sorted(snapshot.endpoints):
        ours = snapshot[e].to_dict()
        states.add(ours["state"])
        same(doc_reader.endpoint(e, snapshot.now_ms), ours)
        same(doc_reader.endpoint(e, cached_view.now_ms), cached_view[e].to_dict())
    assert states == {"fresh", "failing", "unknown"}
    await client.aclose()
