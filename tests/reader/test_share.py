"""Gateway replicas share their requests in flight: the estimate, the exchange on a real
Redis, a killed replica leaving the others' view, Redis lost."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from poller.reader.exchange.exchange import Exchange
from poller.reader.exchange.loops import run, run_sync
from poller.reader.exchange.pacer import FLOOR_S
from poller.reader.exchange.wire import TTL_MS
from poller.reader.load.fleet import PAGES, FleetLoad, default_replica_id
from poller.reader.load.local import LocalLoad
from poller.reader.view.cache import ViewCache
from tests.support.redisproc import RedisProcess
from tests.support.routers import counted, read_others, router_on


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_one_gateway_counts_exactly_what_it_sent() -> None:
    """The page (scraped at t=100 s, showing 4) counted 4 of ours; 2 of them ended since,
    1 started: 3 in flight now, nothing from outside."""
    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1")
    fleet.attach(local)
    starts = [local.started("a") for _ in range(4)]
    clock.t = 100.5
    local.finished("a", starts[0])
    local.finished("a", starts[1])
    local.started("a")
    pages = {"a": (4, 100_000), "b": (2, 100_000)}  # b: 2 from outside the gateways
    read_others(fleet, pages, {}, live=0)
    assert fleet.extra == {"a": 0, "b": 2}
    assert local.in_flight("a") == 3 and local.in_flight_at("a", 100.0) == 4


def test_peers_add_their_counts_and_the_page_only_what_they_did_not_send() -> None:
    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1")
    fleet.attach(local)
    local.started("a")
    pages = {"a": (7, 100_000)}
    read_others(fleet, pages, {"a": 4}, now_ms=99_900)  # as the page was scraped
    read_others(fleet, pages, {"a": 5}, now_ms=100_400)  # and now
    # 7 on the page, of which 4 were g2's and 1 ours: 2 from outside; g2 has 5 now.
    assert fleet.extra == {"a": 2 + 5} and fleet.peers == 1
    assert fleet.own_field({"a": (7, 100_000)}, 0.0) == '{"a":[1,1,100000]}'


def test_outside_load_counts_once_every_one_of_the_last_pages_shows_it() -> None:
    """No gateway request: each page's count is outside load. A steady client's 3 are
    counted once all of the last ``PAGES`` pages show them, and at once no longer when a
    page shows fewer; one page's passing burst is not counted at all."""
    fleet = FleetLoad("g1")
    fleet.attach(LocalLoad(clock=Clock()))

    def page(k: int, steady: int, burst: int = 0) -> float:
        read_others(fleet, {"a": (steady + burst, 100_000 + 1000 * k)}, {})
        return fleet.extra["a"]

    assert page(0, 0) == 0
    assert [page(k, 3) for k in range(1, PAGES)] == [0] * (PAGES - 1)
    assert page(PAGES, 3) == 3  # every one of the last PAGES pages shows the 3
    assert page(PAGES + 1, 3, burst=5) == 3  # a burst between pages: its floor, 3
    assert page(PAGES + 2, 1) == 1  # the client slowed down: counted at once


def _pages_over(fleet: FleetLoad, local: LocalLoad, clock: Clock, lag_s: float) -> None:
    """40 pages of "a", one a second, each showing our requests as they were ``lag_s``
    before its scrape: 2 in flight for the first half of each second, none after."""
    starts: list[float] = []
    for k in range(40):
        clock.t = 100.0 + k
        starts = [local.started("a"), local.started("a")]
        clock.t += 0.5
        for start in starts:
            local.finished("a", start)
        scraped = 100.0 + k + 0.25
        shown = local.in_flight_at("a", scraped - lag_s)
        clock.t = 100.0 + k + 0.75
        read_others(fleet, {"a": (shown, int(scraped * 1000))}, {})


def test_pages_are_current_while_they_show_what_the_gateways_had_in_flight() -> None:
    """Pages measured at their scrape show every gateway request in flight then: they
    are taken as current. Pages measured 0.5 s earlier miss them half the time."""
    for lag_s, current in ((0.0, True), (0.5, False)):
        clock = Clock()
        local = LocalLoad(clock=clock)
        fleet = FleetLoad("g1")
        fleet.attach(local)
        assert not fleet.current  # nothing seen yet: as lagging
        _pages_over(fleet, local, clock, lag_s)
        assert fleet.current is current, lag_s


def test_a_current_page_s_outside_requests_count_fading_with_the_request_time() -> None:
    """On current pages, what the newest page shows beyond the outside floor counts as
    ``exp(-age / the replica's request time)``; on lagging pages it does not count."""
    from poller.reader.routing.index import Slot
    from tests.reader.test_pick import timed
    from tests.support.routers import fleet_score

    for lag_s in (0.0, 0.5):
        clock = Clock()
        local = LocalLoad(clock=clock)
        fleet = FleetLoad("g1")
        fleet.attach(local)
        _pages_over(fleet, local, clock, lag_s)
        assert local.request_s == pytest.approx(0.5)
        # The next page: 3 requests from outside the gateways, none of ours.
        clock.t = 141.0
        read_others(fleet, {"a": (3, 141_000)}, {})
        assert fleet.extra["a"] == 0  # the floor of the last pages: none steady
        slot = Slot("a", timed("a", running="3").stats, math.inf)  # weight 1
        for age_s in (0.0, 0.5, 2.0):
            clock.t = 141.0 + age_s
            load = fleet_score(local, fleet)(slot)[0] * slot.weight
            seen = 3 * math.exp(-age_s / 0.5) if lag_s == 0.0 else 0.0
            assert load == pytest.approx(1 + seen), (lag_s, age_s)


def test_the_picker_routes_on_the_fleet_as_the_oracle_would() -> None:
    from tests.reader.test_pick import timed, view_of

    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1", clock=clock)  # answered at clock.t: shared as long as it stands
    fleet.attach(local)
    # Pages a second old say "a" is empty and "b" busy; the fleet knows better.
    view = view_of(timed("a", running="0"), timed("b", running="6"))
    pages = {"a": (0, 999_500), "b": (6, 999_500)}
    read_others(fleet, pages, {}, now_ms=999_000)  # the others' none at the pages
    read_others(fleet, pages, {"a": 6}, now_ms=999_600)  # and 6 on "a" now
    fleet.extra["b"] = 0  # b's requests all ended since its page
    router = router_on(view, local=local, fleet=fleet)
    assert set(counted(router, 20)) == {"b"}


def test_a_load_moves_to_the_fleet_it_is_attached_to_last() -> None:
    """A ``LocalLoad`` attached to a new fleet (a Router opened anew by an integration's
    new event loop) and detached from the old one is published by the new one only,
    and wakes the new one's exchange."""
    local = LocalLoad(clock=Clock())
    old, new = FleetLoad("g1"), FleetLoad("g1")
    old.attach(local)
    woken: list[str] = []
    old.waker, new.waker = (lambda: woken.append("old")), (lambda: woken.append("new"))
    local.started("a")
    assert old.own_field({}, 0.0) != "" and woken == ["old"]
    new.attach(local)
    old.detach(local)
    local.take_changed()
    local.started("a")
    assert woken == ["old", "new"]  # the new one's exchange publishes the change
    assert new.own_field({}, 0.0) == '{"a":[2,0,0]}'  # 2 now, none at no page
    assert old.own_field({}, 0.0) == ""  # left: nothing of ours published there
    assert old.holds(local) is False and new.holds(local)


def test_redis_lost_leaves_the_others_counts_out_of_the_load() -> None:
    """The exchange unanswered for ``LOST_AFTER_MS``: a pick counts this replica's own
    requests and the pages' outside traffic, not the others' counts, which may be
    seconds old by then (a threaded reader's call can block for its socket timeout)."""
    from poller.reader.exchange.wire import LOST_AFTER_MS
    from poller.reader.routing.index import Slot
    from tests.reader.test_pick import timed
    from tests.support.routers import fleet_score

    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1", clock=clock)
    fleet.attach(local)
    local.started("a")
    read_others(fleet, {"a": (7, 100_000)}, {"a": 4}, now_ms=100_000)
    slot = Slot("a", timed("a", running="7").stats, math.inf)  # weight 1
    lost_after_s = LOST_AFTER_MS / 1000
    assert fleet.answered_within(lost_after_s)
    assert fleet_score(local, fleet)(slot)[0] == 2 + 4 + 1 + 1
    clock.t += lost_after_s + 0.001  # no answer since
    assert not fleet.answered_within(lost_after_s)
    assert fleet_score(local, fleet)(slot)[0] == 2 + 1 + 1


def test_identity_is_chosen_and_can_be_set() -> None:
    assert FleetLoad().replica_id != FleetLoad().replica_id
    assert str(os.getpid()) in default_replica_id()
    assert FleetLoad("gw-7").replica_id == "gw-7"


def test_an_unchanged_record_is_written_only_before_it_expires() -> None:
    exchange = Exchange(_Script(Clock(), 1, [None]), "P:gw", ViewCache(), FleetLoad("g1"))
    assert exchange._outgoing("", 0) == ""  # nothing in flight, nothing written
    assert exchange._outgoing("x", 0) == "x"
    assert exchange._outgoing("x", 100) == ""
    assert exchange._outgoing("x", TTL_MS) == "x"  # refreshed before it expires
    assert exchange._outgoing("", TTL_MS + 1) == "-"  # emptied: deleted once
    assert exchange._outgoing("", TTL_MS + 2) == ""


_REPLICA = """
import asyncio, sys
from poller.reader import StatsReader
from poller.reader.load.local import LocalLoad

async def main() -> None:
    reader = StatsReader.from_url(sys.argv[1], sys.argv[2])
    async with reader.router(replica_id="doomed") as router:
        local = router.local
        held = []
        while True:  # a busy gateway: a request starts every 20 ms, each lasts 100 ms
            held.append(local.started("a"))
            if len(held) > 5:
                local.finished("a", held.pop(0))
            print("busy", flush=True)
            await asyncio.sleep(0.02)

asyncio.run(main())
"""


async def test_a_killed_replica_leaves_the_view_within_a_second(
    redis_server: RedisProcess,
) -> None:
    """A gateway replica killed mid-run (SIGKILL: no goodbye): its counts leave the
    totals at the survivor's first call after its alive entry expired (800 ms after its
    last call, on the Redis clock); no engine is left looking busy."""
    from poller.reader import StatsReader
    from tests.support.procs import until

    reader = StatsReader.from_url(redis_server.url, "share")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _REPLICA, redis_server.url, "share", stdout=subprocess.PIPE
    )
    try:
        async with reader.router(replica_id="survivor") as router:
            fleet = router.fleet
            assert fleet is not None
            assert proc.stdout is not None and await proc.stdout.readline() == b"busy\n"
            await until(lambda: fleet.peer_in_flight("a") > 0, 60, "the replica's requests")
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            killed = time.monotonic()
            await until(lambda: fleet.peer_in_flight("a") == 0, 60, "the killed replica gone")
            gone_s = time.monotonic() - killed
            # The TTL and the survivor's floor call bound it: 800 + 300 ms.
            assert gone_s <= TTL_MS / 1000 + FLOOR_S + 1.0, gone_s  # headroom: a loaded CI
            assert fleet.peers == 0 and not fleet.extra.get("a")
            print(f"killed replica gone from the survivor's view after {gone_s:.2f} s")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await reader.aclose()


def test_redis_lost_means_local_counts_and_the_router_says_so() -> None:
    from poller.reader.exchange.wire import LOST_AFTER_MS
    from poller.reader.routing.options import RoutingOptions

    assert not router_on([], RoutingOptions(share=False)).load_shared  # no sharing at all
    clock = Clock()
    fleet = FleetLoad("g1", clock=clock)
    router = router_on([], fleet=fleet)
    assert not router.load_shared  # never exchanged
    read_others(fleet, {"a": (0, 0)}, {"a": 3})
    assert router.load_shared and fleet.peer_in_flight("a") == 3
    clock.t += 0.5
    fleet.lost({"a": (0, 0)}, 0.0)  # unanswered: the counts as last known, for now
    assert router.load_shared and fleet.peer_in_flight("a") == 3
    clock.t += LOST_AFTER_MS / 1000
    assert not router.load_shared  # no answer for LOST_AFTER_MS: local counts only


async def test_two_cached_readers_see_each_others_requests(redis_server: RedisProcess) -> None:
    """The whole exchange, as two gateway replicas run it (``router()``, both flavours):
    a request one replica has in flight is in the other's view, and leaves it when it
    ends."""
    from poller.reader import StatsReader, SyncStatsReader
    from tests.support.procs import until

    a = StatsReader.from_url(redis_server.url, "share")
    b = SyncStatsReader.from_url(redis_server.url, "share")
    async with a.router(replica_id="gw-a") as router_a:
        with b.router(replica_id="gw-b") as router_b:
            assert router_a.fleet is not None and router_b.fleet is not None
            fleet_a, fleet_b = router_a.fleet, router_b.fleet
            local_a, local_b = router_a.local, router_b.local
            started = local_a.started("e1")
            await until(lambda: fleet_b.peer_in_flight("e1") == 1, 30, "a's request in b")
            assert fleet_b.peers == 1 and fleet_a.peer_in_flight("e1") == 0
            local_b.started("e2")
            await until(lambda: fleet_a.peer_in_flight("e2") == 1, 30, "b's request in a")
            local_a.finished("e1", started)
            await until(lambda: fleet_b.peer_in_flight("e1") == 0, 30, "a's request ended")
            assert fleet_a.peer_in_flight("e2") == 1
    await a.aclose()
    b.close()


def test_a_large_bag_on_the_fleet_estimate_chooses_by_load_whatever_the_pages_said() -> None:
    """More than ``SCAN_MAX`` candidates: two weighted draws over the bags as they are (no
    list built per pick). A page that showed an engine queued or its KV cache full
    vetoes nothing: the fleet's estimate says how loaded each is now, and the idle ones
    are favoured, full at their last page or not."""
    from poller.reader.routing.draw import SCAN_MAX
    from tests.reader.test_pick import timed, view_of

    n = SCAN_MAX + 8
    full = [timed(f"full-{i}", running="4", kv_cache_usage="0.99") for i in range(n)]
    queued = [timed(f"queued-{i}", waiting="10", kv_cache_usage="0.1") for i in range(n)]
    local = LocalLoad(clock=Clock())
    fleet = FleetLoad("g1")
    read_others(fleet, {}, {})  # the others' counts current (none): the extra below is read
    busy = {f"{kind}-{i}": 50.0 if i % 2 else 0.0 for kind in ("full", "queued") for i in range(n)}
    fleet.extra = fleet.outside = busy
    router = router_on(view_of(*full, *queued), local=local, fleet=fleet, seed=5)
    chosen = counted(router, 400)
    assert {str(e).split("-")[0] for e in chosen} == {"full", "queued"}, chosen
    idle = sum(c for e, c in chosen.items() if int(str(e).split("-")[1]) % 2 == 0)
    assert idle >= 0.6 * 400, chosen  # the better of two: about 3 in 4


def test_an_exchange_that_works_on_what_changed_agrees_with_one_that_works_on_all() -> None:
    """``own_field`` and ``read`` given what changed (pages, our requests started or
    ended) redo only those endpoints and the ones whose totals moved: the same figures
    as redoing every endpoint."""
    import random

    rng = random.Random(6)
    clock = Clock()
    whole, part = FleetLoad("g1"), FleetLoad("g1")
    local = LocalLoad(clock=clock)
    whole.attach(local)
    part.attach(local)
    pages = {f"e{i}": (rng.randrange(5), 100_000) for i in range(30)}
    open_: list[tuple[str, float]] = []
    others = {"e1": 1}
    for step in range(60):
        clock.t += 0.1
        changed = set(rng.sample(sorted(pages), 5))
        for e in changed:
            pages[e] = (rng.randrange(8), int(clock.t * 1000) - 50)
        if open_ and rng.random() < 0.5:
            local.finished(*open_.pop(rng.randrange(len(open_))))
        else:
            e = f"e{rng.randrange(30)}"
            open_.append((e, local.started(e)))
        moved: dict[str, int] = {}
        if step % 3:  # the others' counts moved on a few endpoints
            moved = {f"e{rng.randrange(30)}": rng.randrange(0, 4) for _ in range(3)}
        others.update(moved)
        changed |= local.take_changed()
        record = part.own_field(pages, 0.0, changed if step else None)
        assert record == whole.own_field(pages, 0.0)
        written = whole.written
        for fleet in (whole, part):
            fleet.wrote(record or "-")
        # The totals as the script returns them: every one, or those that moved.
        mine = {e: c for e, c in whole.written.items()}
        todo = set(pages) if step == 0 else set(moved) | set(mine) | set(written)
        fields: list[object] = []
        for e in sorted(todo):
            fields += [e, str(others.get(e, 0) + mine.get(e, 0))]
        now_ms = clock.t * 1000
        whole.read(step + 1, 2, fields, pages, 0.0, now_ms, full=step == 0)
        part.read(step + 1, 2, fields, pages, 0.0, now_ms, full=step == 0,
                  changed=changed if step else None)  # fmt: skip
        assert part.extra == whole.extra, step
        assert part.peers == whole.peers == 2
        assert all(whole.peer_in_flight(e) == n for e, n in others.items())


class _Script:
    """A share script that answers as Redis would (``live`` other replicas, whose
    totals never move) or fails as ``outcomes`` say, recording when it was called."""

    def __init__(self, clock: Clock, live: int, outcomes: list[Exception | None]) -> None:
        self.clock, self.live = clock, live
        self.outcomes = itertools.cycle(outcomes)
        self.at: list[float] = []
        self.number = 0

    def register_script(self, source: str) -> _Script:
        return self

    def __call__(self, keys: list[str], args: list[object]) -> list[object]:
        self.at.append(self.clock.t)
        failure = next(self.outcomes)
        if failure is not None:
            raise failure
        self.number += 1 if args[2] else 0  # a record written moves a total
        return [0, 0, self.live, self.number, 0, 0, 0]


def _run_busy(script: _Script, clock: Clock, seconds: float, *, listening: bool) -> None:
    """The threaded exchange loop on ``clock`` for ``seconds``, a request starting every
    millisecond of it (each a change to publish)."""
    from poller.reader.exchange.exchange import Exchange
    from poller.reader.view.cache import ViewCache

    cache = ViewCache()
    fleet = FleetLoad("g1")
    local = LocalLoad(clock=clock)
    fleet.attach(local)
    exchange = Exchange(script, "P:gateways:inflight", cache, fleet, clock=clock)
    exchange.listening = listening
    stop, end = threading.Event(), clock.t + seconds

    class Wake(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            assert timeout is not None and timeout > 0
            for _ in range(max(1, round(timeout * 1000))):  # time passes, requests start
                clock.t += 0.001
                local.started("a")
                if self.is_set():  # the change woke the loop
                    break
            if clock.t >= end:
                stop.set()
            return True

    run_sync(exchange, stop, Wake())


async def test_an_exchange_whose_cancel_a_call_swallowed_still_ends() -> None:
    """Python 3.11: a library's wait_for that meets a cancel may swallow it. The loop
    must end anyway, or ``asyncio.run`` (which cancels a leftover task once, then waits
    for it) never returns."""
    from poller.reader.exchange.exchange import Exchange
    from poller.reader.view.cache import ViewCache

    called = asyncio.Event()

    class Swallowing:
        def register_script(self, source: str) -> Swallowing:
            return self

        async def __call__(self, keys: list[str], args: list[object]) -> list[object]:
            called.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # swallowed, as the library did
            raise redis.ConnectionError("away")

    cache = ViewCache()
    fleet = FleetLoad("g1")
    local = LocalLoad()
    fleet.attach(local)
    local.started("a")
    stop = asyncio.Event()
    task = asyncio.create_task(run(Exchange(Swallowing(), "P:gw", cache, fleet), stop))
    try:
        await asyncio.wait_for(called.wait(), 30)
        task.cancel()  # once, as asyncio.run does
        await asyncio.wait({task}, timeout=30)
        assert task.cancelled()
    finally:  # a failing run must not leave the loop behind for the test's teardown
        stop.set()
        task.cancel()


def _most_in_a_second(times: list[float]) -> int:
    return max(bisect.bisect_left(times, t + 1.0) - i for i, t in enumerate(times))


def test_the_exchange_makes_at_most_20_commands_in_any_second_on_every_path() -> None:
    """A request starting every millisecond, Redis answering, away or refusing: the
    pacer lets at most ``BURST + RATE_PER_S`` = 20 calls into any second, and waits
    ``RETRY_S`` after a failure, ``REFUSED_RETRY_S`` after a refusal."""
    from poller.reader.exchange.pacer import BURST, RATE_PER_S
    from poller.reader.exchange.wire import REFUSED_RETRY_S, RETRY_S

    assert BURST + RATE_PER_S <= 20
    clock = Clock()
    away = redis.ConnectionError("away")
    refused = redis.ResponseError("NOPERM this user has no permissions to run the 'evalsha'")
    # A refusal is tried once more without publishing (the channel's right?); refused
    # again, it is the hash's: the next try waits REFUSED_RETRY_S.
    outcomes: list[Exception | None] = [None] * 40 + [away] + [None] * 40 + [refused] * 2
    script = _Script(clock, 1, outcomes)
    _run_busy(script, clock, 30.0, listening=True)
    at = script.at
    assert _most_in_a_second(at) <= 20, _most_in_a_second(at)
    held_s = 0.0
    every = outcomes * (len(at) // len(outcomes) + 1)
    for k, failure in enumerate(every):
        if k + 1 < len(at) and failure is not None:
            wait = REFUSED_RETRY_S if failure is every[k - 1] is refused else RETRY_S
            assert at[k + 1] - at[k] >= wait - 1e-9, (k, at[k + 1] - at[k])
            held_s += at[k + 1] - at[k]
    assert len(at) >= 0.9 * RATE_PER_S * (30 - held_s)  # the rate is used meanwhile


def test_a_call_that_cannot_be_prepared_is_said_once_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Working out a call fails (a bug): one WARNING, a retry ``RETRY_S`` later, and
    the calls after it go out; the loop never ends on it."""
    from poller.reader.exchange.wire import RETRY_S

    clock = Clock()
    script = _Script(clock, 1, [None])
    failures = iter([True, True, True])
    record = FleetLoad.own_field

    def flaky(self: FleetLoad, *args: object, **kw: object) -> str:
        if next(failures, False):
            raise RuntimeError("a bug")
        return record(self, *args, **kw)  # type: ignore[arg-type]

    with caplog.at_level("WARNING", logger="poller.reader.exchange"):
        orig, FleetLoad.own_field = FleetLoad.own_field, flaky  # type: ignore[method-assign]
        try:
            _run_busy(script, clock, 5.0, listening=True)
        finally:
            FleetLoad.own_field = orig  # type: ignore[method-assign]
    said = [r for r in caplog.records if "could not prepare" in r.getMessage()]
    assert len(said) == 1
    assert script.at and script.at[0] >= 100.0 + 3 * RETRY_S - 1e-9
    assert len(script.at) >= 5 * 16 * 0.9  # then at the pacer's rate, as ever


def test_a_replica_nobody_listens_to_calls_at_the_floor_only() -> None:
    """No other replica is alive: changes go out with the next floor call (every
    ``FLOOR_S``), not at once; with no subscription at all the others' totals are read
    at the pacer's rate instead."""
    from poller.reader.exchange.pacer import RATE_PER_S

    clock = Clock()
    alone = _Script(clock, 0, [None])
    _run_busy(alone, clock, 30.0, listening=True)
    assert len(alone.at) <= 30 / FLOOR_S + 2, len(alone.at)
    assert all(b - a >= FLOOR_S - 1e-9 for a, b in itertools.pairwise(alone.at[1:]))
    deaf = _Script(clock, 0, [None])
    _run_busy(deaf, clock, 30.0, listening=False)
    assert len(deaf.at) >= 0.9 * RATE_PER_S * 30 and _most_in_a_second(deaf.at) <= 20


def test_a_change_wakes_the_exchange_once_per_call() -> None:
    """``LocalLoad`` wakes the exchange on the first change since its last call only:
    a request's bookkeeping costs no more than that."""
    woken: list[int] = []
    fleet = FleetLoad("g1")
    fleet.waker = lambda: woken.append(1)
    local = LocalLoad(clock=Clock())
    fleet.attach(local)
    started = [local.started("a") for _ in range(5)]
    assert woken == [1] and fleet.has_changed()
    assert fleet.take_changed() == {"a"} and not fleet.has_changed()
    local.finished("a", started[0])
    local.finished("a", started[1])
    assert woken == [1, 1]


def test_read_and_heard_totals_merge_by_change_number() -> None:
    """A total is replaced only by one of a higher change number, whichever way it
    came: a message at or below the last read's number is in it already, a read
    answered after a newer message was heard does not undo it, and the others' share
    is the total less ours as written."""
    fleet = FleetLoad("g1")
    local = LocalLoad(clock=Clock())
    fleet.attach(local)
    local.started("a")
    pages = {"a": (0, 0), "b": (0, 0)}
    fleet.own_field(pages, 0.0)
    fleet.wrote('{"a":[1,0,0]}')  # ours: 1 on "a", in the totals below
    fleet.read(10, 1, ["a", "4", "b", "2"], pages, 0.0, 1000, full=True)
    assert (fleet.peer_in_flight("a"), fleet.peer_in_flight("b"), fleet.peers) == (3, 2, 1)
    fleet.hear(["9 1001 a:9", "10 1001 b:7"], pages, 0.0)  # in the read already
    assert (fleet.peer_in_flight("a"), fleet.peer_in_flight("b")) == (3, 2)
    fleet.hear(["12 1002 a:6 b:0"], pages, 0.0)
    assert (fleet.peer_in_flight("a"), fleet.peer_in_flight("b")) == (5, 0)
    fleet.hear(["11 1002 a:2"], pages, 0.0)  # older than what is held
    assert fleet.peer_in_flight("a") == 5
    # A read answered at 11, after the message of 12 was heard: both stay 12's.
    fleet.read(11, 1, ["a", "3", "b", "1"], pages, 0.0, 1003)
    assert (fleet.peer_in_flight("a"), fleet.peer_in_flight("b")) == (5, 0)
    fleet.read(13, 1, ["a", "1"], pages, 0.0, 1004)  # newer than any heard
    assert fleet.peer_in_flight("a") == 0
    fleet.hear(["junk", "14 x a:1", "15 1005 a:-1 a:x :3 b:2"], pages, 0.0)
    assert (fleet.peer_in_flight("a"), fleet.peer_in_flight("b")) == (0, 2)
    # Redis started a new run of numbers: the full read is all there is.
    fleet.read(5, 0, ["b", "1"], pages, 0.0, 2000, full=True)
    assert (fleet.peer_in_flight("a"), fleet.peer_in_flight("b"), fleet.peers) == (0, 1, 0)


def test_the_others_as_they_stood_at_a_page_come_from_their_history() -> None:
    """What the others had in flight when a page was scraped is read from the totals'
    history on the Redis clock: a page shows the others' requests of its moment, and
    only what is beyond them counts as outside traffic."""
    fleet = FleetLoad("g1")
    fleet.attach(LocalLoad(clock=Clock()))
    read_others(fleet, {"a": (0, 0)}, {"a": 2}, now_ms=10_000)
    fleet.hear([f"{10**6} 10500 a:5"], {"a": (0, 0)}, 0.0)
    read_others(fleet, {"a": (0, 0)}, {"a": 3}, now_ms=11_000)
    # (the page's scrape, what it shows, the others' then): beyond them, 0 or 1 outside.
    for scraped_ms, shown, then in ((10_200, 2, 2), (10_700, 6, 5), (11_500, 4, 3)):
        fleet.lost({"a": (shown, scraped_ms)}, 0.0)
        assert fleet.at_page["a"] == (0, then, 3), scraped_ms  # (ours then, theirs then, now)
        assert fleet.extra["a"] == fleet.outside["a"] + 3


def test_a_user_who_may_not_publish_shares_by_reading(caplog: pytest.LogCaptureFixture) -> None:
    """The share script refused while publishing, answered without: the channel's
    right is missing, not the hash's. The replica goes on writing and reading the hash
    (shared), publishes no more, and says so once."""
    import logging

    from poller.reader.exchange.exchange import Exchange
    from poller.reader.view.cache import ViewCache

    clock = Clock()

    class Client:
        def register_script(self, source: str) -> object:
            def call(keys: list[str], args: list[object]) -> list[object]:
                if args[3]:
                    raise redis.ResponseError(
                        "ERR The user executing the script can't publish to the channel"
                    )
                return [0, 0, 1, 7, 0, 1, 0, "a", "2"]

            return call

    cache = ViewCache()
    fleet = FleetLoad("g1")
    exchange = Exchange(Client(), "P:gateways:inflight", cache, fleet, clock=clock)
    with caplog.at_level(logging.WARNING, logger="poller.reader.exchange"):
        for _ in range(4):
            keys, args, pages = exchange.prepare()
            try:
                exchange.answered(exchange.script(keys=keys, args=args), pages)
            except Exception as exc:
                exchange.failed(exc, pages)
            clock.t += 1.0
    assert not exchange.publish and fleet.answered_within(1.0) and fleet.peer_in_flight("a") == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "refused the gateway's user the channel" in said[0], said


def test_a_page_taken_in_between_calls_still_reaches_our_record() -> None:
    """The loop takes in a new page (``listen``) before the next call writes our
    record: the record carries that page's scraped_at_ms and our count at it, so the
    other replicas can tell which of our requests the page already shows."""
    from poller.reader.exchange.exchange import Exchange
    from poller.reader.view import View
    from poller.reader.view.cache import ViewCache
    from poller.reader.view.decode import LazyEndpoints

    def record(scraped_ms: int, running: int) -> str:
        fields = {
            "engine": "vllm",
            "running": str(running),
            "waiting": "0",
            "interval_ms": "1000",
            "scraped_at_ms": str(scraped_ms),
            "poller": "p1",
            "token": "1",
            "seq": "1",
        }
        return f"{scraped_ms} 1000 {scraped_ms + 3_600_000} p1 1|{json.dumps(fields)}"

    now = 1_764_500_000_000
    clock = Clock()
    clock.t = time.monotonic()  # the cache's clock, which judges the pages, is this one
    cache = ViewCache(stale_after_ms=3_600_000)
    cache.load(View(now, 1, LazyEndpoints({"a": "{}"}, {"a": record(now, 0)}, {}, now)))
    cache._offset_ms = now - (clock.t - 0.5) * 1000  # the page was scraped 0.5 s ago
    fleet = FleetLoad("g1")
    local = LocalLoad(clock=clock)
    fleet.attach(local)
    written: list[str] = []

    class Client:
        def register_script(self, source: str) -> object:
            def call(keys: list[str], args: list[object]) -> list[object]:
                written.append(str(args[2]))
                return [0, 0, 1, 1, 0, 0, 0]

            return call

    exchange = Exchange(Client(), "P:gateways:inflight", cache, fleet, clock=clock)

    def call() -> None:
        keys, args, pages = exchange.prepare()
        exchange.answered(exchange.script(keys=keys, args=args), pages)

    local.started("a")
    call()
    assert json.loads(written[-1]) == {"a": [1, 0, now]}
    clock.t += 1.0
    cache.set_stats("a", record(now + 1000, 1))  # scraped 0.5 s after our request began
    exchange.listen()
    local.started("b")  # a change elsewhere, so the next call writes
    call()
    assert json.loads(written[-1]) == {"a": [1, 1, now + 1000], "b": [1, 0, 0]}


def test_only_redis_refusing_the_channel_drops_it_from_the_subscription() -> None:
    """A subscription refused for its channels (Redis 7.0 says "one of the channels",
    7.2 names it) goes on without the gateways' channel; any other refusal is not the
    channel's, whatever our own message around it says."""
    from poller.reader.exchange.exchange import Exchange
    from poller.reader.view.cache import ViewCache
    from poller.redis.errors import reply_error

    def exchange() -> Exchange:
        cache = ViewCache()
        return Exchange(_Script(Clock(), 1, [None]), "P:gateways:inflight", cache, FleetLoad("g1"))

    refusals = [
        "NOPERM this user has no permissions to access one of the channels used as arguments",
        "NOPERM User gw has no permissions to access the 'P:gateways:updates' channel",
    ]
    for text in refusals:
        one = exchange()
        assert one.refused_channel(reply_error(text, "SSUBSCRIBE")), text
        assert not one.publish and not one.listening
    others = [
        reply_error("NOPERM User gw has no permissions to access the 'P:updates' channel", "x"),
        reply_error("NOPERM this user has no permissions to run the 'hset' command", "x"),
        reply_error("NOPERM this user has no permissions to access one of the keys", "x"),
        ConnectionError("channel closed"),
    ]
    for exc in others:
        one = exchange()
        assert not one.refused_channel(exc), exc
        assert one.publish


def test_totals_out_of_range_are_skipped_never_fatal() -> None:
    """Totals from a writer not of ours, read or heard: ones that overflow a float
    (``1e999``, a 400-digit integer), negative ones, a number past any clock. Each bad
    entry is skipped, the good ones beside it kept; nothing raises."""
    fleet = FleetLoad("g1")
    fleet.attach(LocalLoad(clock=Clock()))
    pages = {"a": (0, 0), "b": (0, 0)}
    huge = "9" * 400
    fleet.read(1, 1, ["a", "1e999", "b", "2", "c", huge, "d", "-5"], pages, 0.0, 0, full=True)
    assert fleet.peer_in_flight("a") == 0 and fleet.peer_in_flight("b") == 2
    bad = [f"2 1000 a:1e999 b:{huge}", "3 1e999 a:4", f"{huge} 1000 a:5", "4 1000 a:-5 b:3"]
    fleet.hear(bad, pages, 0.0)
    assert fleet.peer_in_flight("a") == 0 and fleet.peer_in_flight("b") == 3
    fleet.hear(["5 1001 a:4"], pages, 0.0)  # a number past any clock held nothing back
    assert fleet.peer_in_flight("a") == 4
    assert math.isfinite(fleet.extra["a"])


def test_a_change_the_window_held_goes_out_with_a_call_unless_heard_published() -> None:
    """The script held our change for its publish window: the exchange calls again once
    the window is over (it scales with the live replicas: 10 ms at 64), unless a message
    of that change's number or later is heard first (another replica's call published
    it)."""
    from poller.reader.exchange.pacer import FLOOR_S
    from poller.reader.exchange.wire import PUBLISH_EVERY_MS

    clock = Clock()
    replies = iter([[0, 0, 63, 5, 0, 1, 1], [0, 0, 63, 9, 0, 0, 1]])

    class Client:
        def register_script(self, source: str) -> object:
            return lambda keys, args: next(replies)

    fleet = FleetLoad("g1")
    exchange = Exchange(Client(), "P:gateways:inflight", ViewCache(), fleet, clock=clock)
    exchange.subscribed(True)
    for _ in range(2):
        keys, args, pages = exchange.prepare()
        exchange.answered(exchange.script(keys=keys, args=args), pages)
        assert exchange.call_in(clock.t) == pytest.approx(PUBLISH_EVERY_MS / 1000)
        clock.t += 0.001
    exchange.heard("8 1000 a:1")  # an older number: ours is still held
    exchange.listen()
    assert exchange.call_in(clock.t) < FLOOR_S / 2
    exchange.heard("9 1000 a:2")
    exchange.listen()
    assert exchange.call_in(clock.t) == pytest.approx(FLOOR_S - 0.001)  # the floor's call
