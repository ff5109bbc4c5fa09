"""Gateway replicas share their requests in flight: the estimate, the exchange on a real
Redis, a killed replica leaving the others' view, Redis lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import redis

from poller.reader import LocalLoad, Picker
from poller.reader.share import PAGES, TTL_MS, FleetLoad, default_replica_id
from poller.schema.keys import Keys
from poller.schema.lua import lua
from tests.support.redisproc import RedisProcess


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
    fleet.absorb([], pages, 0.0)
    assert fleet.extra == {"a": 0, "b": 2}
    assert local.in_flight("a") == 3 and local.in_flight_at("a", 100.0) == 4


def test_peers_add_their_counts_and_the_page_only_what_they_did_not_send() -> None:
    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1")
    fleet.attach(local)
    local.started("a")
    peer = json.dumps({"a": [5, 4, 100_000]})
    fleet.absorb(["g2", f"1 {peer}"], {"a": (7, 100_000)}, 0.0)
    # 7 on the page, of which 4 were g2's and 1 ours: 2 from outside; g2 has 5 now.
    assert fleet.extra == {"a": 2 + 5} and fleet.peers == 1
    assert fleet.record({"a": (7, 100_000)}, 0.0) == '{"a":[1,1,100000]}'


def test_outside_load_counts_once_every_one_of_the_last_pages_shows_it() -> None:
    """No gateway request: each page's count is outside load. A steady client's 3 are
    counted once all of the last ``PAGES`` pages show them, and at once no longer when a
    page shows fewer; one page's passing burst is not counted at all."""
    fleet = FleetLoad("g1")
    fleet.attach(LocalLoad(clock=Clock()))

    def page(k: int, steady: int, burst: int = 0) -> float:
        fleet.absorb([], {"a": (steady + burst, 100_000 + 1000 * k)}, 0.0)
        return fleet.extra["a"]

    assert page(0, 0) == 0
    assert [page(k, 3) for k in range(1, PAGES)] == [0] * (PAGES - 1)
    assert page(PAGES, 3) == 3  # every one of the last PAGES pages shows the 3
    assert page(PAGES + 1, 3, burst=5) == 3  # a burst between pages: its floor, 3
    assert page(PAGES + 2, 1) == 1  # the client slowed down: counted at once


def test_the_picker_routes_on_the_fleet_as_the_oracle_would() -> None:
    from tests.reader.test_pick import timed, view_of

    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1")
    fleet.attach(local)
    # Pages a second old say "a" is empty and "b" busy; the fleet knows better.
    view = view_of(timed("a", running="0"), timed("b", running="6"), offset_ms=0.0)
    fleet.absorb(["g2", '1 {"a":[6,0,999500]}'], {"a": (0, 999_500), "b": (6, 999_500)}, 0.0)
    fleet.extra["b"] = 0  # b's requests all ended since its page
    picker = Picker(rng=__import__("random").Random(1))
    assert {picker.pick(view, local=local) for _ in range(20)} == {"b"}


def test_identity_is_chosen_and_can_be_set() -> None:
    assert FleetLoad().replica_id != FleetLoad().replica_id
    assert str(os.getpid()) in default_replica_id()
    assert FleetLoad("gw-7").replica_id == "gw-7"


def test_an_unchanged_record_is_written_only_before_it_expires() -> None:
    fleet = FleetLoad("g1")
    assert fleet.outgoing("", 0) == ""  # nothing in flight, nothing written
    assert fleet.outgoing("x", 0) == "x"
    assert fleet.outgoing("x", 100) == ""
    assert fleet.outgoing("x", TTL_MS) == "x"  # refreshed before it expires
    assert fleet.outgoing("", TTL_MS + 1) == "-"  # emptied: deleted once
    assert fleet.outgoing("", TTL_MS + 2) == ""


_REPLICA = """
import sys, time, redis
from poller.reader.share import FleetLoad
from poller.schema.lua import lua
client = redis.Redis.from_url(sys.argv[1], decode_responses=True)
share = client.register_script(lua("share"))
fleet = FleetLoad("doomed")
n = 0
while True:
    n += 1  # a count that changes every period, as a busy gateway's does
    share(keys=[sys.argv[2]], args=[fleet.replica_id, fleet.ttl_ms, '{"a":[%d,0,0]}' % n])
    print("wrote", flush=True)
    time.sleep(fleet.period_s)
"""


def test_a_killed_replica_leaves_the_view_within_a_second(redis_server: RedisProcess) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    key = Keys("share").gateways_inflight
    share = client.register_script(lua("share"))
    fleet = FleetLoad("survivor")
    proc = subprocess.Popen(
        [sys.executable, "-c", _REPLICA, redis_server.url, key],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "wrote\n"
        fleet.absorb(share(keys=[key], args=["survivor", 800, ""])[2:], {"a": (0, 0)}, 0.0)
        assert fleet.peer_in_flight("a") > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        calls = 0
        while fleet.peer_in_flight("a"):  # one exchange per period, as a replica makes
            fleet.absorb(share(keys=[key], args=["survivor", 800, ""])[2:], {"a": (0, 0)}, 0.0)
            calls += 1
            time.sleep(fleet.period_s)
        gone_s = time.monotonic() - killed
        # The field's own expiry (Redis clock) bounds it: 800 ms after its last write.
        assert gone_s <= TTL_MS / 1000 + 1.0, gone_s  # headroom for a loaded machine
        assert fleet.extra == {"a": 0}  # no engine left looking busy
        print(f"killed replica gone from the view after {gone_s:.2f} s ({calls} exchanges)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_redis_lost_means_local_counts_and_the_cache_says_so() -> None:
    from poller.reader.cache import ViewCache

    cache = ViewCache()
    assert not cache.load_shared  # no sharing at all
    cache.fleet = FleetLoad("g1")
    assert not cache.load_shared  # never exchanged
    cache.fleet.absorb([], {}, 0.0)
    assert cache.load_shared
    cache.fleet.absorb(["g2", '1 {"a":[3,0,0]}'], {"a": (0, 0)}, 0.0, shared=False)
    assert cache.fleet.peer_in_flight("a") == 0  # the peers' counts are dropped at once


async def test_two_cached_readers_see_each_others_requests(redis_server: RedisProcess) -> None:
    """The whole exchange, as two gateway replicas run it (``cached()``, both flavours):
    a request one replica has in flight is in the other's view, and leaves it when it
    ends."""
    from poller.reader import StatsReader, SyncStatsReader
    from tests.support.procs import until

    a = StatsReader.from_url(redis_server.url, "share")
    b = SyncStatsReader.from_url(redis_server.url, "share")
    async with a.cached(replica_id="gw-a") as cache_a:
        with b.cached(replica_id="gw-b") as cache_b:
            assert cache_a.fleet is not None and cache_b.fleet is not None
            fleet_a, fleet_b = cache_a.fleet, cache_b.fleet
            local_a, local_b = LocalLoad(), LocalLoad()
            fleet_a.attach(local_a)
            fleet_b.attach(local_b)
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


def test_a_large_bag_on_the_fleet_estimate_skips_full_engines_and_favours_idle_ones() -> None:
    """More than ``SCAN_MAX`` candidates: two weighted draws over the bags as they are (no
    list built per pick). An engine saturated by its page's ``waiting`` stays open on the
    fleet's estimate, one whose KV cache is full does not."""
    import random

    from poller.reader.picker import SCAN_MAX
    from tests.reader.test_pick import picks, timed, view_of

    n = SCAN_MAX + 8
    full = [timed(f"full-{i}", kv_cache_usage="0.99") for i in range(n)]
    queued = [timed(f"queued-{i}", waiting="10", kv_cache_usage="0.1") for i in range(n)]
    view = view_of(*full, *queued, offset_ms=0.0)
    local = LocalLoad(clock=Clock())
    fleet = FleetLoad("g1")
    fleet.attach(local)
    fleet.extra = {f"queued-{i}": (50.0 if i % 2 else 0.0) for i in range(n)}
    chosen = picks(Picker(rng=random.Random(5)), view, 400, local=local)
    assert all(str(e).startswith("queued-") for e in chosen), chosen
    idle = sum(c for e, c in chosen.items() if int(str(e).split("-")[1]) % 2 == 0)
    assert idle >= 0.6 * 400, chosen  # the better of two: about 3 in 4
    # Only full engines left: the least loaded of them (when_saturated="least_loaded").
    only_full = view_of(*full, offset_ms=0.0)
    assert all(str(e).startswith("full-") for e in picks(Picker(), only_full, 50, local=local))


def test_an_exchange_that_works_on_what_changed_agrees_with_one_that_works_on_all() -> None:
    """``record`` and ``absorb`` given what changed (pages, our requests started or
    ended) redo only those endpoints and the ones in peers' fields that changed: the
    same figures as redoing every endpoint."""
    import random

    rng = random.Random(6)
    clock = Clock()
    whole, part = FleetLoad("g1"), FleetLoad("g1")
    local = LocalLoad(clock=clock)
    whole.attach(local)
    part.attach(local)
    pages = {f"e{i}": (rng.randrange(5), 100_000) for i in range(30)}
    open_: list[tuple[str, float]] = []
    last_peer: dict[str, list[int]] = {}
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
        peer = {f"e{rng.randrange(30)}": [rng.randrange(1, 4), 0, 0] for _ in range(3)}
        if step % 3 == 0:  # g2's counts unchanged since the last exchange
            peer = last_peer
        last_peer = peer
        steady = json.dumps({"e1": [1, 0, 0]})  # g3's never change
        fields = ["g3", f"1 {steady}"] + (["g2", f"1 {json.dumps(peer)}"] if step % 7 else [])
        changed |= local.take_changed()
        assert part.record(pages, 0.0, changed if step else None) == whole.record(pages, 0.0)
        whole.absorb(fields, pages, 0.0)
        part.absorb(fields, pages, 0.0, changed=changed if step else None)
        assert part.extra == whole.extra, step
        assert part.peers == whole.peers


def test_the_exchange_makes_at_most_20_commands_a_second_on_every_path() -> None:
    """One script call per period, and every path (answered, Redis away, refused) waits
    at least a period before the next: at most ``1 / PERIOD_S`` <= 20 calls a second
    per replica, whatever the request rate (a busy replica changes its counts every
    period)."""
    import threading

    from poller.reader.cache import ViewCache
    from poller.reader.exchange import Exchange
    from poller.reader.share import PERIOD_S

    assert 1 / PERIOD_S <= 20
    outcomes = iter([None, ConnectionError("away"), None, Exception("NOPERM no rights"), None] * 4)
    calls: list[int] = []

    def script(keys: list[str], args: list[object]) -> list[object]:
        calls.append(1)
        for _ in range(3):
            local.started("a")  # requests start between calls: no command more
        failure = next(outcomes)
        if failure is not None:
            raise failure
        return [0, 0]  # the TIME pair, no other replica

    class Client:
        def register_script(self, source: str) -> object:
            return script

    waits: list[float] = []

    class Stop(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            assert timeout is not None
            waits.append(timeout)
            if len(waits) == 20:
                self.set()
            return self.is_set()

    fleet = FleetLoad("g1")
    local = LocalLoad(clock=Clock())
    fleet.attach(local)
    exchange = Exchange(Client(), "P:gateways:inflight", ViewCache(), fleet)
    exchange.run_sync(Stop())
    assert len(calls) == len(waits) == exchange.calls == 20
    assert min(waits) >= PERIOD_S == fleet.period_s
