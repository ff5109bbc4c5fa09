"""The index a pick reads: one per view it is given, and a cache's kept current as each
change is applied (docs/reader.md, "Cost").

``Indexer.of_cache`` finds the index of a ``ViewCache`` (built on the first pick, then
brought up to date from the cache's change log in the thread that applies each change,
``ViewCache.follow``, so a pick decodes nothing); ``of_view`` indexes a ``View`` once
and keeps it while it is the one given, and a bare mapping, which may change in place,
at every call. Both say at which Redis moment freshness is judged: now, or, while Redis
is lost, when it last answered, for ``stale_grace_s``; then no index at all.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping

from poller.reader.routing.index import INF, Index
from poller.reader.view.cache import ViewCache
from poller.reader.view.records import EndpointView
from poller.reader.view.snapshot import View

__all__ = ["FOLLOW_IDLE_MS", "Found", "Indexer", "as_judged", "timed"]

#: An index keeps following a cache's changes while it was picked on within this long
#: (ms); one idle longer brings itself up to date at its next pick instead.
FOLLOW_IDLE_MS = 10_000

#: What a pick reads: (the index, the Redis ms freshness is judged at, the clock offset:
#: Redis ms minus local monotonic ms, None when unknown).
Found = tuple[Index, float, float | None]


def timed(view: EndpointView) -> float | None:
    """Until when (Redis ms) the endpoint's stats are fresh; None: not usable at all."""
    t = view.timing
    if t is None:  # built by hand: its state is all there is
        return as_judged(view)
    if t.scraped_at_ms is None:
        return None
    if t.failing and (t.failure_at_ms is None or t.failure_at_ms >= t.scraped_at_ms):
        return None
    return float(t.scraped_at_ms + t.bound_ms)


def as_judged(view: EndpointView) -> float | None:
    """A snapshot's endpoints as judged at its ``now_ms``: fresh ones stay usable."""
    return INF if view.state == "fresh" else None


class Indexer:
    """The indexes of what picks are given, under ``lock`` (a pick holds it too: an
    index changes in the thread that applies a cache's change)."""

    def __init__(self, max_waiting: int, max_kv_cache_usage: float, stale_grace_s: float) -> None:
        self.max_waiting = max_waiting
        self.max_kv_cache_usage = max_kv_cache_usage
        self.stale_grace_s = stale_grace_s
        self.lock = threading.Lock()
        self._caches: weakref.WeakKeyDictionary[ViewCache, Index] = weakref.WeakKeyDictionary()
        # The cache indexed last and its index: a gateway has one, and this skips the
        # weak dictionary's lookup (a third of a pick).
        self._last: tuple[weakref.ref[ViewCache], Index] | None = None
        self._view: object = None
        self._view_index: Index | None = None

    def of_cache(self, cache: ViewCache) -> Found | None:
        """The cache's index (under ``lock``), or None: no numbers may be used (never
        loaded, a namespace without its schema key, or Redis lost for longer than
        ``stale_grace_s``)."""
        if not cache.loaded:
            return None
        if cache.healthy:
            judge_ms: float = cache.now_ms()
        else:
            if cache.schema_missing:  # nothing ever wrote the namespace: no view at all
                return None
            at, confirmed = cache.confirmed_at, cache.confirmed_ms()
            if at is None or confirmed is None or cache.clock() - at > self.stale_grace_s:
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

    def of_view(self, view: View | Mapping[str, EndpointView]) -> Found | None:
        """The index of a ``View`` (kept while it is the one given) or of a mapping of
        endpoints (indexed at every call: it may change in place), under ``lock``."""
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
            self._view = given if given is view else None
        return self._view_index, judge_ms, view.offset_ms

    def _current(self, cache: ViewCache, index: Index | None, version: int) -> Index:
        """The cache's index brought up to ``version``: the changes since applied, or
        built anew (the first pick, a snapshot, a log outrun)."""
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
        date now, in the thread applying it, so a pick finds it current; not while no
        pick read it for ``FOLLOW_IDLE_MS`` (an index set aside costs nothing: its next
        pick catches up)."""
        with self.lock:
            index = self._caches.get(cache)
            if index is None or index.version == cache.version:
                return
            if cache.now_ms() - index.picked_ms <= FOLLOW_IDLE_MS:
                self._current(cache, index, cache.version)

    def _index(
        self, views: Iterable[EndpointView], fresh_until: Callable[[EndpointView], float | None]
    ) -> Index:
        return Index(views, fresh_until, self.max_waiting, self.max_kv_cache_usage)
