"""The picker API of earlier releases, kept working for one release on the Router's
routing rules: ``Picker``, ``pick`` and the cache ``cached()`` yields.

A gateway now holds a ``Router`` (poller/reader/router.py), which owns what these left
to the caller to wire: the cache, this replica's ``LocalLoad``, the fleet's counts, the
placements. ``from poller import Picker`` (and ``LocalLoad``, ``pick``) and
``reader.cached()`` warn with the replacement (docs/reader.md, "From the Picker to the
Router"). Importing from this module does not warn: it is not public.
"""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from poller.reader.exchange.exchange import Exchange
from poller.reader.exchange.wire import LOST_AFTER_MS
from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import LocalLoad
from poller.reader.prefix.blocks import block_ids
from poller.reader.prefix.placements import Placements
from poller.reader.router import Router, check_pick
from poller.reader.routing.affinity import prefer
from poller.reader.routing.index import INF
from poller.reader.routing.indexer import Found, Indexer
from poller.reader.routing.models import (
    FleetLoadModel,
    LoadModel,
    LocalLoadModel,
    ViewLoad,
)
from poller.reader.routing.options import (
    PREFIX_LOAD_FACTOR,
    PREFIX_LOAD_SLACK,
    RoutingOptions,
    WhenSaturated,
    check_options,
)
from poller.reader.routing.pick import Pick
from poller.reader.view.cache import ViewCache
from poller.reader.view.records import EndpointView
from poller.reader.view.snapshot import View

__all__ = ["LegacyCache", "Picker", "WhenSaturated", "pick"]

#: The replacement each deprecated name's warning gives.
REPLACEMENTS = {
    "Picker": "open a Router with reader.router() and call router.pick(); it returns "
    "a ticket that counts the request (docs/reader.md)",
    "LocalLoad": "the Router counts each request from router.pick() until its ticket "
    "ends (router.track() for one sent without a pick); router.local is its LocalLoad",
    "pick": "open a Router with reader.router() and call router.pick()",
}


class LegacyCache(ViewCache):
    """What ``cached()`` yields: the view cache of a Router the reader opened, with the
    attributes the cache had when it carried the sharing itself."""

    router: Router

    @property
    def fleet(self) -> FleetLoad | None:
        return self.router.fleet if self.router.options.share else None

    @property
    def placements(self) -> Placements:
        return self.router.placements

    @property
    def exchange(self) -> Exchange | None:
        return self.router.exchange

    @property
    def load_shared(self) -> bool:
        return self.router.options.share and self.router.load_shared

    @property
    def placements_shared(self) -> bool:
        return self.router.placements_shared


class Picker:
    """Chooses an endpoint for each request by the Router's rules (docs/reader.md, "The
    Router"), on a ``ViewCache`` (fastest), a ``View`` (indexed on first pick) or a
    mapping of ``EndpointView``s (indexed at every pick). Without ``local`` the load is
    the view's alone; with a ``LocalLoad`` it is corrected by this replica's requests,
    and, on a cache that shares (``cached()``), it is the fleet's shared counts.
    Deprecated: use a ``Router``."""

    def __init__(
        self,
        max_waiting: int = 5,
        max_kv_cache_usage: float = 0.8,
        when_saturated: WhenSaturated = "least_loaded",
        stale_grace_s: float = 5.0,
        rng: random.Random | None = None,
        *,
        scale_local: bool = True,
        use_latency: bool = True,
        share: bool = True,
        prefix_load_factor: float = PREFIX_LOAD_FACTOR,
        prefix_load_slack: float = PREFIX_LOAD_SLACK,
    ) -> None:
        check_options(
            max_waiting,
            max_kv_cache_usage,
            when_saturated,
            stale_grace_s,
            prefix_load_factor,
            prefix_load_slack,
        )
        self.max_waiting = max_waiting
        self.max_kv_cache_usage = max_kv_cache_usage
        self.when_saturated: WhenSaturated = when_saturated
        self.stale_grace_s = stale_grace_s
        self.rng = rng if rng is not None else random.Random()
        self.scale_local = scale_local
        self.use_latency = use_latency
        self.share = share
        self.prefix_load_factor = float(prefix_load_factor)
        self.prefix_load_slack = float(prefix_load_slack)
        self.placements = Placements()  # of picks on views no Router made
        self._indexer = Indexer(max_waiting, max_kv_cache_usage, stale_grace_s)
        # The fleet each LocalLoad was last published in (a cache closed and opened
        # again hands it over to the new one).
        self._fleets: weakref.WeakKeyDictionary[LocalLoad, FleetLoad] = weakref.WeakKeyDictionary()

    @property
    def options(self) -> RoutingOptions:
        return RoutingOptions(
            self.max_waiting,
            self.max_kv_cache_usage,
            self.when_saturated,
            self.stale_grace_s,
            share=self.share,
            scale_local=self.scale_local,
            use_latency=self.use_latency,
            prefix_load_factor=self.prefix_load_factor,
            prefix_load_slack=self.prefix_load_slack,
        )

    def pick(
        self,
        view: View | ViewCache | Mapping[str, EndpointView],
        model: str | None = None,
        *,
        prompt: str | None = None,
        candidates: Iterable[str] | None = None,
        local: LocalLoad | None = None,
    ) -> str | None:
        """The endpoint id for one request, or None when no endpoint may take it."""
        if not isinstance(view, _VIEW_TYPES):
            raise TypeError(
                f"pick() needs a ViewCache, a View or a mapping of EndpointViews, "
                f"got {type(view).__name__}"
            )
        check_pick(model, candidates, 0)
        if local is not None and not isinstance(local, LocalLoad):
            raise TypeError(f"local must be a LocalLoad or None, got {type(local).__name__}")
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str or None, got {type(prompt).__name__}")
        ids = None if prompt is None else block_ids(prompt, model)
        wanted = None if candidates is None else list(candidates)
        with self._indexer.lock:
            if isinstance(view, ViewCache):
                found = self._indexer.of_cache(view)
            else:
                found = self._indexer.of_view(view)
            if found is None:
                return None
            load, router = self._model(view, local)
            found = self._offset(found, view, local)
            index, judge_ms, offset_ms = found
            score = load.scorer(index, offset_ms)
            pick = Pick(index, model, judge_ms, load, score, self.rng, self.when_saturated, wanted)
            chosen = pick.choose()
            if chosen is None or ids is None:
                return chosen
            table = router.placements if router is not None else self.placements
            held = table.lookup(ids)
            if any(held[0]):
                bound = score
                if self.use_latency and local is not None:
                    bound = load.scorer(index, offset_ms, bound=True)
                chosen = prefer(
                    pick,
                    table,
                    ids,
                    held,
                    chosen,
                    bound,
                    factor=self.prefix_load_factor,
                    slack=self.prefix_load_slack,
                    agree=self._agree(table, router, load),
                )
            slot = index.slots.get(chosen)
            if slot is not None:
                table.observe(chosen, slot.prefix_queries, slot.prefix_hits, slot.scraped_at_ms)
            table.record(chosen, ids, None if slot is None else slot.capacity, held)
            return chosen

    def _model(self, view: object, local: LocalLoad | None) -> tuple[LoadModel, Router | None]:
        """The load model for a pick on ``view`` with ``local``, and the Router whose
        cache ``view`` is (None: a cache or view no Router made)."""
        router = view.router if isinstance(view, LegacyCache) else None
        if local is None:
            return _VIEW_LOAD, router
        if self.share:
            fleet = self._fleet_of(router, local)
            if fleet is not None:
                shared = FleetLoadModel(
                    local,
                    fleet,
                    LOST_AFTER_MS / 1000,
                    use_latency=self.use_latency,
                    max_waiting=self.max_waiting,
                )
                return shared, router
        own = LocalLoadModel(local, scale_local=self.scale_local, use_latency=self.use_latency)
        return own, router

    def _fleet_of(self, router: Router | None, local: LocalLoad) -> FleetLoad | None:
        """The shared counts ``local`` is published in: the Router's, when the cache is
        one of a Router that shares (``local`` attached to it then, and left by the one
        before), else the one it was last published in."""
        held = self._fleets.get(local)
        fleet = None if router is None or not router.options.share else router.fleet
        if fleet is None or fleet is held:
            return held
        if held is not None:
            held.detach(local)
        fleet.attach(local)
        self._fleets[local] = fleet
        return fleet

    @staticmethod
    def _offset(found: Found, view: object, local: LocalLoad | None) -> Found:
        """A view without a clock offset is taken as read just now; a bare mapping has
        no clock: every request in flight counts."""
        index, judge_ms, offset_ms = found
        if local is None or offset_ms is not None or isinstance(view, ViewCache):
            return found
        offset = view.now_ms - local.now() * 1000 if isinstance(view, View) else INF
        return index, judge_ms, offset

    @staticmethod
    def _agree(table: Placements, router: Router | None, load: LoadModel) -> bool:
        """Agree by the hash (routing/affinity.py): the placements not shared, and this
        replica not known to be alone (its fleet's counts current, no other replica's)."""
        if router is not None and isinstance(load, FleetLoadModel):
            return router._agree()
        if table.answered_within(LOST_AFTER_MS / 1000):
            return False
        return not (isinstance(load, FleetLoadModel) and load.shared() and not load.fleet.peers)


_VIEW_LOAD = ViewLoad()
#: What ``pick`` takes as its view (a tuple made once: ``A | B`` builds a union a call).
_VIEW_TYPES = (ViewCache, View, Mapping)
# One picker per set of options, shared by every caller of ``pick`` in this process.
_pickers: dict[tuple[Any, ...], Picker] = {}
_lock = threading.Lock()


def pick(
    view: View | ViewCache | Mapping[str, EndpointView],
    model: str | None = None,
    *,
    prompt: str | None = None,
    candidates: Iterable[str] | None = None,
    max_waiting: int = 5,
    max_kv_cache_usage: float = 0.8,
    when_saturated: WhenSaturated = "least_loaded",
    stale_grace_s: float = 5.0,
    local: LocalLoad | None = None,
) -> str | None:
    """``Picker.pick`` in one call, on a picker shared by the process. Deprecated: use a
    ``Router``."""
    key = (max_waiting, max_kv_cache_usage, when_saturated, stale_grace_s)
    picker = _pickers.get(key)
    if picker is None:
        with _lock:
            picker = _pickers.setdefault(
                key, Picker(max_waiting, max_kv_cache_usage, when_saturated, stale_grace_s)
            )
    return picker.pick(view, model, prompt=prompt, candidates=candidates, local=local)
