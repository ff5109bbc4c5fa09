"""What the picker measures: an endpoint's freshness, and its load on the fleet's
shared counts (docs/reader.md, "The load estimate")."""

from __future__ import annotations

import math
from collections.abc import Callable

from poller.reader.cache import ViewCache
from poller.reader.index import INF, Slot
from poller.reader.load import FAILING_MAX, LocalLoad
from poller.reader.share import FleetLoad
from poller.reader.view import EndpointView

__all__ = [
    "as_judged",
    "fleet_of",
    "fleet_score",
    "is_full",
    "neutral",
    "not_full",
    "timed",
    "view_load",
]


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


def fleet_score(
    local: LocalLoad, fleet: FleetLoad, *, latency: bool = True, speed: bool = True
) -> Callable[[Slot], tuple[float, float]]:
    """The load on the fleet's estimate (docs/reader.md, "The load estimate"): (the
    estimate of the others' requests + ours in flight + 1) / relative capacity, x the
    endpoint's failure factor ``1 + (FAILING_MAX - 1) x local.failing``, or its speed
    factor if larger: ``local.slowness`` weighted by the share of the counts that are
    guesses, ``1 + (slowness - 1) x peers / (1 + peers)`` when the others' counts are
    read (0 when they are pushed, ``fleet.pushed``, or with one gateway: the counts are
    exact); ties by KV usage. ``latency=False``: neither factor; ``speed=False``: the
    failure factor only."""
    in_flight, failing, slower = local.in_flight, local.failing, local.slowness
    # Redis lost (no answer within a second): the others' counts, no longer current,
    # are left out; this replica's own and the pages' outside traffic remain.
    extra, peers = (fleet.extra, fleet.peers) if fleet.shared else (fleet.outside, 0)
    share = 0.0 if fleet.pushed or not (speed and latency) else peers / (1 + peers)
    now = local.now()
    if not latency:
        failing = _never
    request_s = local.request_s
    fading = fleet.fading if fleet.current and request_s > 0.0 else None

    def score(slot: Slot) -> tuple[float, float]:
        base = extra.get(slot.id)
        if base is None:
            base = slot.requests
        elif fading:
            seen = fading.get(slot.id)
            if seen is not None:
                age = now - seen[0]
                base += seen[1] * math.exp(-age / request_s) if age > 0.0 else seen[1]
        load = (base + in_flight(slot.id) + 1) / slot.weight
        factor = 1.0 + (slower(slot.id, now) - 1.0) * share if share else 1.0
        failed = failing(slot.id, now)
        if failed:
            failed = 1.0 + (FAILING_MAX - 1.0) * failed
            if failed > factor:
                factor = failed
        return load * factor, slot.kv or 0.0

    return score


def fleet_of(view: object, local: LocalLoad) -> FleetLoad | None:
    """The shared counts ``local`` is published in: the cache's, when the view comes
    from a cache that shares (``local`` attached to it then, and left by the fleet of a
    cache before, closed or reopened since), else its own."""
    cache = view if isinstance(view, ViewCache) else getattr(view, "cache", None)
    fleet: FleetLoad | None = getattr(cache, "fleet", None)
    held = local.fleet
    if fleet is None or fleet is held:
        return held
    if held is not None:
        held.detach(local)
    fleet.attach(local)
    return fleet


def _never(endpoint_id: str, now: float | None = None) -> float:
    return 0.0


def is_full(slot: Slot) -> bool:
    return slot.full


def not_full(slot: Slot) -> bool:
    return not slot.full


def neutral(endpoint_id: str, now: float) -> float:
    return 1.0


def view_load(slot: Slot) -> tuple[float, float]:
    return (slot.requests + 1) / slot.weight, slot.kv or 0.0
