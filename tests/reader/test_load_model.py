"""The load model on the fleet's counts: no page a second old vetoes a choice.

With one gateway and no traffic from outside, the gateways' requests in flight are the
engines' whole load, known exactly; whatever the pages said at their scrape (running,
waiting, and a KV gauge of any kind), the Router then makes the oracle's choice: the
least expected time to finish, ``max(1, (n + 1) / slots)`` for engines of equal speed.
Saturation, which sheds and bounds prefix affinity, is the page's as changed since.
Seeded: the verdicts are exact."""

from __future__ import annotations

import random
from collections.abc import Callable

from poller.reader.load.fleet import FleetLoad, pages_of
from poller.reader.load.local import LocalLoad
from poller.reader.router import Router
from poller.reader.routing.options import RoutingOptions
from poller.reader.ticket import Ticket
from tests.reader.test_pick import Clock, timed, view_of
from tests.support.routers import read_others, router_on

SCRAPED_S = 100.0  # the pages' scrape, on the gateway's clock (Redis ms = s x 1000)

#: KV gauges engines publish: occupancy (vLLM: the blocks the running requests hold),
#: one that counts idle cached blocks too (near 1.0 always), none (TGI), a stuck zero.
KV_GAUGES: dict[str, Callable[[int, int, random.Random], str | None]] = {
    "occupancy": lambda running, slots, rng: f"{0.9 * running / slots:.3f}",
    "idle cached": lambda running, slots, rng: f"{rng.uniform(0.95, 1.0):.3f}",
    "none": lambda running, slots, rng: None,
    "zero": lambda running, slots, rng: "0",
}


def oracle_cost(n: int, slots: int) -> float:
    return max(1.0, (n + 1) / slots)


def fleet_of(
    slots: list[int], at_scrape: list[int], gauge: str, rng: random.Random
) -> tuple[Router, list[Ticket], Clock]:
    """One gateway's Router after its requests ``at_scrape`` were in flight at the pages'
    scrape, each page showing exactly them (no outside traffic) with ``gauge``'s KV."""
    clock = Clock()
    clock.t = SCRAPED_S - 1.0
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1", clock=clock)
    endpoints = []
    held: list[Ticket] = []
    router_holder: list[Router] = []
    for i, (s, n) in enumerate(zip(slots, at_scrape, strict=True)):
        running, waiting = min(n, s), max(0, n - s)
        fields = {"running": str(running), "waiting": str(waiting)}
        fields["kv_capacity_tokens"] = str(1000 * s)
        kv = KV_GAUGES[gauge](running, s, rng)
        if kv is not None:
            fields["kv_cache_usage"] = kv
        endpoints.append(timed(f"e{i}", age_ms=int(1000 * (1_000.0 - SCRAPED_S)), **fields))
    view = view_of(*endpoints)
    router = router_on(view, local=local, fleet=fleet, seed=rng.randrange(1 << 30))
    router_holder.append(router)
    for i, n in enumerate(at_scrape):  # in flight at the scrape: started before it
        held += [router.track(f"e{i}") for _ in range(n)]
    clock.t = SCRAPED_S + 0.5  # the pages taken in half a second after their scrape
    pages = pages_of((e.id, e) for e in endpoints)
    read_others(fleet, pages, {}, live=0)  # one gateway: no other; Redis answered now
    return router, held, clock


def test_one_gateway_without_outside_traffic_makes_the_oracles_choice_on_any_fleet() -> None:
    rng = random.Random(11)
    for case in range(240):
        gauge = list(KV_GAUGES)[case % len(KV_GAUGES)]
        k = rng.randrange(2, 9)
        slots = [rng.choice((1, 2, 4, 8, 16, 32)) for _ in range(k)]
        at_scrape = [rng.randrange(0, 2 * s + 2) for s in slots]
        router, held, clock = fleet_of(slots, at_scrape, gauge, rng)
        now = list(at_scrape)
        # Since the scrape some requests ended: the page is a second old.
        for ticket in rng.sample(held, len(held) // 2):
            ticket.done()
            now[int(ticket.id[1:])] -= 1
        for step in range(6):  # and the gateway keeps sending, each pick in flight
            ticket = router.pick()
            assert ticket is not None
            best = min(oracle_cost(n, s) for n, s in zip(now, slots, strict=True))
            i = int(ticket.id[1:])
            got = oracle_cost(now[i], slots[i])
            assert got == best, (case, gauge, step, slots, now, ticket.id)
            now[i] += 1


def test_a_page_full_at_its_scrape_is_not_saturated_once_its_requests_ended() -> None:
    """For shedding (``when_saturated="none"``): the KV usage a page showed counts while
    the engine still holds what it held then, not after its requests ended; a page's
    queue counts as changed since by the gateways' in flight."""
    rng = random.Random(3)
    router, held, _ = fleet_of([4, 4], [4, 9], "occupancy", rng)
    strict = Router(
        router.cache,
        RoutingOptions(when_saturated="none"),
        local=router.local,
        fleet=router.fleet,
    )
    # e0: its batch full at the scrape (KV 0.9 >= 0.8); e1: 5 waiting. Nothing ended.
    assert router.saturated("e0") and router.saturated("e1")
    assert strict.pick() is None and strict.explain().reason == "saturated"
    with router.pick() as queued:  # type: ignore[union-attr]
        assert queued.id == "e0"  # least_loaded: the least loaded still takes it
    next(t for t in held if t.id == "e0").done()
    assert not router.saturated("e0")  # one of its requests ended: room again
    for ticket in [t for t in held if t.id == "e1"][:5]:
        ticket.done()
    assert not router.saturated("e1")  # its queue drained by the 5 that ended
    with strict.pick() as ticket:  # type: ignore[union-attr]
        assert ticket.id in ("e0", "e1")


def test_without_the_others_counts_a_page_is_judged_by_this_replicas_own_changes() -> None:
    """The exchange unanswered past ``LOST_AFTER_MS``: the others' counts are left out
    of what changed since the page, this replica's own still count."""
    rng = random.Random(4)
    router, held, clock = fleet_of([2], [7], "occupancy", rng)
    assert router.saturated("e0") and router.load_shared
    clock.t += 5.0  # no answer since
    assert not router.load_shared
    for ticket in held[:3]:
        ticket.done()
    assert not router.saturated("e0")  # 5 waiting, 3 of ours ended since: 2 left
