"""What the hostile-input tests share (tests/scrape/test_hostile_pages.py and
test_hostile_http.py, tests/service/test_hostile_registry.py and test_secrets.py): the
body cap, a valid vLLM page and its parts, a Worker on fakeredis that owns one endpoint,
and the event collector and Redis dump that look for what a poller wrote."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import fakeredis
import httpx
import redis.asyncio as aioredis

from poller.config import Settings
from poller.schema.endpoint import Endpoint
from poller.service.worker import Worker
from poller.store.store import RedisStore

__all__ = [
    "CAP",
    "NS",
    "RUNNING",
    "VLLM_OK",
    "VLLM_REST",
    "MiB",
    "collect_events",
    "dump_redis",
    "worker_owning",
]

CAP = Settings().scrape.max_body_bytes  # the default body cap, 8 MiB
MiB = 1 << 20
# A page every engine accepts, for servers that must serve something valid.
VLLM_OK = (
    b"vllm:num_requests_running 3\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n"
)
# The rest of a vLLM page, for tests that vary only num_requests_running.
VLLM_REST = b"vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n"
RUNNING = "vllm:num_requests_running"
#: The namespace of the tests that run a real poller on hostile input.
NS = "hostile"


@asynccontextmanager
async def worker_owning(
    url: str, transport: httpx.AsyncBaseTransport | None = None, engine: str = "vllm"
) -> AsyncIterator[Worker]:
    """A Worker on fakeredis that holds the lease of endpoint ``e1`` at ``url``."""
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    worker = Worker(
        Settings(id="p1"),
        RedisStore(client, "t"),
        transport_factory=(lambda _ep: transport) if transport is not None else None,
    )
    try:
        await worker.store.put_endpoint(Endpoint(id="e1", url=url, engine=engine))
        await worker.store.ensure_schema()
        await worker.step()
        assert "e1" in worker.owned
        yield worker
    finally:
        await worker.jobs.stop()
        await worker.scraper.aclose()
        await client.aclose()


async def collect_events(
    client: aioredis.Redis, namespace: str, out: list[str], ready: asyncio.Event
) -> None:
    """Append every event of ``namespace`` to ``out`` until cancelled; ``ready`` is set
    once Redis confirms the subscription."""
    pubsub = client.pubsub()
    await pubsub.subscribe(f"{{{namespace}}}:events")
    try:
        # Ready once Redis confirms the subscription: every event after that is seen.
        async with asyncio.timeout(30):
            while (await pubsub.get_message(timeout=30) or {}).get("type") != "subscribe":
                pass
        ready.set()
        async for message in pubsub.listen():  # until cancelled
            if message["type"] == "message":
                out.append(str(message["data"]))
    finally:
        await pubsub.aclose()


async def dump_redis(client: aioredis.Redis) -> tuple[list[str], bytes]:
    """Every key and every value in Redis, whatever the type."""
    keys: list[str] = []
    blob: list[bytes] = []
    async for key in client.scan_iter(count=500):
        keys.append(key)
        kind = await client.type(key)
        if kind == "string":
            value: Any = await client.get(key)
        elif kind == "hash":
            value = await client.hgetall(key)
        elif kind == "zset":
            value = await client.zrange(key, 0, -1, withscores=True)
        elif kind == "list":
            value = await client.lrange(key, 0, -1)
        elif kind == "set":
            value = sorted(await client.smembers(key))
        elif kind == "stream":
            value = await client.xrange(key)
        else:
            raise AssertionError(f"cannot dump {key!r} of type {kind}: extend dump_redis")
        blob.append(key.encode() + b"=" + repr(value).encode())
    return keys, b"\n".join(blob)
