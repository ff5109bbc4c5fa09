"""The exchange: one script call per period that carries what the replicas share.

Both reader flavours run it every ``period_s`` (a task beside the asyncio follower, a
thread beside the threaded one): this replica's requests in flight (``FleetLoad``,
poller/reader/share.py) and, with ``cached(share_placements=True)``, its prefix
placements (``Placements``, poller/reader/placements.py) go out and the others' come
back on the same call of poller/schema/scripts/share.lua: the placements cost no
command more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from poller.reader.outbox import READ_COUNT, STREAM_MAXLEN
from poller.reader.placements import Placements
from poller.reader.share import REFUSED_RETRY_S, FleetLoad, pages_of

__all__ = ["Exchange"]

log = logging.getLogger(__name__)


def _refused(exc: Exception) -> bool:
    """Redis said no to the share script's writes: the user lacks the right (NOPERM
    for a command, "can't run this command" for one inside a script)."""
    text = str(exc)
    return "NOPERM" in text or "no permissions" in text or "can't run this command" in text


class Exchange:
    """The share script's call for one ``FleetLoad`` (and ``Placements``) on one cache."""

    def __init__(
        self,
        client: Any,
        gateways_key: str,
        cache: Any,
        fleet: FleetLoad,
        placements: Placements | None = None,
        placements_key: str = "",
    ) -> None:
        from poller.schema.lua import lua

        self.key = gateways_key
        self.cache = cache
        self.fleet = fleet
        #: Carried on the same call (``cached(share_placements=True)``): no command more.
        self.placements = placements
        self.placements_key = placements_key
        if placements is not None:
            placements.sharing = True
        self._carried: str | None = None  # the placements the call in flight writes
        self._placements_refused = False
        self._placements_suspect = False  # refused with the stream: whose rights?
        self._placements_retry_at = 0.0
        self.script = client.register_script(lua("share"))
        self.calls = 0  # commands sent, for the benchmark's commands/s
        self._refused = False
        self._pages_now: dict[str, tuple[int, int]] | None = None
        self._version = -1  # the cache's version ``_pages_now`` is of
        #: Pages changed since the last ``absorb`` (None: any may have).
        self._changed: set[str] | None = None

    def _pages(self) -> dict[str, tuple[int, int]]:
        """Every endpoint's page, kept from the cache's change log (all read again after
        a snapshot or when the log has moved on): the work follows what changed."""
        cache = self.cache
        version = cache.version  # read first: the changes up to it are all in the log
        pages = self._pages_now
        changes = None if pages is None else cache.changes_since(self._version, version)
        placements = self.placements
        if pages is None or changes is None:
            pages = self._pages_now = pages_of((i, cache.base(i)) for i in cache.ids())
            self._changed = None
            if placements is not None:
                for endpoint_id in pages:
                    _observe(placements, endpoint_id, cache.base(endpoint_id))
        else:
            changed = set(changes)
            for endpoint_id in changed:
                base = cache.base(endpoint_id)
                stats = getattr(base, "stats", None)
                if stats is None:
                    pages.pop(endpoint_id, None)
                else:
                    pages[endpoint_id] = (stats.running + stats.waiting, stats.scraped_at_ms)
                    if placements is not None:
                        _observe(placements, endpoint_id, base)
            # Added to what the last call left unabsorbed (None: everything, still).
            self._changed = None if self._changed is None else self._changed | changed
        self._version = version
        return pages

    def prepare(self) -> tuple[list[str], list[Any], dict[str, tuple[int, int]]]:
        pages = self._pages()
        fleet = self.fleet
        ours = fleet.take_changed()
        if self._changed is not None:
            self._changed |= ours
        record = fleet.record(pages, self.cache.offset_ms, self._changed)
        outgoing = fleet.outgoing(record, self.cache.now_ms())
        self.calls += 1
        keys: list[str] = [self.key]
        args: list[Any] = [fleet.replica_id, fleet.ttl_ms, outgoing]
        placements, self._carried = self.placements, None
        if placements is not None and time.monotonic() >= self._placements_retry_at:
            self._carried = placements.outgoing()
            keys.append(self.placements_key)
            age_ms = int(placements.age_s * 1000)
            args += [self._carried, placements.last_id, STREAM_MAXLEN, age_ms, READ_COUNT]
        return keys, args, pages

    def answered(self, reply: Sequence[Any], pages: Mapping[str, tuple[int, int]]) -> None:
        self._refused = False
        fields = reply[2:]
        placements = self.placements
        if self._carried is not None and placements is not None:
            self._placements_refused = False
            placements.absorb(reply[2])
            fields = reply[3:]
        elif self._placements_suspect and placements is not None:
            self._placements_suspect = False
            self._placements_refused_now(placements)
        changed, self._changed = self._changed, set()
        self.fleet.absorb(list(fields), pages, self.cache.offset_ms, changed=changed)

    def _placements_refused_now(self, placements: Placements) -> None:
        """The call with the stream was refused, the one without it answered: the
        gateway's user lacks the stream's rights. Own placements only; tried again
        every ``REFUSED_RETRY_S``."""
        placements.exchanged_at = None
        if not self._placements_refused:
            key = self.placements_key
            log.warning(
                "prefix placement sharing refused by Redis: this replica uses its own "
                "placements. The gateway's ACL user needs XADD, XTRIM, XRANGE, XREVRANGE "
                "and PEXPIRE on %s: add (~%s +xadd +xtrim +xrange +xrevrange +pexpire) to "
                "its line (deploy/redis/users.acl), or open the cache with "
                "cached(share_placements=False)",
                key,
                key,
            )
        self._placements_refused = True

    def failed(self, exc: Exception, pages: Mapping[str, tuple[int, int]]) -> float:
        """Local counts only; returns how long to wait before the next try (s)."""
        self.fleet.forget_written()
        changed, self._changed = self._changed, set()
        self.fleet.absorb([], pages, self.cache.offset_ms, shared=False, changed=changed)
        placements, carried, self._carried = self.placements, self._carried, None
        if placements is not None and carried is not None:
            placements.unsent(carried)
            if _refused(exc):
                # The stream's rights, or the hash's: the next call, without the
                # stream, tells which (``answered`` or below).
                self._placements_suspect = True
                self._placements_retry_at = time.monotonic() + REFUSED_RETRY_S
                return self.fleet.period_s
        self._placements_suspect = False  # refused without the stream: the hash's rights
        if _refused(exc):
            self.fleet.exchanged_at = None  # not shared from now: the health says so
            if not self._refused:
                log.warning(
                    "gateway load sharing refused by Redis (%s): this replica routes on its "
                    "own requests in flight and the pages. The gateway's ACL user needs "
                    "HSET, HDEL and PEXPIRE on %s: add (~%s +hset +hdel +pexpire) to its "
                    "line (deploy/redis/users.acl), or open the cache with "
                    "cached(share=False)",
                    exc,
                    self.key,
                    self.key,
                )
            self._refused = True
            return REFUSED_RETRY_S
        log.debug("gateway load sharing failed: %s", exc)
        return self.fleet.period_s

    async def run(self, stop: Any) -> None:
        """Until ``stop`` (an ``asyncio.Event``) is set."""
        import asyncio

        while not stop.is_set():
            keys, args, pages = self.prepare()
            wait_s = self.fleet.period_s
            try:
                async with asyncio.timeout(1.0):
                    reply = await self.script(keys=keys, args=args)
                self.answered(reply, pages)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away, NOPERM: routing goes on, locally
                wait_s = self.failed(exc, pages)
            try:
                async with asyncio.timeout(wait_s):
                    await stop.wait()
            except TimeoutError:
                pass

    def run_sync(self, stop: threading.Event) -> None:
        """Until ``stop`` is set (the threaded reader's thread)."""
        while not stop.is_set():
            keys, args, pages = self.prepare()
            wait_s = self.fleet.period_s
            try:
                self.answered(self.script(keys=keys, args=args), pages)
            except Exception as exc:
                wait_s = self.failed(exc, pages)
            stop.wait(wait_s)


def _observe(placements: Placements, endpoint_id: str, view: Any) -> None:
    """The endpoint's prefix-cache counters, to the placements: going back voids its."""
    stats = getattr(view, "stats", None)
    if stats is not None:
        placements.observe(
            endpoint_id, stats.prefix_cache_queries_total, stats.prefix_cache_hits_total
        )
