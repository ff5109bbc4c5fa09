"""``SyncStatsReader``: the reader for threaded gateways (redis-py's blocking client), the
twin of ``StatsReader`` (reader.py) with the same methods and arguments, not coroutines; a
Router's view is followed by a daemon thread, and its exchange with the other replicas by
a second."""

from __future__ import annotations

import logging
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import redis
import redis.cluster

from poller.errors import SchemaMismatch
from poller.reader.base import READ_MEMBERS, STOP_BOUND_S, ReaderBase
from poller.reader.exchange import loops
from poller.reader.exchange.exchange import Exchange
from poller.reader.legacy import LegacyCache
from poller.reader.router import Router
from poller.reader.routing.options import RoutingOptions
from poller.reader.view.cache import ViewCache
from poller.reader.view.follow import Action, FollowProtocol
from poller.reader.view.records import EndpointView
from poller.reader.view.snapshot import View
from poller.redis.connection import close_client_sync, connect_sync, pubsub_client_sync
from poller.redis.errors import redis_call_sync
from poller.redis.settings import RedisSettings

__all__ = ["SyncStatsReader"]

log = logging.getLogger(__name__)


class SyncStatsReader(ReaderBase):
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

    @staticmethod
    def _connect(settings: RedisSettings) -> redis.Redis | redis.cluster.RedisCluster:
        return connect_sync(settings)

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
        return self._pollers(self._call(self._members, "members", keys=keys, args=READ_MEMBERS))

    @contextmanager
    def router(
        self,
        options: RoutingOptions | None = None,
        *,
        replica_id: str | None = None,
        rng: random.Random | None = None,
    ) -> Iterator[Router]:
        """This gateway replica's ``Router``, as ``StatsReader.router`` (the view and the
        exchange each followed by a daemon thread); stopped when the block ends."""
        router = self._router(options, replica_id, rng)
        with self._following(router):
            yield router

    @contextmanager
    def cached(
        self,
        *,
        share: bool = True,
        replica_id: str | None = None,
        share_placements: bool = True,
    ) -> Iterator[ViewCache]:
        """Deprecated: ``router()``, as ``StatsReader.cached``."""
        warnings.warn(
            "SyncStatsReader.cached() is deprecated: open a Router with reader.router() "
            "(router.view(), router.get(id), router.pick())",
            DeprecationWarning,
            stacklevel=3,
        )
        options = RoutingOptions(share=share, share_placements=share_placements)
        cache = LegacyCache(
            self.stale_after_intervals, self.stale_after_ms, namespace=self.keys.namespace
        )
        cache.router = self._router(options, replica_id, None, cache)
        with self._following(cache.router):
            yield cache

    @contextmanager
    def _following(self, router: Router) -> Iterator[None]:
        proto = self._protocol(router.cache)
        exchange = router.exchange
        stop, first = threading.Event(), threading.Event()
        also = self._heard(exchange)
        thread = threading.Thread(
            target=self._follow,
            args=(proto, stop, first, also, exchange),
            name="reader-cache",
            daemon=True,
        )
        thread.start()
        sharing = None
        if exchange is not None:
            sharing = threading.Thread(
                target=loops.run_sync, args=(exchange, stop), name="reader-share", daemon=True
            )
            sharing.start()
        try:
            first.wait(2.0)
            if isinstance(proto.error, SchemaMismatch):
                raise proto.error  # a reader of another schema version must not start
            yield
        finally:
            stop.set()
            thread.join(STOP_BOUND_S)
            if sharing is not None:
                sharing.join(STOP_BOUND_S)

    def _follow(
        self,
        proto: FollowProtocol,
        stop: threading.Event,
        first: threading.Event,
        also: dict[str, Callable[[str], None]],
        exchange: Exchange | None,
    ) -> None:
        while not stop.is_set():
            wait_s = 0.0
            try:
                # On Cluster: a client of the node that carries the channel (SSUBSCRIBE).
                with pubsub_client_sync(self.client, (self.keys.updates, *also)) as own:
                    self._follow_on(own, proto, stop, first, also, exchange)
            except Exception as exc:
                if exchange is not None:
                    if also and exchange.refused_channel(exc):
                        also = {}
                        continue  # the view at once, without the gateways' channel
                    exchange.subscribed(False)
                wait_s = proto.lost(exc)
                first.set()
            stop.wait(wait_s)

    def _follow_on(
        self,
        own: Any,
        proto: FollowProtocol,
        stop: threading.Event,
        first: threading.Event,
        also: dict[str, Callable[[str], None]],
        exchange: Exchange | None,
    ) -> None:
        pubsub = own.pubsub(ignore_subscribe_messages=True)
        try:
            self._call(pubsub.ssubscribe, "SSUBSCRIBE", self.keys.updates, *also)
            proto.loaded(self.snapshot(), time.monotonic())
            first.set()
            if exchange is not None and also:
                exchange.subscribed(True)
            while not stop.is_set():
                timeout_s = proto.wait_s(time.monotonic())
                message = self._call(pubsub.get_message, "updates", timeout=timeout_s)
                if message is not None:
                    take = also.get(str(message["channel"])) if also else None
                    if take is not None:
                        take(str(message["data"]))
                    else:
                        data = str(message["data"])
                        self._perform(proto, proto.message(data, time.monotonic()))
                self._perform(proto, proto.due(time.monotonic()))
        finally:
            try:
                pubsub.close()
            except Exception:
                log.debug("pubsub close failed", exc_info=True)

    def _perform(self, proto: FollowProtocol, action: Action | None) -> None:
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
