"""The fleet's estimate and engine speed: an engine slower than its size takes fewer
requests once peers share the counts; with one gateway (exact counts) speed changes
nothing, and equal engines split by size. Seeded: the verdicts are exact."""

from __future__ import annotations

import random
from collections import Counter

from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import LocalLoad
from poller.reader.prefix.blocks import block_ids
from poller.reader.routing.options import RoutingOptions
from tests.reader.test_pick import Clock, timed, view_of
from tests.support.routers import read_others, router_on


def placed(
    peers: int, times: dict[str, list[float]], n: int = 30, *, pushed: bool = False
) -> tuple[Counter[str], LocalLoad]:
    """``n`` picks between two engines of equal size after this replica's requests to
    them took ``times`` (s, one request to each at a time), with ``peers`` other replicas
    sharing (their writes ``pushed`` as they happen, or read); every pick stays in
    flight."""
    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1")
    fleet.attach(local)
    fleet.pushed = pushed
    for fast_s, slow_s in zip(times["fast"], times["slow"], strict=True):
        begun = clock.t
        ends = sorted([(fast_s, "fast"), (slow_s, "slow")])
        a, b = local.started("fast"), local.started("slow")
        for took, endpoint_id in ends:
            clock.t = begun + took
            local.finished(endpoint_id, a if endpoint_id == "fast" else b)
    read_others(fleet, {"fast": (0, 999_500), "slow": (0, 999_500)}, {}, live=peers)
    assert fleet.peers == peers
    router = router_on(view_of(timed("fast"), timed("slow")), local=local, fleet=fleet, seed=3)
    chosen: Counter[str] = Counter()
    for _ in range(n):
        ticket = router.pick()  # left in flight
        assert ticket is not None
        chosen[ticket.id] += 1
    return chosen, local


def test_a_slow_engine_gets_fewer_requests_than_its_size_says_when_peers_share() -> None:
    times = {"fast": [1.0] * 10, "slow": [2.0] * 10}
    chosen, local = placed(7, times)
    assert local.slowness("slow") > 1.2 > 0.8 > local.slowness("fast")
    # Equal size says 15 each; the slow engine's ~1.8x per request leaves it ~10.
    assert chosen["slow"] <= 12 and chosen["fast"] >= 18, chosen
    # With more peers the guessed share of the counts grows, and speed weighs more.
    assert placed(15, times)[0]["slow"] <= chosen["slow"]


def test_pushed_counts_are_exact_so_times_change_nothing() -> None:
    """The others' writes heard as they happen: every count is exact, as with one
    gateway, and a slow engine's longer requests already show in it."""
    chosen, local = placed(7, {"fast": [1.0] * 10, "slow": [2.0] * 10}, pushed=True)
    assert local.slowness("slow") > 1.2
    assert chosen == Counter({"fast": 15, "slow": 15})


def test_an_engine_that_fails_fast_is_avoided_with_one_gateway_or_many() -> None:
    """Requests to "bad" end at once in errors, so its count stays 0 while "good" holds
    6: on the counts alone it would take 9 of the next 12 requests. Its failures count
    it as up to ``FAILING_MAX`` as loaded, whatever the gateways and their sharing:
    (0 + 1) x (1 + 7 x 0.82) = 6.8 against good's 7, so it takes 2."""

    def twelve(peers: int, pushed: bool, use_latency: bool = True) -> Counter[str]:
        clock = Clock()
        local = LocalLoad(clock=clock)
        fleet = FleetLoad("g1")
        fleet.attach(local)
        fleet.pushed = pushed
        for _ in range(6):
            local.started("good")
            local.finished("bad", local.started("bad"), ok=False)
            clock.t += 0.01
        assert local.failing("bad") > 0.8 and local.failing("good") == 0.0
        read_others(fleet, {"good": (6, 999_500), "bad": (0, 999_500)}, {}, live=peers)
        view = view_of(timed("good", running="6"), timed("bad"))
        options = RoutingOptions(use_latency=use_latency)
        router = router_on(view, options, local=local, fleet=fleet, seed=3)
        chosen: Counter[str] = Counter()
        for _ in range(12):
            ticket = router.pick()  # left in flight
            assert ticket is not None
            chosen[ticket.id] += 1
        clock.t += 100.0  # no news for long: the failures fade
        assert local.failing("bad") < 0.01
        return chosen

    assert twelve(0, False, use_latency=False)["bad"] == 9  # the counts alone
    for peers, pushed in ((0, False), (7, True), (7, False)):
        assert twelve(peers, pushed)["bad"] == 2, (peers, pushed)


def test_one_gateway_routes_on_its_exact_counts_whatever_the_times() -> None:
    """One gateway: the counts are exact (a slow engine's requests stay in flight longer,
    which the count shows by itself); the times' noise must not reorder engines."""
    rng = random.Random(7)
    noisy = {e: [rng.expovariate(1.0) for _ in range(10)] for e in ("fast", "slow")}
    chosen, local = placed(0, noisy)
    assert abs(local.slowness("slow") - local.slowness("fast")) > 0.2  # noise is there
    assert chosen == Counter({"fast": 15, "slow": 15})
    assert placed(0, {"fast": [1.0] * 10, "slow": [2.0] * 10})[0] == chosen


def test_equal_engines_split_by_size_with_peers() -> None:
    chosen, local = placed(7, {"fast": [1.0] * 10, "slow": [1.0] * 10})
    assert local.slowness("fast") == local.slowness("slow")
    assert chosen == Counter({"fast": 15, "slow": 15})


def slow_twice(local: LocalLoad, clock: Clock) -> None:
    """Ten requests each on "fast" and "slow": 1 s on the one, 2 s on the other."""
    for _ in range(10):
        a, b = local.started("fast"), local.started("slow")
        clock.t += 1.0
        local.finished("fast", a)
        clock.t += 1.0
        local.finished("slow", b)


def test_use_latency_off_leaves_speed_out() -> None:
    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1")
    fleet.attach(local)
    slow_twice(local, clock)
    read_others(fleet, {"fast": (0, 999_500), "slow": (0, 999_500)}, {})
    view = view_of(timed("fast"), timed("slow"))
    router = router_on(view, RoutingOptions(use_latency=False), local=local, fleet=fleet, seed=3)
    chosen: Counter[str | None] = Counter()
    for _ in range(30):
        ticket = router.pick()  # left in flight
        assert ticket is not None
        chosen[ticket.id] += 1
    assert chosen == Counter({"fast": 15, "slow": 15})


def test_the_prefix_bound_compares_counts_without_the_speed_factor() -> None:
    """The holder of the prompt's prefix has 2 requests in flight (a peer's) where the
    least loaded has none, and this replica's requests took twice as long there: on the
    counts (2 + 1) / 1 is within 1.5 x 1 + 2 and the holder takes the request; the speed
    factor (~1.3 against ~0.7 with 7 peers) would put it past the bound. The load-only
    pick still weighs speed."""
    clock = Clock()
    local = LocalLoad(clock=clock)
    slow_twice(local, clock)
    assert local.slowness("slow") > 1.2 > 0.8 > local.slowness("fast")
    fleet = FleetLoad("g1")
    fleet.attach(local)
    pages = {"fast": (0, 999_500), "slow": (0, 999_500)}
    read_others(fleet, pages, {"slow": 2}, now_ms=999_500, live=7)
    assert fleet.peers == 7
    prompt = "".join(random.Random(5).choice("abcdefgh ") for _ in range(4000))
    router = router_on(view_of(timed("fast"), timed("slow")), local=local, fleet=fleet, seed=3)
    router.placements.record("slow", block_ids(prompt))
    with router.pick() as ticket:
        assert ticket.id == "fast"
    with router.pick(prompt=prompt) as ticket:
        assert ticket.id == "slow"
    # Past the bound on the counts too (3 in flight: 4 > 3.5), the reference takes it.
    read_others(fleet, pages, {"slow": 3}, now_ms=999_500, live=7)
    with router.pick(prompt=prompt) as ticket:
        assert ticket.id == "fast"
