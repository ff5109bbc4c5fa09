"""What both reader flavours share (``StatsReader`` in reader.py, ``SyncStatsReader`` in
sync.py): keys, options, the three scripts, reply decoding, and a Router's parts."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import time
from collections.abc import Callable
from typing import Any, Self

from pydantic import ValidationError

from poller.errors import ConfigError
from poller.reader.exchange.exchange import Exchange
from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import LocalLoad
from poller.reader.prefix.placements import Placements
from poller.reader.router import Router
from poller.reader.routing.options import RoutingOptions
from poller.reader.view.cache import ViewCache
from poller.reader.view.decode import (
    Held,
    build_view,
    check_schema,
    held_after,
    one_from_records,
    records_call,
    snapshot_call,
)
from poller.reader.view.follow import FollowProtocol
from poller.reader.view.records import EndpointView
from poller.reader.view.snapshot import View
from poller.redis.settings import NAMESPACE_PATTERN, RedisSettings
from poller.schema.keys import Keys
from poller.schema.lua import lua
from poller.util.messages import describe_errors

__all__ = ["READ_MEMBERS", "STOP_BOUND_S", "ReaderBase", "settings_of"]

#: How long leaving ``cached()`` may take at most (the follower normally ends at once).
STOP_BOUND_S = 5.0
#: The heartbeat script's arguments that make it only read: no poller id.
READ_MEMBERS = ["", 0, "", ""]


def settings_of(url: str, namespace: str) -> RedisSettings:
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


class ReaderBase:
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

    @staticmethod
    def _connect(settings: RedisSettings) -> Any:
        """A client of the flavour's kind for ``settings`` (each reader's own)."""
        raise NotImplementedError

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "llmgw",
        *,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        resync_s: float = 5.0,
    ) -> Self:
        """A client of its own for ``url`` (any form ``RedisSettings`` takes); a bad URL
        raises ``ConfigError``."""
        return cls.from_settings(
            settings_of(url, namespace),
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
    ) -> Self:
        """The poller's own client set-up: timeouts, TLS options, Sentinel, Cluster."""
        return cls(
            cls._connect(settings),
            settings.namespace,
            stale_after_intervals=stale_after_intervals,
            stale_after_ms=stale_after_ms,
            resync_s=resync_s,
        )

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

    def _router(
        self,
        options: RoutingOptions | None,
        replica_id: str | None,
        rng: random.Random | None,
        cache: ViewCache | None = None,
    ) -> Router:
        """A Router on a new cache of this reader's view, with the exchange its options
        share through (the follower and the exchange are started by the caller)."""
        options = RoutingOptions() if options is None else options
        if not isinstance(options, RoutingOptions):
            raise TypeError(f"options must be a RoutingOptions, got {type(options).__name__}")
        if cache is None:
            cache = self._cache()
        fleet = FleetLoad(replica_id) if options.share else None
        placements = Placements()
        exchange = None
        if options.share or options.share_placements:
            keys = self.keys
            exchange = Exchange(
                self.client,
                keys.gateways_inflight,
                cache,
                fleet if fleet is not None else FleetLoad(replica_id),
                placements if options.share_placements else None,
                keys.gateways_placements,
                keys.gateways_updates,
                totals_keys=(keys.gateways_load, keys.gateways_changed, keys.gateways_alive),
                share_load=options.share,
            )
        return Router(
            cache,
            options,
            local=LocalLoad(),
            fleet=fleet,
            placements=placements,
            exchange=exchange,
            rng=rng,
        )

    def _cache(self) -> ViewCache:
        return ViewCache(
            self.stale_after_intervals, self.stale_after_ms, namespace=self.keys.namespace
        )

    def _protocol(self, cache: ViewCache) -> FollowProtocol:
        return FollowProtocol(cache, self.resync_s)

    @staticmethod
    def _heard(exchange: Exchange | None) -> dict[str, Callable[[str], None]]:
        """The channels the follower subscribes to beside ``P:updates``: the gateways'
        shared counts, when the exchange shares them."""
        if exchange is None or not exchange.share_load:
            return {}
        return {exchange.channel: exchange.heard}
