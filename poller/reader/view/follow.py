"""The cached reader's protocol, without I/O: both readers drive this one state machine.

    subscribe P:updates -> snapshot -> apply updates -> resync every resync_s
                                                     -> probe every probe_s when quiet

The drivers (poller/reader/reader.py and sync.py: asyncio and a thread) only move bytes:
they hand every message to ``message()``, ask ``due()`` what to do next, and perform the
returned ``Action``: a snapshot, a read of one endpoint, or a probe of
``P:endpoints:rev``.

Applying an update needs no read: a stats update carries the whole record (and replaces
the failure), a failure update the whole failure record. The reader reads back an
endpoint only when a ``seq`` (or failure count) skips a value, which means messages were
lost; it drops messages older than what it holds (the ones that crossed a snapshot).
"""

from __future__ import annotations

import logging
from typing import Literal, NamedTuple

from poller.errors import SchemaMismatch
from poller.reader.view.cache import ViewCache
from poller.reader.view.snapshot import View
from poller.schema.records import json_int, parse_update, written_ms
from poller.util.backoff import backoff_s

__all__ = ["MAX_WAIT_S", "Action", "FollowProtocol"]

log = logging.getLogger(__name__)

#: Seconds a driver may block waiting for a message: how soon it sees its stop flag.
MAX_WAIT_S = 0.25


class Action(NamedTuple):
    kind: Literal["snapshot", "read", "probe"]
    endpoint_id: str = ""


SNAPSHOT = Action("snapshot")
PROBE = Action("probe")


class FollowProtocol:
    """What a cached reader knows and decides; the clock (``now``, monotonic s) is given."""

    def __init__(self, cache: ViewCache, resync_s: float = 5.0, probe_s: float = 1.0) -> None:
        self.cache = cache
        self.resync_s = resync_s
        self.probe_s = probe_s
        self.failures = 0
        self.next_resync = 0.0
        self.next_probe = 0.0
        self.applied = 0  # updates applied without a read
        self.read_backs = 0
        self.ever_loaded = False  # a first view read: later failures lose Redis
        #: Why the connection was last lost (None once a snapshot arrived).
        self.error: BaseException | None = None

    # --- connection lifecycle -------------------------------------------------------------

    def loaded(self, view: View, now: float) -> None:
        """A snapshot arrived (taken after subscribing, so no update falls between)."""
        self.cache.load(view)
        self.cache.healthy = True
        self.failures = 0
        self.error = None
        self.ever_loaded = True
        self.next_resync = now + self.resync_s
        self.next_probe = now + self.probe_s

    def lost(self, exc: BaseException) -> float:
        """The connection failed: serve the last view as unhealthy; seconds to wait."""
        if isinstance(exc, SchemaMismatch):
            # Not an outage: retrying will not help until someone upgrades; say so loudly.
            if self.error is None or self.failures == 0:
                log.error("reader cannot read this Redis, serving the last view: %s", exc)
        elif not self.ever_loaded:
            if self.failures == 0:
                log.warning("reader cannot reach Redis, no view read from it yet: %s", exc)
        elif self.cache.healthy or self.failures == 0:
            log.warning("reader lost Redis, serving the last view: %s", exc)
        self.error = exc
        self.cache.healthy = False
        self.failures += 1
        return backoff_s(self.failures)

    # --- steady state -----------------------------------------------------------------------

    def wait_s(self, now: float) -> float:
        """How long a driver may wait for the next message."""
        return max(0.0, min(self.next_resync, self.next_probe, now + MAX_WAIT_S) - now)

    def due(self, now: float) -> Action | None:
        if now >= self.next_resync:
            return SNAPSHOT
        if now >= self.next_probe:
            self.next_probe = now + self.probe_s
            return PROBE
        return None

    def probed(self, rev: int) -> Action | None:
        """The probe's reply (``P:endpoints:rev``): a missed registry change resyncs."""
        self.cache.confirm()
        return SNAPSHOT if rev != self.cache.rev else None

    def message(self, data: str, now: float) -> Action | None:
        # Any message proves the connection alive: no probe needed while updates flow.
        self.next_probe = now + self.probe_s
        self.cache.confirm()
        update = parse_update(data)
        if update is None:
            return None
        kind, endpoint_id, seq, record = update
        if kind == "endpoints":
            return SNAPSHOT if endpoint_id != str(self.cache.rev) else None
        if kind == "released" or not self.cache.knows(endpoint_id):
            # A release changes no record (the owner shown is the last writer); an id
            # the registry does not have yet arrives with the snapshot its change causes.
            return None
        stats_ms, failure_ms = self.cache.written_ms(endpoint_id)
        at_ms = written_ms(record)
        if kind == "stats":
            held = self.cache.stats_record(endpoint_id)
            last = None if held is None else json_int(held, "seq")
            # Older than what we hold (it crossed a snapshot)? Writes within one ms are
            # ordered by seq.
            if at_ms < failure_ms or (at_ms, seq) <= (stats_ms, last or 0):
                return None
            if last is not None and seq not in (last + 1, 1):
                return self._read_back(endpoint_id)
            self.cache.set_stats(endpoint_id, record)
        else:
            held = self.cache.failure_record(endpoint_id)
            last = None if held is None else json_int(held, "count")
            if at_ms < stats_ms or (at_ms, seq) <= (failure_ms, last or 0):
                return None
            if seq > 1 and last is not None and seq != last + 1:
                return self._read_back(endpoint_id)
            self.cache.set_failure(endpoint_id, record)
        self.applied += 1
        return None

    def _read_back(self, endpoint_id: str) -> Action:
        self.read_backs += 1
        return Action("read", endpoint_id)
