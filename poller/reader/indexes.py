"""The picker's indexes: one per view it is given, and the cache's kept current as each
change is applied (poller/reader/picker.py; docs/reader.md)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping

from poller.reader.cache import ViewCache
from poller.reader.index import Index
from poller.reader.scores import as_judged, timed
from poller.reader.view import EndpointView, View

__all__ = ["FOLLOW_IDLE_MS", "Indexes"]

#: A picker keeps following a cache's changes while it picked on it within this long
#: (ms); one idle longer brings its index up to date at its next pick instead.
FOLLOW_IDLE_MS = 10_000


class Indexes:
    """The indexing half of ``Picker``: finds (or builds) the index of what a pick is
    given, and follows a cache's changes between picks."""

    max_waiting: int
    max_kv_cache_usage: float
    stale_grace_s: float
    _lock: threading.Lock
    _caches: weakref.WeakKeyDictionary[ViewCache, Index]
    # The cache picked on last and its index: a gateway has one, and this skips the
    # weak dictionary's lookup (a third of a pick).
    _last: tuple[weakref.ref[ViewCache], Index] | None
    _view: object
    _view_index: Index | None

    def _source(
        self, view: View | Mapping[str, EndpointView]
    ) -> tuple[Index, float, float | None] | None:
        """(index, Redis ms to judge freshness at, clock offset) or None: no numbers may
        be used (Redis lost for longer than the grace). A ``ViewCache`` goes straight to
        ``_from_cache``."""
        if isinstance(view, View) and view.cache is not None:
            return self._from_cache(view.cache)  # the same numbers, already indexed
        given = view
        if not isinstance(view, View):  # a mapping of endpoints, as judged when made
            view = View(0, 0, view)
        judge_ms: float = view.now_ms
        if not view.healthy:
            confirmed = view.now_ms if view.confirmed_ms is None else view.confirmed_ms
            if view.now_ms - confirmed > self.stale_grace_s * 1000:
                return None
            judge_ms = confirmed
        if given is not self._view or self._view_index is None:
            fresh_until = as_judged if view.healthy else timed
            self._view_index = self._index(view.endpoints.values(), fresh_until)
            # A View is kept with its index; a bare mapping may change in place (a
            # dict the caller updates), so it is indexed again at every pick.
            self._view = given if given is view else None
        return self._view_index, judge_ms, view.offset_ms

    def _from_cache(self, cache: ViewCache) -> tuple[Index, float, float | None] | None:
        if not cache.loaded:
            return None
        if cache.healthy:
            judge_ms: float = cache.now_ms()
        else:
            at, confirmed = cache.confirmed_at, cache.confirmed_ms()
            if at is None or confirmed is None or time.monotonic() - at > self.stale_grace_s:
                return None
            judge_ms = confirmed
        version = cache.version  # first: changes made meanwhile wait for the next pick
        last = self._last
        if last is not None and last[0]() is cache:
            index: Index | None = last[1]
        else:
            index = self._caches.get(cache)
            if index is not None:
                self._last = (weakref.ref(cache), index)
        if index is None or index.version != version:
            index = self._current(cache, index, version)
        index.picked_ms = judge_ms
        return index, judge_ms, cache.offset_ms

    def _current(self, cache: ViewCache, index: Index | None, version: int) -> Index:
        """The cache's index brought up to ``version`` (under the lock): the changes
        since applied, or built anew (the first pick, a snapshot, a log outrun)."""
        changes = None if index is None else cache.changes_since(index.version, version)
        if index is None or changes is None:
            bases = (cache.base(endpoint_id) for endpoint_id in cache.ids())
            if cache not in self._caches:
                cache.follow(self._follow)
            index = self._index((b for b in bases if b is not None), timed)
            self._caches[cache] = index
        else:
            for endpoint_id in dict.fromkeys(changes):
                index.update(endpoint_id, cache.base(endpoint_id))
        index.version = version
        self._last = (weakref.ref(cache), index)
        return index

    def _follow(self, cache: ViewCache) -> None:
        """The cache applied a change (``ViewCache.follow``): its index is brought up to
        date now, in the thread applying it, so a pick finds it current; not while this
        picker has not picked on the cache for ``FOLLOW_IDLE_MS`` (a picker set aside
        costs nothing: its next pick catches up)."""
        with self._lock:
            index = self._caches.get(cache)
            if index is None or index.version == cache.version:
                return
            if cache.now_ms() - index.picked_ms <= FOLLOW_IDLE_MS:
                self._current(cache, index, cache.version)

    def _index(
        self, views: Iterable[EndpointView], fresh_until: Callable[[EndpointView], float | None]
    ) -> Index:
        return Index(views, fresh_until, self.max_waiting, self.max_kv_cache_usage)
