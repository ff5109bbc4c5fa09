"""The load model: how loaded an endpoint is for a pick, and when it is saturated.

One interface (``LoadModel``: ``scorer``, ``saturated``, ``scan``) and its three
implementations, from the least to the most a replica knows (docs/reader.md, "The load
estimate"):

- ``ViewLoad``: the page alone (running + waiting, per unit of capacity);
- ``LocalLoadModel``: the page corrected by this replica's requests sent since its
  scrape (scaled up for the other replicas', which it cannot see) and their times;
- ``FleetLoadModel``: the fleet's shared counts (every replica's requests in flight now,
  plus the outside traffic the pages show), with this replica's failures and, where
  the others' counts are read rather than heard, its request times.

A score is ``(load, KV usage)``, compared as a tuple: ties go to the lower KV usage.
``scorer`` is called once per pick and returns the function the draws call per
endpoint; ``bound=True`` gives the load prefix affinity bounds (counts per capacity,
without the speed factors: routing/affinity.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import FAILING_MAX, LocalLoad, clamp
from poller.reader.routing.index import Index, Slot

__all__ = ["SCALE_MAX", "FleetLoadModel", "LoadModel", "LocalLoadModel", "Score", "ViewLoad"]

#: An endpoint's score for a pick: (load, KV usage).
Score = Callable[[Slot], tuple[float, float]]
#: The most this replica's recent requests are scaled up by (its share of the fleet's).
SCALE_MAX = 64.0


class LoadModel:
    """What a pick asks of its numbers. ``scan``: the draw is the least loaded of a tier
    of up to ``SCAN_MAX`` endpoints (the numbers are current enough that the minimum
    does not herd), else the better of two random ones. ``page_rule``: saturation is the
    page's own rule (``Slot.saturated``, by which the index files its bags), and a
    saturated endpoint is skipped while any other may take the request; otherwise
    saturation (``judge``) only sheds (``when_saturated="none"``) and bounds prefix
    affinity, and the load alone chooses."""

    scan = False
    page_rule = True

    def scorer(self, index: Index, offset_ms: float | None, *, bound: bool = False) -> Score:
        return view_load

    def judge(self, index: Index) -> Callable[[Slot], bool]:
        """Whether an endpoint is saturated, for this pick."""
        return page_saturated


def page_saturated(slot: Slot) -> bool:
    """The page's rule: ``waiting >= max_waiting`` or KV usage ``>= max_kv_cache_usage``."""
    return slot.saturated


class ViewLoad(LoadModel):
    """The page alone: (running + waiting + 1) / relative capacity."""


def view_load(slot: Slot) -> tuple[float, float]:
    return (slot.requests + 1) / slot.weight, slot.kv or 0.0


class LocalLoadModel(LoadModel):
    """The page plus ``s`` x this replica's requests started since the endpoint's scrape
    (``s``: one over this replica's share of the fleet's requests), times the endpoint's
    ``slowness`` (``use_latency``)."""

    def __init__(self, local: LocalLoad, *, scale_local: bool = True, use_latency: bool = True):
        self.local = local
        self.scale_local = scale_local
        self.use_latency = use_latency

    def scorer(self, index: Index, offset_ms: float | None, *, bound: bool = False) -> Score:
        if offset_ms is None:
            return view_load
        local = self.local
        scale = 1.0
        if self.scale_local:
            # This replica's share of the fleet's requests, from the view's total and
            # ours in flight: with R equal replicas ours are ~1/R of what was sent.
            scale = clamp((index.requests + 1) / (local.total() + 1), 1.0, SCALE_MAX)
        since, offset_s = local.since, offset_ms / 1000
        slowness = local.slowness if self.use_latency and not bound else _neutral
        now = local.now()

        def load(slot: Slot) -> tuple[float, float]:
            recent = since(slot.id, slot.scraped_at_ms / 1000 - offset_s)
            requests = slot.requests + 1 + scale * recent
            return requests / slot.weight * slowness(slot.id, now), slot.kv or 0.0

        return load


class FleetLoadModel(LoadModel):
    """The fleet's estimate (docs/reader.md, "The load estimate"): (the outside traffic
    the pages show + the others' requests in flight + ours + 1) / relative capacity, x
    the endpoint's failure factor ``1 + (FAILING_MAX - 1) x local.failing``, or its speed
    factor if larger: ``local.slowness`` weighted by the share of the counts that are
    guesses, ``1 + (slowness - 1) x peers / (1 + peers)`` when the others' counts are
    read (0 when they are pushed, ``fleet.pushed``, or with one gateway: the counts are
    exact). The others' counts are current while an exchange answered them within
    ``lost_after_s``; while not, theirs are left out.

    No page vetoes a choice: a page is a second old or more, and its running, waiting
    and KV usage describe the engine then; the gateways' requests in flight are exact
    now, so the load alone chooses (with one gateway and no outside traffic, the
    oracle's choice). Saturation (``judge``), for shedding and prefix affinity's bound,
    is the page's as changed since: its ``waiting`` plus what the gateways' in flight
    changed by since its scrape reaching ``max_waiting``, or its KV usage at its bound
    while the engine ran requests and nothing of the gateways' ended since."""

    scan = True
    page_rule = False

    def __init__(
        self,
        local: LocalLoad,
        fleet: FleetLoad,
        lost_after_s: float,
        *,
        use_latency: bool = True,
        max_waiting: int = 5,
    ) -> None:
        self.local = local
        self.fleet = fleet
        self.lost_after_s = lost_after_s
        self.use_latency = use_latency
        self.max_waiting = max_waiting

    def shared(self) -> bool:
        """The others' counts are current (``FleetLoad.answered_within``)."""
        return self.fleet.answered_within(self.lost_after_s)

    def scorer(self, index: Index, offset_ms: float | None, *, bound: bool = False) -> Score:
        local, fleet = self.local, self.fleet
        latency = self.use_latency
        in_flight, failing, slower = local.in_flight, local.failing, local.slowness
        # Redis lost (no answer within a second): the others' counts, no longer current,
        # are left out; this replica's own and the pages' outside traffic remain.
        shared = self._shared()
        extra, peers = (fleet.extra, fleet.peers) if shared else (fleet.outside, 0)
        share = 0.0 if fleet.pushed or bound or not latency else peers / (1 + peers)
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

    def _shared(self) -> bool:
        fleet = self.fleet
        at = fleet.exchanged_at
        return at is not None and fleet.clock() - at <= self.lost_after_s

    def judge(self, index: Index) -> Callable[[Slot], bool]:
        """The page's saturation as changed since its scrape (class doc)."""
        at_page, in_flight = self.fleet.at_page, self.local.in_flight
        shared, max_waiting = self._shared(), self.max_waiting

        def saturated(slot: Slot) -> bool:
            held = at_page.get(slot.id)
            if held is None:  # no page of it taken in yet: the page as it is
                changed = 0
            elif shared:
                ours_then, theirs_then, theirs_now = held
                changed = in_flight(slot.id) + theirs_now - ours_then - theirs_then
            else:  # the others' counts not current: ours alone
                changed = in_flight(slot.id) - held[0]
            if slot.waiting + changed >= max_waiting:
                return True
            return slot.full and slot.running > 0 and changed >= 0

        return saturated


def _never(endpoint_id: str, now: float | None = None) -> float:
    return 0.0


def _neutral(endpoint_id: str, now: float) -> float:
    return 1.0
