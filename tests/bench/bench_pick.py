"""Time a Router's pick on a cached view of N endpoints (in-process, no Redis).

Usage: python tests/bench/bench_pick.py [--endpoints 1000] [--picks 20000] [--json]

Fills a ``ViewCache`` the way a snapshot does (registry entries and compact stats records
as strings) with a mixed fleet: 8 models, a third of the engines without a KV figure,
2% asleep, 2% failing, 10% saturated. Then it times one call at a time
(wall clock and this thread's CPU time around each, garbage collector off) and prints
p50/p99/max in us:

- ``router.pick()`` on a Router that shares nothing (``RoutingOptions(share=False)``:
  the load model corrected by this replica's own requests), without and with
  ``model=``; each pick's ticket is ended before the next pick, untimed, so a third of
  the endpoints keep a request in flight throughout;
- the same with one stats update applied to the cache before every pick (the index is
  kept current from the change log: this is the cost of that upkeep, per update);
- ``ticket.done()``: the end of a request, counted;
- ``router.view()``: every endpoint as of now (for contrast: linear in the fleet);
- the shared counts (poller/reader/load/fleet.py): ``router.pick()`` on a Router whose
  fleet holds the counts of 7 other gateway replicas, without and with ``model=``, one
  background exchange call's CPU (``Exchange``: the pages a 1 s interval brings in
  50 ms applied before it, the record written and the replies taken in, Redis's round
  trip left out), one peer's pushed write heard, and the CPU per second of both at the
  cap (20 calls a second, every peer's writes heard);
- constant work calibrated to the shared pick's CPU p50, timed the same way: its p99 is
  the machine's own tail at that duration, the floor under any pick's p99.

Timings come from whatever machine runs it, often shared and noisy: compare runs on one
machine, not single numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from itertools import repeat
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from poller.reader import Router, RoutingOptions, Ticket, ViewCache  # noqa: E402
from poller.reader.exchange.exchange import Exchange  # noqa: E402
from poller.reader.exchange.pacer import BURST, RATE_PER_S  # noqa: E402
from poller.reader.exchange.wire import PUBLISH_EVERY_MS  # noqa: E402
from poller.reader.load.fleet import FleetLoad  # noqa: E402
from poller.reader.load.local import LocalLoad  # noqa: E402
from poller.reader.view import View  # noqa: E402
from poller.reader.view.decode import LazyEndpoints  # noqa: E402

MODELS = [f"org/model-{i}" for i in range(8)]


def record(now_ms: int, rng: random.Random, i: int, seq: int = 1) -> str:
    scraped = now_ms - rng.randrange(0, 900)
    fields = {
        "engine": "tgi" if i % 3 == 0 else "vllm",
        "running": str(rng.randrange(0, 20)),
        "waiting": str(6 if i % 10 == 0 else rng.randrange(0, 4)),
        "interval_ms": "1000",
        "scraped_at_ms": str(scraped),
        "poller": "p1",
        "token": "7",
        "seq": str(seq),
        "models": MODELS[i % len(MODELS)],
    }
    if i % 3:
        fields["kv_cache_usage"] = str(round(rng.random() * 0.7, 3))
    if i % 50 == 1:
        fields["sleeping"] = "1"
    # an hour of validity: a long run must not see the records expire
    return f"{scraped} 1000 {now_ms + 3_600_000} p1 7|{json.dumps(fields)}"


def fleet(n: int, now_ms: int) -> ViewCache:
    rng = random.Random(1)
    entries = {
        f"ep-{i}": json.dumps({"url": f"http://10.0.{i // 250}.{i % 250}:8000"}) for i in range(n)
    }
    stats = {f"ep-{i}": record(now_ms, rng, i) for i in range(n)}
    failures = {f"ep-{i}": f"{now_ms} {now_ms + 3_600_000} p1 7|{{}}" for i in range(0, n, 50)}
    cache = ViewCache(stale_after_ms=3_600_000)  # stays fresh for the whole run
    cache.load(View(now_ms, 1, LazyEndpoints(entries, stats, failures, now_ms)))
    cache.healthy = True
    return cache


def timed(
    fn: Callable[[int], object],
    count: int,
    before: Callable[[int], object] | None = None,
) -> dict[str, float]:
    """Wall and CPU time (this thread's) per call: on a loaded machine the wall p99 is
    mostly time spent preempted; the CPU p99 is what a pick costs. ``before(k)`` runs
    untimed before each call."""
    wall, cpu = [], []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    gc.disable()
    try:
        for k in range(count):
            if before is not None:
                before(k)
            start, cpu_start = clock(), cpu_clock()
            fn(k)
            cpu.append(cpu_clock() - cpu_start)
            wall.append(clock() - start)
    finally:
        gc.enable()
    wall.sort()
    cpu.sort()
    p99 = int(count * 0.99)
    return {
        "p50_us": wall[count // 2] / 1000,
        "p99_us": wall[p99] / 1000,
        "max_us": wall[-1] / 1000,
        "cpu_p50_us": cpu[count // 2] / 1000,
        "cpu_p99_us": cpu[p99] / 1000,
        "mean_us": statistics.fmean(wall) / 1000,
        "count": count,
    }


def _work(n: int) -> int:
    total = 0
    for i in range(n):
        total += i & 7
    return total


def steady(median_us: float, count: int) -> dict[str, float]:
    """A loop of constant work calibrated to a median of ``median_us``, timed as the picks
    are: its p99 is this machine's own tail at that duration (preemption, frequency,
    neighbours on the core), which no call of that median goes below."""
    n = 2000
    probe = timed(lambda k: _work(n), 500)
    n = max(1, round(n * median_us / max(probe["cpu_p50_us"], 1e-3)))
    return timed(lambda k: _work(n), count)


PEERS = 7


def peer_totals(n: int, cache: ViewCache, rng: random.Random) -> list[str]:
    """The share script's totals for ``PEERS`` other replicas, each with requests in
    flight on a tenth of the endpoints (``[endpoint, total, ...]``)."""
    totals: dict[str, int] = {}
    for _ in range(PEERS):
        for i in rng.sample(range(n), max(1, n // 10)):
            totals[f"ep-{i}"] = totals.get(f"ep-{i}", 0) + rng.randrange(1, 4)
    return [x for e, total in totals.items() for x in (e, str(total))]


class _Script:
    """The share script's call without Redis (the round trip itself is not the
    exchange's CPU): every total on the first call, then a tenth of them each time, as
    a busy fleet moves them between two calls."""

    def __init__(self, fields: list[str]) -> None:
        self.fields, self.number = fields, 0

    def __call__(self, keys: list[str], args: list[object]) -> list[object]:
        self.number += 1
        pairs = len(self.fields) // 2
        if self.number == 1:
            moved = self.fields
        else:
            tenth = max(1, pairs // 10)
            k = (self.number * tenth) % pairs
            moved = [
                x for j in range(k, min(pairs, k + tenth)) for x in self.fields[2 * j : 2 * j + 2]
            ]
        return ["0", "0", PEERS, self.number, 0, int(self.number == 1), 0, *moved]


class _Client:
    def __init__(self, fields: list[str]) -> None:
        self.fields = fields

    def register_script(self, body: str) -> _Script:
        return _Script(self.fields)


class Picks:
    """A Router's picks as a gateway makes them: each ticket ended before the next pick
    (``end``, untimed), so what is in flight stays as the bench set it up."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.held: Ticket | None = None

    def end(self, k: int = 0) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.done()

    def pick(self, model: str | None = None, prompt: str | None = None) -> object:
        self.held = self.router.pick(model, prompt=prompt)
        return self.held


def shared(
    cache: ViewCache,
    local: LocalLoad,
    n: int,
    count: int,
    results: dict[str, dict[str, float]],
) -> None:
    """The pick and the background exchange with the fleet's shared counts present."""
    fleet = FleetLoad("bench", clock=repeat(0.0).__next__)  # answered as of every pick
    rng = random.Random(4)
    fields = peer_totals(n, cache, rng)
    exchange = Exchange(_Client(fields), "{bench}:gateways:inflight", cache, fleet)
    router = Router(cache, local=local, fleet=fleet, exchange=exchange, rng=random.Random(2))

    def once(k: int) -> object:
        keys, args, pages = exchange.prepare()
        exchange.answered(exchange.script(keys=keys, args=args), pages)
        return args

    once(0)
    assert len(fleet.extra) >= n // 2 and fleet.peers == PEERS and router.load_shared
    picks = Picks(router)
    results["shared: router.pick()"] = timed(lambda k: picks.pick(), count, before=picks.end)
    results["shared: router.pick(model=)"] = timed(
        lambda k: picks.pick(MODELS[k % len(MODELS)]), count, before=picks.end
    )
    picks.end()
    # Between two calls of a busy replica (the pacer's rate) a 1 s poller interval brings
    # that share of the pages.
    share_n = max(1, round(n / RATE_PER_S))
    now_ms = cache.now_ms()
    rounds = max(20, count // 100)
    batches = [
        [(f"ep-{i}", record(now_ms, rng, i, seq=3)) for i in rng.sample(range(n), share_n)]
        for _ in range(rounds)
    ]

    def updated(k: int) -> None:
        for endpoint_id, stats in batches[k]:
            cache.set_stats(endpoint_id, stats)

    results["shared: one exchange"] = timed(once, rounds, before=updated)
    # The channel's message at its largest: every endpoint with a total moved (a busy
    # fleet's window), as the script publishes it.
    totals = {fields[i]: int(fields[i + 1]) for i in range(0, len(fields), 2)}
    heard = []
    for k in range(rounds):
        pairs = " ".join(f"{e}:{t + (k % 3)}" for e, t in totals.items())
        heard.append(f"{10**15 + k} {now_ms + k} {pairs}")

    def hear(k: int) -> None:
        exchange.heard(heard[k])
        exchange.listen()

    results[f"shared: hear {len(totals)} totals"] = timed(hear, rounds)
    fleet.detach(local)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--picks", type=int, default=20000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n, count = args.endpoints, args.picks
    cache = fleet(n, int(time.time() * 1000))
    local = LocalLoad()
    for i in range(0, n, 3):  # requests in flight, some after the scrape
        local.started(f"ep-{i}")
    router = Router(cache, RoutingOptions(share=False), local=local, rng=random.Random(2))
    picks = Picks(router)
    assert picks.pick() is not None  # builds the index once
    for _ in range(2000):  # warm: the first timed row is not the interpreter's warm-up
        picks.end()
        picks.pick()
    results: dict[str, dict[str, float]] = {}
    results["router.pick()"] = timed(lambda k: picks.pick(), count, before=picks.end)
    results["router.pick(model=)"] = timed(
        lambda k: picks.pick(MODELS[k % len(MODELS)]), count, before=picks.end
    )
    rng = random.Random(3)
    now_ms = cache.now_ms()
    updates = [(f"ep-{i}", record(now_ms, rng, i, seq=2)) for i in rng.choices(range(n), k=count)]

    def update_then_pick(k: int) -> object:
        cache.set_stats(*updates[k])
        return picks.pick(MODELS[k % len(MODELS)])

    results["update + router.pick(model=)"] = timed(update_then_pick, count, before=picks.end)
    picks.end()
    tickets = [router.pick() for _ in range(count)]
    results["ticket.done()"] = timed(lambda k: tickets[k].done(), count)  # type: ignore[union-attr]
    results["router.view()"] = timed(lambda k: router.view(), max(20, count // 100))
    shared(cache, local, n, count, results)
    results["constant work, same cpu p50"] = steady(
        results["shared: router.pick()"]["cpu_p50_us"], count
    )
    if args.json:
        print(json.dumps({"endpoints": n, "results": results}))
        return
    print(f"{n} endpoints; times per call in us ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"{'':30} {'p50':>8} {'p99':>8} {'max':>8} {'cpu p50':>8} {'cpu p99':>8} {'calls':>6}")
    for name, r in results.items():
        print(
            f"{name:30} {r['p50_us']:8.1f} {r['p99_us']:8.1f} {r['max_us']:8.1f}"
            f" {r['cpu_p50_us']:8.1f} {r['cpu_p99_us']:8.1f} {r['count']:6}"
        )
    call = results["shared: one exchange"]
    hear = next(r for name, r in results.items() if name.startswith("shared: hear"))
    calls_s = BURST + RATE_PER_S  # the most in any second, whatever the request rate
    heard_s = 1000 / PUBLISH_EVERY_MS  # the most messages in a second from 64 replicas on
    per_s = (call["cpu_p50_us"] * calls_s + hear["cpu_p50_us"] * heard_s) / 1e6
    print(
        f"the exchange at its cap ({calls_s:g} calls/s, {heard_s:g} messages/s of that size):"
        f" {per_s:.1%} of a core"
    )


if __name__ == "__main__":
    main()
