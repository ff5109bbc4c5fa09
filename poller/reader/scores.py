"""What the picker measures: an endpoint's freshness, and its load on the fleet's
shared counts (docs/reader.md, "The load estimate")."""

from __future__ import annotations

from collections.abc import Callable

from poller.reader.cache import ViewCache
from poller.reader.index import INF, Slot
from poller.reader.load import LocalLoad
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
    local: LocalLoad, fleet: FleetLoad, slowness: Callable[[str, float], float] | None = None
) -> Callable[[Slot], tuple[float, float]]:
    """The load on the fleet's estimate (docs/reader.md, "The load estimate"): (the
    estimate of the others' requests + ours in flight + 1) / relative capacity, where
    ours started since the last exchange count ``1 + peers`` times (the others sent
    about as many meanwhile, unseen yet), x the endpoint's slowness (by default
    ``local.slowness``) weighted by the peers' share of the gateways: ``1 + (slowness
    - 1) x peers / (1 + peers)``, so 1 with one gateway, whose counts are exact; ties by
    KV usage."""
    in_flight, since = local.in_flight, local.since
    extra, peers, since_s = fleet.extra, fleet.peers, fleet.since_s
    slower = local.slowness if slowness is None else slowness
    share = peers / (1 + peers)
    now = local.now()

    def score(slot: Slot) -> tuple[float, float]:
        base = extra.get(slot.id)
        if base is None:
            base = slot.requests
        mine = in_flight(slot.id)
        if peers and mine:
            mine += peers * since(slot.id, since_s)
        load = (base + mine + 1) / slot.weight
        if share:
            load *= 1.0 + (slower(slot.id, now) - 1.0) * share
        return load, slot.kv or 0.0

    return score


def fleet_of(view: object, local: LocalLoad) -> FleetLoad | None:
    """The shared counts ``local`` is published in: its own, or the cache's (attached
    then, so this replica's requests are published from now on)."""
    fleet = local.fleet
    if fleet is None:
        cache = view if isinstance(view, ViewCache) else getattr(view, "cache", None)
        fleet = getattr(cache, "fleet", None)
        if fleet is not None:
            fleet.attach(local)
    return fleet


def is_full(slot: Slot) -> bool:
    return slot.full


def not_full(slot: Slot) -> bool:
    return not slot.full


def neutral(endpoint_id: str, now: float) -> float:
    return 1.0


def view_load(slot: Slot) -> tuple[float, float]:
    return (slot.requests + 1) / slot.weight, slot.kv or 0.0
