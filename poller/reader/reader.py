"""What a gateway replica imports: the shared view of every endpoint, from Redis.

Importable without httpx or APScheduler (the package's public API). Two flavours, twins
with the same methods, arguments and client set-up (Sentinel and Cluster included):

- ``StatsReader`` (asyncio, here) and ``SyncStatsReader`` (threaded gateways, sync.py;
  what both share is in base.py); each is a context manager that closes its client on
  exit (``async with`` / ``with``).
- ``snapshot()`` reads the whole view in one round trip at one moment of the Redis clock;
  ``get(id)`` reads one endpoint exactly as a snapshot would show it (the same records,
  the same decode). Both raise ``StoreError`` if Redis is unreachable.
- ``router()`` opens the replica's ``Router``: a local ``ViewCache`` that follows
  ``P:updates`` (each update carries its record: no read per update; view/follow.py),
  resyncs fully on every (re)connect and every ``resync_s`` because pub/sub drops
  messages while disconnected, and never raises into the routing path (while Redis is
  away it serves the last view, marked stale); beside it the exchange with the other
  replicas. Leaving the block always ends both within a bound.

    async with StatsReader.from_url("redis://redis:6379/0") as reader:
        async with reader.router() as router:
            ticket = router.pick("meta-llama/Llama-3.1-8B-Instruct")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import TracebackType

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from poller.errors import SchemaMismatch
from poller.reader.base import READ_MEMBERS, STOP_BOUND_S, ReaderBase
from poller.reader.exchange import loops
from poller.reader.exchange.exchange import Exchange
from poller.reader.legacy import LegacyCache
from poller.reader.router import Router
from poller.reader.routing.options import RoutingOptions
from poller.reader.view.cache import ViewCache
from poller.reader.view.feed import open_feed
from poller.reader.view.follow import Action, FollowProtocol
from poller.reader.view.records import EndpointView
from poller.reader.view.snapshot import View
from poller.redis.connection import (
    close_client,
    connect,
    pubsub_client,
    subscribe,
)
from poller.redis.errors import redis_call
from poller.redis.settings import RedisSettings
from poller.util.tasks import raise_if_cancelled

__all__ = ["StatsReader"]

log = logging.getLogger(__name__)

#: How long subscribing to the update channel may take.
FEED_TIMEOUT_S = 2.0


class StatsReader(ReaderBase):
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

    @staticmethod
    def _connect(settings: RedisSettings) -> aioredis.Redis | RedisCluster:
        return connect(settings)

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
        call = self._members(keys=self._members_keys(), args=READ_MEMBERS)
        return self._pollers(await redis_call(call, "members"))

    @asynccontextmanager
    async def router(
        self,
        options: RoutingOptions | None = None,
        *,
        replica_id: str | None = None,
        rng: random.Random | None = None,
    ) -> AsyncIterator[Router]:
        """This gateway replica's ``Router``, its view kept current in the background
        and its state shared with the other replicas as ``options`` say (docs/reader.md,
        "The Router"). ``replica_id``: its id in the shared counts (default hostname,
        pid and a random suffix); ``rng``: the picks' random source (seeded in tests).
        Entering waits up to 2 s for the first view, never fails over it, and raises
        ``SchemaMismatch`` when Redis holds another schema version."""
        router = self._router(options, replica_id, rng)
        async with self._following(router):
            yield router

    @asynccontextmanager
    async def cached(
        self,
        *,
        share: bool = True,
        replica_id: str | None = None,
        share_placements: bool = True,
    ) -> AsyncIterator[ViewCache]:
        """Deprecated: ``router()`` (``router.view()``, ``router.get(id)``). A cache kept
        current in the background, sharing as ``share`` and ``share_placements`` say."""
        warnings.warn(
            "StatsReader.cached() is deprecated: open a Router with reader.router() "
            "(router.view(), router.get(id), router.pick())",
            DeprecationWarning,
            stacklevel=3,
        )
        options = RoutingOptions(share=share, share_placements=share_placements)
        cache = LegacyCache(
            self.stale_after_intervals, self.stale_after_ms, namespace=self.keys.namespace
        )
        cache.router = self._router(options, replica_id, None, cache)
        async with self._following(cache.router):
            yield cache

    @asynccontextmanager
    async def _following(self, router: Router) -> AsyncIterator[None]:
        """The router's view followed and its exchange run until the block ends."""
        proto = self._protocol(router.cache)
        exchange = router.exchange
        first, stop = asyncio.Event(), asyncio.Event()
        also = self._heard(exchange)
        follow = self._follow(proto, first, stop, also, exchange)
        task = asyncio.create_task(follow, name="reader-cache")
        sharing = None if exchange is None else asyncio.create_task(loops.run(exchange, stop))
        try:
            try:
                # Give the first snapshot a moment, but never fail the caller over it.
                await asyncio.wait_for(first.wait(), timeout=2.0)
            except TimeoutError:
                pass
            if isinstance(proto.error, SchemaMismatch):
                raise proto.error  # a reader of another schema version must not start
            yield
        finally:
            stop.set()
            if sharing is not None:  # its last call: this replica leaves the totals
                await asyncio.wait({sharing}, timeout=LEAVE_S)
            await _end(task)
            if sharing is not None:
                await _end(sharing)

    async def _follow(
        self,
        proto: FollowProtocol,
        first: asyncio.Event,
        stop: asyncio.Event,
        also: dict[str, Callable[[str], None]],
        exchange: Exchange | None,
    ) -> None:
        # On Python 3.11 a cancel can be swallowed by the asyncio.wait_for inside redis-py:
        # each turn checks for one (raise_if_cancelled), and ``stop`` at least every
        # MAX_WAIT_S, so neither keeps us running.
        while not stop.is_set():
            raise_if_cancelled()
            try:
                async with self._updates(also) as updates:
                    # Subscribed first, then snapshot: no update can fall between them.
                    proto.loaded(await self.snapshot(), time.monotonic())
                    first.set()
                    if exchange is not None and also:
                        exchange.subscribed(True)
                    while not stop.is_set():
                        raise_if_cancelled()
                        for data in await updates(proto.wait_s(time.monotonic())):
                            await self._perform(proto, proto.message(data, time.monotonic()))
                        await self._perform(proto, proto.due(time.monotonic()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # StoreError, or a bug: the cache must outlive both
                if exchange is not None:
                    if also and exchange.refused_channel(exc):
                        also = {}
                        continue  # the view at once, without the gateways' channel
                    exchange.subscribed(False)
                wait_s = proto.lost(exc)
                first.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait_s)

    @asynccontextmanager
    async def _updates(
        self, also: dict[str, Callable[[str], None]]
    ) -> AsyncIterator[Callable[[float], Awaitable[list[str]]]]:
        """``P:updates`` as ``next(timeout_s) -> the messages that arrived``: our own feed
        (feed.py), or redis-py's PubSub for a client whose connections it cannot copy.
        The channels of ``also`` (same slot) go to their callables as they arrive."""
        channel = self.keys.updates
        channels = (channel, *also)
        async with pubsub_client(self.client, channels) as own:
            feed = await open_feed(own, channel, FEED_TIMEOUT_S, also)
            if feed is not None:
                try:
                    yield feed.next
                finally:
                    feed.close()
                return
        async with subscribe(self.client, shard_channels=channels) as pubsub:

            async def next_messages(timeout_s: float) -> list[str]:
                message = await redis_call(pubsub.get_message(timeout=timeout_s), "updates")
                out = []
                while message is not None:
                    take = also.get(str(message["channel"])) if also else None
                    if take is not None:
                        take(str(message["data"]))
                    else:
                        out.append(str(message["data"]))
                    message = await redis_call(pubsub.get_message(timeout=0.0), "updates")
                return out

            yield next_messages

    async def _perform(self, proto: FollowProtocol, action: Action | None) -> None:
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


#: How long a closing router waits for its exchange's last call (it sees its stop flag
#: within ``LISTEN_S``; the call has a 1 s bound of its own).
LEAVE_S = 1.5


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
