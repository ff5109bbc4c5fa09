"""What a gateway replica imports: the shared view of every endpoint, from Redis.

Importable without httpx or APScheduler (the package's public API). Two flavours:

- ``StatsReader`` (asyncio) and ``SyncStatsReader`` (threaded gateways).
- ``snapshot()`` reads the whole view in one round trip at one moment of the Redis clock;
  ``get(id)`` reads one endpoint. Both raise ``StoreError`` if Redis is unreachable.
- ``cached()`` keeps a local ``ViewCache`` that follows ``P:events`` (re-reading just the
  endpoint an event names), resyncs fully on every (re)connect and every ``resync_s``
  because pub/sub drops messages while disconnected, and never raises into the routing
  path: while Redis is away it serves the last view, marked stale, ``healthy`` False.

    async with StatsReader.from_url("redis://redis:6379/0").cached() as cache:
        target = pick(cache.view(), model="meta-llama/Llama-3.1-8B-Instruct")
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from poller.config import RedisSettings
from poller.errors import StoreError
from poller.reader.view import (
    EndpointView,
    View,
    ViewCache,
    build_view,
    get_one_call,
    one_from_reply,
    snapshot_call,
)
from poller.redis.connection import close_client, connect, redis_call, subscribe, tls_options
from poller.redis.keys import Keys
from poller.redis.lua import lua

__all__ = ["StatsReader", "SyncStatsReader"]

log = logging.getLogger(__name__)


def _backoff(failures: int) -> float:
    return float(min(5.0, 0.1 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0))


class _Reader:
    """What both readers share: keys, freshness bound, resync period, the two scripts."""

    def __init__(
        self,
        client: Any,
        namespace: str = "llmgw",
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> None:
        self.keys = Keys(namespace)
        self.stale_after_intervals = stale_after_intervals
        self.stale_after_ms = stale_after_ms
        self.resync_s = resync_s
        self._snapshot = client.register_script(lua("snapshot"))
        self._get_one = client.register_script(lua("get_one"))

    def _view(self, reply: Any) -> View:
        return build_view(reply, self.stale_after_intervals, self.stale_after_ms)

    def _entry(self, endpoint_id: str, reply: Any) -> tuple[int, EndpointView | None]:
        return one_from_reply(endpoint_id, reply, self.stale_after_intervals, self.stale_after_ms)


class StatsReader(_Reader):
    """Read the view (asyncio). Build from a URL or an existing redis-py client."""

    def __init__(
        self, client: aioredis.Redis | RedisCluster, namespace: str = "llmgw", **kwargs: Any
    ) -> None:
        super().__init__(client, namespace, **kwargs)
        self.client = client
        self._members = client.register_script(lua("heartbeat"))

    @classmethod
    def from_url(cls, url: str, namespace: str = "llmgw", **kwargs: Any) -> StatsReader:
        return cls.from_settings(RedisSettings(url=url, namespace=namespace), **kwargs)

    @classmethod
    def from_settings(cls, settings: RedisSettings, **kwargs: Any) -> StatsReader:
        """The poller's own client set-up: timeouts, TLS options, Sentinel, Cluster."""
        return cls(connect(settings), settings.namespace, **kwargs)

    async def aclose(self) -> None:
        await close_client(self.client)

    async def snapshot(self) -> View:
        keys, args = snapshot_call(self.keys)
        return self._view(await redis_call(self._snapshot(keys=keys, args=args), "snapshot"))

    async def _one(self, endpoint_id: str) -> tuple[int, EndpointView | None]:
        keys, args = get_one_call(self.keys, endpoint_id)
        reply = await redis_call(self._get_one(keys=keys, args=args), "read endpoint")
        return self._entry(endpoint_id, reply)

    async def get(self, endpoint_id: str) -> EndpointView | None:
        """One endpoint, or None if it is not in the registry."""
        return (await self._one(endpoint_id))[1]

    async def live_pollers(self) -> list[str]:
        """Live poller ids, sorted (the heartbeat script with no id only reads)."""
        keys = [self.keys.members, self.keys.schema, self.keys.epoch]
        reply = await redis_call(self._members(keys=keys, args=["", 0, "", ""]), "members")
        return sorted(str(m) for m in reply[3:])

    @asynccontextmanager
    async def cached(self) -> AsyncIterator[ViewCache]:
        """A local cache kept current in the background; reads never touch Redis."""
        cache = ViewCache(self.stale_after_intervals, self.stale_after_ms)
        first = asyncio.Event()
        task = asyncio.create_task(self._follow(cache, first), name="reader-cache")
        try:
            try:
                # Give the first snapshot a moment, but never fail the caller over it.
                await asyncio.wait_for(first.wait(), timeout=2.0)
            except TimeoutError:
                pass
            yield cache
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _follow(self, cache: ViewCache, first: asyncio.Event) -> None:
        failures = 0
        while True:
            try:
                async with subscribe(self.client, self.keys.events) as pubsub:
                    # Subscribed first, then snapshot: no event can fall between them.
                    cache.load(await self.snapshot())
                    cache.healthy = True
                    first.set()
                    failures = 0
                    await self._apply_events(cache, pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # redis-py errors surface raw from get_message
                if cache.healthy or failures == 0:
                    log.warning("reader lost Redis, serving the last view: %s", exc)
                cache.healthy = False
                first.set()
                failures += 1
            await asyncio.sleep(_backoff(failures))

    async def _apply_events(self, cache: ViewCache, pubsub: Any) -> None:
        next_resync = time.monotonic() + self.resync_s
        next_ping = time.monotonic() + 1.0
        while True:
            timeout = max(0.0, next_resync - time.monotonic())
            message = await pubsub.get_message(timeout=min(timeout, 1.0))
            if time.monotonic() >= next_resync:
                cache.load(await self.snapshot())
                next_resync = time.monotonic() + self.resync_s
            if message is None:
                if time.monotonic() >= next_ping:
                    # A quiet channel may mean a frozen Redis (SIGSTOP, partition): one
                    # PING a second, bounded, notices it in ~2 s instead of at a resync.
                    async with asyncio.timeout(1.0):
                        await redis_call(self.client.ping(), "PING")
                    next_ping = time.monotonic() + 1.0
                continue
            kind, _, rest = str(message["data"]).partition(" ")
            if kind == "endpoints":
                cache.load(await self.snapshot())
            elif kind in ("stats", "failure", "released"):
                endpoint_id = rest.partition(" ")[0]
                now_ms, entry = await self._one(endpoint_id)
                cache.apply(endpoint_id, now_ms, entry)


class SyncStatsReader(_Reader):
    """The same reader for threaded gateways (redis-py's blocking client)."""

    def __init__(self, client: redis.Redis, namespace: str = "llmgw", **kwargs: Any) -> None:
        super().__init__(client, namespace, **kwargs)
        self.client = client

    @classmethod
    def from_url(cls, url: str, namespace: str = "llmgw", **kwargs: Any) -> SyncStatsReader:
        return cls.from_settings(RedisSettings(url=url, namespace=namespace), **kwargs)

    @classmethod
    def from_settings(cls, settings: RedisSettings, **kwargs: Any) -> SyncStatsReader:
        """A blocking client with the settings' timeouts and TLS options (plain URLs;
        Sentinel and Cluster need a client of the caller's)."""
        client = redis.Redis.from_url(
            settings.url,
            decode_responses=True,
            encoding_errors="replace",
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.connect_timeout_s,
            **tls_options(settings),
        )
        return cls(client, settings.namespace, **kwargs)

    def close(self) -> None:
        self.client.close()

    def _call(self, fn: Any, what: str, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            raise StoreError(f"Redis unreachable during {what}: {exc}") from exc
        except rexc.RedisError as exc:
            raise StoreError(f"Redis error during {what}: {exc}") from exc

    def snapshot(self) -> View:
        keys, args = snapshot_call(self.keys)
        return self._view(self._call(self._snapshot, "snapshot", keys=keys, args=args))

    def _one(self, endpoint_id: str) -> tuple[int, EndpointView | None]:
        keys, args = get_one_call(self.keys, endpoint_id)
        reply = self._call(self._get_one, "read endpoint", keys=keys, args=args)
        return self._entry(endpoint_id, reply)

    def get(self, endpoint_id: str) -> EndpointView | None:
        return self._one(endpoint_id)[1]

    def live_pollers(self) -> list[str]:
        reply = self._call(self.client.time, "TIME")
        now_ms = int(reply[0]) * 1000 + int(reply[1]) // 1000
        members = self._call(
            self.client.zrangebyscore,
            "ZRANGEBYSCORE",
            name=self.keys.members,
            min=now_ms,
            max="+inf",
        )
        return sorted(str(m) for m in members)

    @contextmanager
    def cached(self) -> Iterator[ViewCache]:
        """A cache kept current by a daemon thread; stopped when the block ends."""
        cache = ViewCache(self.stale_after_intervals, self.stale_after_ms)
        stop = threading.Event()
        first = threading.Event()
        thread = threading.Thread(
            target=self._follow, args=(cache, stop, first), name="reader-cache", daemon=True
        )
        thread.start()
        try:
            first.wait(2.0)
            yield cache
        finally:
            stop.set()
            thread.join(5.0)

    def _follow(self, cache: ViewCache, stop: threading.Event, first: threading.Event) -> None:
        failures = 0
        while not stop.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            try:
                pubsub.subscribe(self.keys.events)
                cache.load(self.snapshot())
                cache.healthy = True
                first.set()
                failures = 0
                next_resync = time.monotonic() + self.resync_s
                while not stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if time.monotonic() >= next_resync:
                        cache.load(self.snapshot())
                        next_resync = time.monotonic() + self.resync_s
                    if message is not None:
                        self._apply(cache, str(message["data"]))
            except Exception as exc:
                if cache.healthy or failures == 0:
                    log.warning("reader lost Redis, serving the last view: %s", exc)
                cache.healthy = False
                first.set()
                failures += 1
            finally:
                try:
                    pubsub.close()
                except Exception:
                    log.debug("pubsub close failed", exc_info=True)
            stop.wait(_backoff(failures))

    def _apply(self, cache: ViewCache, data: str) -> None:
        kind, _, rest = data.partition(" ")
        if kind == "endpoints":
            cache.load(self.snapshot())
        elif kind in ("stats", "failure", "released"):
            endpoint_id = rest.partition(" ")[0]
            now_ms, entry = self._one(endpoint_id)
            cache.apply(endpoint_id, now_ms, entry)
