"""What a gateway replica imports: the shared view of every endpoint, from Redis.

Importable without httpx or APScheduler (the package's public API). Two flavours, twins
with the same methods, arguments and client set-up (Sentinel and Cluster included):

- ``StatsReader`` (asyncio) and ``SyncStatsReader`` (threaded gateways); each is a
  context manager that closes its client on exit (``async with`` / ``with``).
- ``snapshot()`` reads the whole view in one round trip at one moment of the Redis clock;
  ``get(id)`` reads one endpoint exactly as a snapshot would show it (the same records,
  the same decode). Both raise ``StoreError`` if Redis is unreachable.
- ``cached()`` keeps a local ``ViewCache`` that follows ``P:updates`` (each update carries
  its record: no read per update; ``protocol.py``), resyncs fully on every (re)connect
  and every ``resync_s`` because pub/sub drops messages while disconnected, and never
  raises into the routing path: while Redis is away it serves the last view, marked
  stale, ``healthy`` False. Leaving the block always ends the follower within a bound.

    async with StatsReader.from_url("redis://redis:6379/0") as reader:
        async with reader.cached() as cache:
            target = pick(cache, "meta-llama/Llama-3.1-8B-Instruct")
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import TracebackType
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.cluster
from pydantic import ValidationError
from redis.asyncio.cluster import RedisCluster

from poller.errors import ConfigError, SchemaMismatch
from poller.reader.cache import ViewCache
from poller.reader.exchange import Exchange
from poller.reader.feed import open_feed
from poller.reader.protocol import Action, Protocol
from poller.reader.replies import (
    Held,
    build_view,
    check_schema,
    held_after,
    one_from_records,
    records_call,
    snapshot_call,
)
from poller.reader.share import FleetLoad
from poller.reader.view import EndpointView, View
from poller.redis.connection import (
    close_client,
    close_client_sync,
    connect,
    connect_sync,
    pubsub_client,
    pubsub_client_sync,
    subscribe,
)
from poller.redis.errors import redis_call, redis_call_sync
from poller.redis.settings import NAMESPACE_PATTERN, RedisSettings
from poller.schema.keys import Keys
from poller.schema.lua import lua
from poller.util.messages import describe_errors

__all__ = ["StatsReader", "SyncStatsReader"]

log = logging.getLogger(__name__)


#: How long leaving ``cached()`` may take at most (the follower normally ends at once).
STOP_BOUND_S = 5.0
#: How long subscribing to the update channel may take.
FEED_TIMEOUT_S = 2.0
#: The heartbeat script's arguments that make it only read: no poller id.
_READ_MEMBERS = ["", 0, "", ""]


def _settings(url: str, namespace: str) -> RedisSettings:
    """``RedisSettings`` for ``from_url``; a bad URL or namespace is a ``ConfigError``
    that says what is wrong (poller/redis/settings.py words it)."""
    try:
        return RedisSettings(url=url, namespace=namespace)
    except ValidationError as exc:
        lines = [line for _, line in describe_errors(exc, RedisSettings)]
        raise ConfigError("; ".join(lines)) from None


def _number(name: str, value: object, *, whole: bool = False) -> None:
    kinds = (int,) if whole else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or not math.isfinite(value)
        or value <= 0
    ):
        kind = "an integer" if whole else "a number"
        raise ConfigError(f"{name} must be {kind} > 0, got {value!r}")


class _Reader:
    """What both readers share: keys, options, the three scripts, reply decoding."""

    def __init__(
        self,
        client: Any,
        namespace: str = "llmgw",
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> None:
        if not isinstance(namespace, str) or not re.match(NAMESPACE_PATTERN, namespace):
            raise ConfigError(f"namespace must be 1-64 of A-Z a-z 0-9 . _ : -, got {namespace!r}")
        _number("stale_after_intervals", stale_after_intervals)
        if stale_after_ms is not None:
            _number("stale_after_ms", stale_after_ms, whole=True)
        _number("resync_s", resync_s)
        self.client = client
        self.keys = Keys(namespace)
        self.stale_after_intervals = stale_after_intervals
        self.stale_after_ms = stale_after_ms
        self.resync_s = resync_s
        self._snapshot = client.register_script(lua("snapshot"))
        # The registry of the last snapshot: the next one skips it while it is unchanged
        # (a fifth of a snapshot's bytes). Replaced whole, so concurrent calls are safe.
        self._held: Held | None = None
        self._get_records = client.register_script(lua("get_records"))
        self._members = client.register_script(lua("heartbeat"))

    def _snapshot_call(self) -> tuple[list[str], list[str], Held | None]:
        held = self._held
        keys, args = snapshot_call(self.keys, held)
        return keys, args, held

    def _view(self, reply: Any, held: Held | None) -> View:
        # The clocks side by side, so a picker places this replica's requests on the view.
        view = build_view(
            reply,
            self.stale_after_intervals,
            self.stale_after_ms,
            held,
            read_at_ms=time.monotonic() * 1000,
        )
        self._held = held_after(reply, view)
        if len(reply) > 8 and not reply[8]:  # no schema key: nothing ever wrote here
            view = dataclasses.replace(view, schema_missing=True)
        return view

    def _records_call(self, endpoint_id: str) -> tuple[list[str], list[str]]:
        return records_call(self.keys, endpoint_id)

    def _one(self, endpoint_id: str, reply: Any) -> EndpointView | None:
        return one_from_records(endpoint_id, reply, self.stale_after_intervals, self.stale_after_ms)

    def _members_keys(self) -> list[str]:
        return [self.keys.members, self.keys.schema, self.keys.epoch]

    @staticmethod
    def _pollers(reply: Any) -> list[str]:
        check_schema(reply[1])
        return sorted(str(m) for m in reply[3:])

    def _protocol(self) -> Protocol:
        cache = ViewCache(
            self.stale_after_intervals, self.stale_after_ms, namespace=self.keys.namespace
        )
        return Protocol(cache, self.resync_s)

    def _exchange(
        self, cache: ViewCache, share: bool, replica_id: str | None, share_placements: bool
    ) -> Exchange | None:
        """The gateway sharing of ``cached(share=..., share_placements=...)``
        (poller/reader/share.py, placements.py): one call per period carries both."""
        if not share and not share_placements:
            return None
        fleet = FleetLoad(replica_id)
        if share:
            cache.fleet = fleet  # else its counts are never used (nor written: none attached)
        keys = self.keys
        placements = cache.placements if share_placements else None
        cache.exchange = Exchange(
            self.client, keys.gateways_inflight, cache, fleet, placements, keys.gateways_placements
        )
        return cache.exchange


class StatsReader(_Reader):
    """Read the view (asyncio). Build from a URL, settings, or a redis-py client of
    yours (``decode_responses=True``; a ``RedisCluster`` works too)."""

    client: aioredis.Redis | RedisCluster

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        namespace: str = "llmgw",
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> None:
        super().__init__(
            client,
            namespace,
            stale_after_intervals=stale_after_intervals,
            stale_after_ms=stale_after_ms,
            resync_s=resync_s,
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "llmgw",
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> StatsReader:
        """A client of its own for ``url`` (any form ``RedisSettings`` takes); a bad URL
        raises ``ConfigError``."""
        return cls.from_settings(
            _settings(url, namespace),
            stale_after_intervals=stale_after_intervals,
            stale_after_ms=stale_after_ms,
            resync_s=resync_s,
        )

    @classmethod
    def from_settings(
        cls,
        settings: RedisSettings,
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> StatsReader:
        """The poller's own client set-up: timeouts, TLS options, Sentinel, Cluster."""
        return cls(
            connect(settings),
            settings.namespace,
            stale_after_intervals=stale_after_intervals,
            stale_after_ms=stale_after_ms,
            resync_s=resync_s,
        )

    async def __aenter__(self) -> StatsReader:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client (and a Sentinel client's sentinel connections)."""
        await close_client(self.client)

    async def snapshot(self) -> View:
        keys, args, held = self._snapshot_call()
        reply = await redis_call(self._snapshot(keys=keys, args=args), "snapshot")
        return self._view(reply, held)

    async def get(self, endpoint_id: str) -> EndpointView | None:
        """One endpoint as a snapshot would show it, or None if it is not registered."""
        keys, args = self._records_call(endpoint_id)
        reply = await redis_call(self._get_records(keys=keys, args=args), "read endpoint")
        return self._one(endpoint_id, reply)

    async def live_pollers(self) -> list[str]:
        """Live poller ids, sorted (the heartbeat script with no id only reads)."""
        call = self._members(keys=self._members_keys(), args=_READ_MEMBERS)
        return self._pollers(await redis_call(call, "members"))

    @asynccontextmanager
    async def cached(
        self,
        *,
        share: bool = True,
        replica_id: str | None = None,
        share_placements: bool = True,
    ) -> AsyncIterator[ViewCache]:
        """A local cache kept current in the background; reads never touch Redis.
        ``share``: exchange this replica's requests in flight with the other gateway
        replicas (``cache.fleet``; docs/reader.md), under ``replica_id`` (default
        hostname, pid and a random suffix). ``share_placements``: exchange the prefix
        placements of picks with a prompt too (``cache.placements``), on the same call;
        False: each replica uses and records its own only."""
        proto = self._protocol()
        first, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(self._follow(proto, first, stop), name="reader-cache")
        exchange = self._exchange(proto.cache, share, replica_id, share_placements)
        sharing = None if exchange is None else asyncio.create_task(exchange.run(stop))
        try:
            try:
                # Give the first snapshot a moment, but never fail the caller over it.
                await asyncio.wait_for(first.wait(), timeout=2.0)
            except TimeoutError:
                pass
            if isinstance(proto.error, SchemaMismatch):
                raise proto.error  # a reader of another schema version must not start
            yield proto.cache
        finally:
            stop.set()
            await _end(task)
            if sharing is not None:
                await _end(sharing)

    async def _follow(self, proto: Protocol, first: asyncio.Event, stop: asyncio.Event) -> None:
        # The loop checks ``stop`` at least every MAX_WAIT_S: on Python 3.11 a cancel can be
        # swallowed by the asyncio.wait_for inside redis-py, and must not keep us running.
        while not stop.is_set():
            try:
                async with self._updates() as updates:
                    # Subscribed first, then snapshot: no update can fall between them.
                    proto.loaded(await self.snapshot(), time.monotonic())
                    first.set()
                    while not stop.is_set():
                        for data in await updates(proto.wait_s(time.monotonic())):
                            await self._perform(proto, proto.message(data, time.monotonic()))
                        await self._perform(proto, proto.due(time.monotonic()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # StoreError, or a bug: the cache must outlive both
                wait_s = proto.lost(exc)
                first.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait_s)

    @asynccontextmanager
    async def _updates(self) -> AsyncIterator[Callable[[float], Awaitable[list[str]]]]:
        """``P:updates`` as ``next(timeout_s) -> the messages that arrived``: our own feed
        (feed.py), or redis-py's PubSub for a client whose connections it cannot copy."""
        channel = self.keys.updates
        async with pubsub_client(self.client, (channel,)) as own:
            feed = await open_feed(own, channel, FEED_TIMEOUT_S)
            if feed is not None:
                try:
                    yield feed.next
                finally:
                    feed.close()
                return
        async with subscribe(self.client, shard_channels=(channel,)) as pubsub:

            async def next_messages(timeout_s: float) -> list[str]:
                message = await redis_call(pubsub.get_message(timeout=timeout_s), "updates")
                out = []
                while message is not None:
                    out.append(str(message["data"]))
                    message = await redis_call(pubsub.get_message(timeout=0.0), "updates")
                return out

            yield next_messages

    async def _perform(self, proto: Protocol, action: Action | None) -> None:
        if action is None:
            return
        if action.kind == "probe":
            # A quiet channel may mean a frozen Redis (SIGSTOP, partition): one bounded
            # read a second notices it in ~2 s, and catches a missed registry change.
            async with asyncio.timeout(1.0):
                rev = await redis_call(self.client.get(self.keys.endpoints_rev), "probe")
            action = proto.probed(int(rev or 0))
        if action is None:
            return
        if action.kind == "read":
            keys, args = self._records_call(action.endpoint_id)
            reply = await redis_call(self._get_records(keys=keys, args=args), "read endpoint")
            proto.cache.apply_records(action.endpoint_id, reply)
        else:
            proto.loaded(await self.snapshot(), time.monotonic())


async def _end(task: asyncio.Task[None]) -> None:
    """Stop the follower: it sees its stop flag within MAX_WAIT_S, and a cancel (repeated,
    since Python 3.11 may swallow one) ends a call in flight. Never waits past the bound."""
    deadline = time.monotonic() + STOP_BOUND_S
    while not task.done() and time.monotonic() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if not task.done():
        log.warning("reader cache did not stop within %.0f s; leaving it to its flag", STOP_BOUND_S)
    elif not task.cancelled() and task.exception() is not None:
        log.warning("reader cache ended with an error: %s", task.exception())


class SyncStatsReader(_Reader):
    """The same reader for threaded gateways (redis-py's blocking client): the same
    methods with the same arguments, not coroutines; ``close()`` for ``aclose()``."""

    client: redis.Redis | redis.cluster.RedisCluster

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster,
        namespace: str = "llmgw",
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> None:
        super().__init__(
            client,
            namespace,
            stale_after_intervals=stale_after_intervals,
            stale_after_ms=stale_after_ms,
            resync_s=resync_s,
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "llmgw",
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> SyncStatsReader:
        """A client of its own for ``url`` (any form ``RedisSettings`` takes); a bad URL
        raises ``ConfigError``."""
        return cls.from_settings(
            _settings(url, namespace),
            stale_after_intervals=stale_after_intervals,
            stale_after_ms=stale_after_ms,
            resync_s=resync_s,
        )

    @classmethod
    def from_settings(
        cls,
        settings: RedisSettings,
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> SyncStatsReader:
        """The poller's own client set-up: timeouts, TLS options, Sentinel, Cluster."""
        return cls(
            connect_sync(settings),
            settings.namespace,
            stale_after_intervals=stale_after_intervals,
            stale_after_ms=stale_after_ms,
            resync_s=resync_s,
        )

    def __enter__(self) -> SyncStatsReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the client (and a Sentinel client's sentinel connections)."""
        close_client_sync(self.client)

    def _call(self, fn: Any, what: str, *args: Any, **kwargs: Any) -> Any:
        return redis_call_sync(fn, what, *args, **kwargs)

    def snapshot(self) -> View:
        keys, args, held = self._snapshot_call()
        return self._view(self._call(self._snapshot, "snapshot", keys=keys, args=args), held)

    def get(self, endpoint_id: str) -> EndpointView | None:
        """One endpoint as a snapshot would show it, or None if it is not registered."""
        keys, args = self._records_call(endpoint_id)
        reply = self._call(self._get_records, "read endpoint", keys=keys, args=args)
        return self._one(endpoint_id, reply)

    def live_pollers(self) -> list[str]:
        """Live poller ids, sorted (the heartbeat script with no id only reads)."""
        keys = self._members_keys()
        return self._pollers(self._call(self._members, "members", keys=keys, args=_READ_MEMBERS))

    @contextmanager
    def cached(
        self,
        *,
        share: bool = True,
        replica_id: str | None = None,
        share_placements: bool = True,
    ) -> Iterator[ViewCache]:
        """A cache kept current by a daemon thread; stopped when the block ends.
        ``share``, ``replica_id``, ``share_placements``: as ``StatsReader.cached`` (a
        second daemon thread)."""
        proto = self._protocol()
        stop, first = threading.Event(), threading.Event()
        thread = threading.Thread(
            target=self._follow, args=(proto, stop, first), name="reader-cache", daemon=True
        )
        thread.start()
        exchange = self._exchange(proto.cache, share, replica_id, share_placements)
        sharing = None
        if exchange is not None:
            sharing = threading.Thread(
                target=exchange.run_sync, args=(stop,), name="reader-share", daemon=True
            )
            sharing.start()
        try:
            first.wait(2.0)
            if isinstance(proto.error, SchemaMismatch):
                raise proto.error  # a reader of another schema version must not start
            yield proto.cache
        finally:
            stop.set()
            thread.join(STOP_BOUND_S)
            if sharing is not None:
                sharing.join(STOP_BOUND_S)

    def _follow(self, proto: Protocol, stop: threading.Event, first: threading.Event) -> None:
        channel = self.keys.updates
        while not stop.is_set():
            wait_s = 0.0
            try:
                # On Cluster: a client of the node that carries the channel (SSUBSCRIBE).
                with pubsub_client_sync(self.client, (channel,)) as own:
                    self._follow_on(own, proto, stop, first)
            except Exception as exc:
                wait_s = proto.lost(exc)
                first.set()
            stop.wait(wait_s)

    def _follow_on(
        self, own: Any, proto: Protocol, stop: threading.Event, first: threading.Event
    ) -> None:
        pubsub = own.pubsub(ignore_subscribe_messages=True)
        try:
            self._call(pubsub.ssubscribe, "SSUBSCRIBE", self.keys.updates)
            proto.loaded(self.snapshot(), time.monotonic())
            first.set()
            while not stop.is_set():
                timeout_s = proto.wait_s(time.monotonic())
                message = self._call(pubsub.get_message, "updates", timeout=timeout_s)
                if message is not None:
                    self._perform(proto, proto.message(str(message["data"]), time.monotonic()))
                self._perform(proto, proto.due(time.monotonic()))
        finally:
            try:
                pubsub.close()
            except Exception:
                log.debug("pubsub close failed", exc_info=True)

    def _perform(self, proto: Protocol, action: Action | None) -> None:
        if action is not None and action.kind == "probe":
            rev = self._call(self.client.get, "probe", name=self.keys.endpoints_rev)
            action = proto.probed(int(rev or 0))
        if action is None:
            return
        if action.kind == "read":
            keys, args = self._records_call(action.endpoint_id)
            reply = self._call(self._get_records, "read endpoint", keys=keys, args=args)
            proto.cache.apply_records(action.endpoint_id, reply)
        else:
            proto.loaded(self.snapshot(), time.monotonic())
