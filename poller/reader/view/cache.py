"""A local copy of the view that follows updates; every read is a dict lookup.

It holds the view and nothing else: what a gateway replica shares or routes with sits
above it (``poller.reader.router``). The cache keeps the view as a snapshot delivers it:
the registry and the two kinds of compact records, as strings. An endpoint is decoded
(``decode.view_from_records``, the decode of a snapshot and of ``get(id)`` too) when
first asked for after a change, and that one ``EndpointView`` is what every later
lookup, ``view()`` and a picker's index read until the next change.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from poller.reader.view.decode import LazyEndpoints, check_schema, view_from_records
from poller.reader.view.records import EndpointView
from poller.reader.view.snapshot import View
from poller.redis.clock import server_ms
from poller.schema.keys import Keys
from poller.schema.records import written_ms

__all__ = ["ViewCache", "log_schema_missing"]

log = logging.getLogger(__name__)


def log_schema_missing(namespace: str) -> None:
    """The one WARNING a cached reader logs when its namespace has no schema key (again
    only after the key appeared and went)."""
    log.warning(
        "namespace %s has no schema key (%s): nothing ever wrote it: wrong namespace? "
        "The view stays empty and the cache unhealthy until a poller writes there",
        namespace,
        Keys(namespace).schema,
    )


class ViewCache:
    """The view kept by a cached reader; ``get``/``view`` never touch Redis.

    Ages stay right between updates: the cache keeps the offset between the local
    monotonic clock and the Redis clock, taken at every reply from Redis. While Redis is
    unreachable (``healthy`` False) it keeps serving the last view, ages growing, and
    reports nothing as fresh; ``confirmed_at`` says when Redis last answered.

    ``version`` counts the changes; ``changes_since(version, upto)`` names the endpoints
    that changed in between, so a picker keeps its index current without rescanning.
    ``follow(callback)``: the callback runs after each change is applied (a snapshot
    loaded, an update, a read-back), in the thread that applies it: a picker brings its
    index up to date there, off the pick path.
    """

    #: Changes remembered for ``changes_since``; an index further behind rebuilds.
    CHANGE_LOG_MAX = 4096

    def __init__(
        self,
        stale_after_intervals: float = 2.0,
        stale_after_ms: int | None = None,
        *,
        namespace: str = "",
        clock: Callable[[], float] = time.monotonic,
    ):
        #: Local seconds (``time.monotonic``; a simulation passes its own).
        self.clock = clock
        self.stale_after_intervals = stale_after_intervals
        self.stale_after_ms = stale_after_ms
        self._entries: dict[str, str] = {}
        self._stats: dict[str, str] = {}
        self._failures: dict[str, str] = {}
        self._built: dict[str, EndpointView] = {}  # decoded bases, dropped on change
        self._offset_ms = 0.0
        self.rev = -1
        self.pollers: list[str] = []
        #: The namespace read, for the log line that says it has no schema key.
        self.namespace = namespace
        #: The namespace has no schema key (``View.schema_missing``): nothing ever wrote
        #: there, most likely a wrong namespace. ``healthy`` is False meanwhile.
        self.schema_missing = False
        self._reachable = False
        self.loaded = False
        self.updated_at = 0.0  # monotonic seconds of the last reply applied
        #: Monotonic seconds of the last sign of life from Redis (a reply, an update, a
        #: probe answered); None before the first.
        self.confirmed_at: float | None = None
        self.version = 0
        # (start, ids changed): ids[i] made version start + i + 1. One attribute, replaced
        # whole, so a thread reading it never pairs one log with another's start.
        self._changes: tuple[int, list[str]] = (0, [])
        # Called after every change (``follow``), held weakly: a picker dropped by its
        # owner stops following.
        self._followers: list[weakref.WeakMethod[Callable[[ViewCache], None]]] = []

    @property
    def healthy(self) -> bool:
        """Redis answers and the namespace has a schema key: the view is what pollers
        wrote. False while Redis is unreachable (the last view is served, marked stale)
        or while the namespace has no schema key (``schema_missing``)."""
        return self._reachable and not self.schema_missing

    @healthy.setter
    def healthy(self, reachable: bool) -> None:
        """Whether Redis answers (the protocol sets it; the schema key is read apart)."""
        self._reachable = reachable

    def _schema(self, missing: bool) -> None:
        if missing and not self.schema_missing:
            log_schema_missing(self.namespace or "(unnamed)")
        self.schema_missing = missing

    def _clock(self, redis_now_ms: int) -> None:
        now = self.clock()
        self._offset_ms = redis_now_ms - now * 1000
        self.updated_at = self.confirmed_at = now

    def confirm(self) -> None:
        """Redis answered (an update, a probe): what the cache holds is current."""
        self.confirmed_at = self.clock()

    def now_ms(self) -> int:
        """The Redis clock, estimated locally."""
        return int(self.clock() * 1000 + self._offset_ms)

    @property
    def offset_ms(self) -> float:
        """Redis clock minus the local ``clock()``, in ms (0 before the first reply)."""
        return self._offset_ms

    def confirmed_ms(self) -> int | None:
        """``confirmed_at`` on the Redis clock."""
        at = self.confirmed_at
        return None if at is None else int(at * 1000 + self._offset_ms)

    def follow(self, callback: Callable[[ViewCache], None]) -> None:
        """Call ``callback(self)`` after each change is applied, in the applying thread;
        ``callback`` is a bound method, held weakly (its object's end ends it). An
        exception it raises is logged, never raised into the reader."""
        self._followers = [
            *(f for f in self._followers if f() is not None),
            weakref.WeakMethod(callback),
        ]

    def _notify(self) -> None:
        for ref in self._followers:
            callback = ref()
            if callback is None:
                continue
            try:
                callback(self)
            except Exception:
                log.exception("a follower of the view cache failed on a change")

    def _changed(self, endpoint_id: str) -> None:
        start, log = self._changes
        if len(log) >= self.CHANGE_LOG_MAX:
            start, log = self.version, []
            self._changes = (start, log)
        log.append(endpoint_id)
        # Counted after the append: a reader that reads ``version`` first and asks for
        # the changes up to it never skips one (a thread may append meanwhile).
        self.version += 1

    def changes_since(self, version: int, upto: int) -> list[str] | None:
        """Endpoints changed after ``version`` up to ``upto`` (repeats possible), or None
        when that is no longer known (a snapshot replaced everything, or too many
        changes since)."""
        start, log = self._changes
        if version < start:
            return None
        return log[version - start : upto - start]

    def load(self, view: View) -> None:
        """Replace everything with a snapshot."""
        endpoints = view.endpoints
        if isinstance(endpoints, LazyEndpoints):
            self._entries = dict(endpoints.entries)
            self._stats = dict(endpoints.stats)
            self._failures = dict(endpoints.failures)
            self._built = endpoints.decoded()  # what the snapshot's reader already decoded
        else:  # a View built by hand: keep its entries as they are
            self._entries = {e: "" for e in endpoints}
            self._stats, self._failures = {}, {}
            self._built = dict(endpoints)
        self.rev = view.rev
        self.pollers = view.pollers
        self._schema(view.schema_missing)
        self._clock(view.now_ms)
        self.loaded = True
        self._changes = (self.version + 1, [])
        self.version += 1
        self._notify()

    # --- changes the protocol applies (follow.py) -------------------------------------

    def knows(self, endpoint_id: str) -> bool:
        return endpoint_id in self._entries

    def stats_record(self, endpoint_id: str) -> str | None:
        return self._stats.get(endpoint_id)

    def failure_record(self, endpoint_id: str) -> str | None:
        return self._failures.get(endpoint_id)

    def set_stats(self, endpoint_id: str, record: str) -> None:
        """An accepted stats write: it replaced the stats and cleared the failure."""
        self._stats[endpoint_id] = record
        self._failures.pop(endpoint_id, None)
        self._built.pop(endpoint_id, None)
        self._changed(endpoint_id)
        self._notify()

    def set_failure(self, endpoint_id: str, record: str) -> None:
        self._failures[endpoint_id] = record
        self._built.pop(endpoint_id, None)
        self._changed(endpoint_id)
        self._notify()

    def apply_records(self, endpoint_id: str, reply: Sequence[Any]) -> None:
        """GET_RECORDS' reply: the endpoint as a snapshot shows it, or gone."""
        if len(reply) > 5:
            check_schema(reply[5])
            self._schema(not reply[5])
        self._clock(server_ms(reply))
        self._built.pop(endpoint_id, None)
        self._changed(endpoint_id)
        if not reply[2]:
            for table in (self._entries, self._stats, self._failures):
                table.pop(endpoint_id, None)
        else:
            self._entries[endpoint_id] = str(reply[2])
            for table, record in ((self._stats, reply[3]), (self._failures, reply[4])):
                if record:
                    table[endpoint_id] = str(record)
                else:
                    table.pop(endpoint_id, None)
        self._notify()

    # --- reads ----------------------------------------------------------------------------

    def base(self, endpoint_id: str) -> EndpointView | None:
        """The endpoint as last decoded, its state as of the decode (``get`` gives it as
        of now): the one decoded form of its records, which ``get``, ``view`` and a
        picker's index all read; the picker judges freshness from its ``timing``."""
        base = self._built.get(endpoint_id)
        if base is None:
            entry_json = self._entries.get(endpoint_id)
            if entry_json is None:
                return None
            base = view_from_records(
                endpoint_id,
                entry_json,
                self._stats.get(endpoint_id),
                self._failures.get(endpoint_id),
                self.now_ms(),
                self.stale_after_intervals,
                self.stale_after_ms,
            )
            self._built[endpoint_id] = base
        return base

    def get(self, endpoint_id: str) -> EndpointView | None:
        base = self.base(endpoint_id)
        return None if base is None else base.at(self.now_ms(), self.healthy)

    def ids(self) -> list[str]:
        return list(self._entries)

    def view(self) -> View:
        now = self.now_ms()
        healthy = self.healthy
        endpoints: dict[str, EndpointView] = {}
        for endpoint_id in list(self._entries):
            base = self.base(endpoint_id)
            if base is not None:
                endpoints[endpoint_id] = base.at(now, healthy)
        return View(
            now,
            self.rev,
            endpoints,
            list(self.pollers),
            offset_ms=self._offset_ms,
            healthy=healthy,
            confirmed_ms=self.confirmed_ms(),
            schema_missing=self.schema_missing,
        )

    def written_ms(self, endpoint_id: str) -> tuple[int, int]:
        """(stats write time, failure write time) of what the cache holds; -1 if none."""
        stats, failure = self._stats.get(endpoint_id), self._failures.get(endpoint_id)
        return (
            -1 if stats is None else written_ms(stats),
            -1 if failure is None else written_ms(failure),
        )
