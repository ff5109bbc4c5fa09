"""The routing family: many fleets in virtual time, the picker against the oracle.

A discrete-event model, so that a cell costs a second of CPU, not a minute of wall time
on a shared machine, and its figures never depend on the machine's speed: engines with
``slots`` running slots and a FIFO queue, open-loop Poisson arrivals split among R gateway
replicas (and a share arriving from outside the gateways, spread by capacity), a poller
scraping every engine once per interval (staggered) whose page shows the engine as it was
``lag`` seconds before the scrape. Each gateway replica runs the real ``Router`` (its
view cache, ``LocalLoad``, ``FleetLoad`` and ``Exchange``, poller/reader/) on the sim
clock, and makes the share script's call when its exchange's pacer says (at once when
its counts changed and tokens are left, at least every ``FLOOR_S``); the script is
played in memory (``ShareScript``, script.py): the write, the totals that moved read
back, and the totals published (at most every ``PUBLISH_EVERY_MS``) reaching every
other replica ``PUSH_S`` later, as the channel does. Every policy of a cell serves the
same arrivals (times, sizes, gateways, outside choices).

Policies: ``oracle`` (the true queues at each request, least expected time to finish),
``picker`` (the defaults, sharing on), ``picker-noshare`` (sharing off: local counts on
stale pages, as with Redis lost), ``known`` (the oracle's rule on what the gateways
could know at best: every replica's requests in flight now, as if they shared at no
delay, and the outside requests the last page showed at the time it shows, each
expected to remain with ``exp(-age / mean service time)``, the engine's mean outside
load filling in for those that left: the reference for what sharing alone can reach
where part of the load comes from outside). Factors: mix, service times, outside
share, metrics lag, gateways, load, poller interval; the cells are in
lab/poller_lab/routing/cells.py.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from poller.reader import Router, RoutingOptions, Ticket
from poller.reader.exchange.exchange import LISTEN_S, Exchange
from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import LocalLoad
from poller.reader.view import EndpointView, View, ViewCache
from poller_lab.bench_fleet import percentile
from poller_lab.routing.cells import MIXES, Cell
from poller_lab.routing.script import ShareScript

__all__ = ["POLICIES", "run_cell", "run_family"]

MEAN_S = 0.4
LOGNORMAL_SIGMA = 1.0
POLICIES = ("oracle", "picker", "picker-noshare", "known")
#: From a replica's call to the others hearing its write (a loopback round trip's half).
PUSH_S = 0.0005
#: The KV usage a page shows when every slot runs: vLLM's gauge counts the blocks its
#: running requests hold (``BlockPool.get_usage``, vllm/v1/core/block_pool.py: one minus
#: the free blocks, cached-but-free ones among them), and its scheduler admits requests
#: while blocks remain, so a busy engine shows 0.8-1.0 (docs/simulator.md).
KV_FULL = 0.9


# --- the model ---------------------------------------------------------------------------


class _Engine:
    __slots__ = ("busy", "history", "id", "queue", "slots", "speed")

    def __init__(self, endpoint_id: str, slots: int, speed: float) -> None:
        self.id, self.slots, self.speed = endpoint_id, slots, speed
        self.busy = 0
        self.queue: list[tuple[float, int]] = []  # (work, request index)
        self.history: list[tuple[float, int]] = [(0.0, 0)]  # (time, requests on it)

    @property
    def load(self) -> int:
        return self.busy + len(self.queue)

    def at(self, t: float) -> int:
        """Requests on the engine at ``t`` (what a page of then shows)."""
        return _at(self.history, t)


def _at(history: list[tuple[float, int]], t: float) -> int:
    """The count a ``(time, count)`` history (from time 0) held at ``t``."""
    return history[bisect.bisect_right(history, (t, math.inf)) - 1][1]


def _sizes(rng: random.Random, service: str) -> float:
    if service == "exp":
        return rng.expovariate(1 / MEAN_S)
    mu = math.log(MEAN_S) - LOGNORMAL_SIGMA**2 / 2
    return rng.lognormvariate(mu, LOGNORMAL_SIGMA)


def _arrivals(
    cell: Cell, engines: Sequence[_Engine], duration_s: float, seed: int
) -> list[tuple[float, float, int, int]]:
    """(time, work, gateway or -1 for outside, outside engine index)."""
    rng = random.Random(seed)
    capacity = sum(e.slots * e.speed for e in engines) / MEAN_S
    rate = cell.load * capacity
    weights = [e.slots * e.speed for e in engines]
    out: list[tuple[float, float, int, int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        work = _sizes(rng, cell.service)
        outside = rng.random() < cell.outside
        target = rng.choices(range(len(engines)), weights)[0]
        out.append((t, work, -1 if outside else rng.randrange(cell.gateways), target))


class _NoRedis:
    """The exchange's client: the share script is played by ``run_cell``, never called."""

    def register_script(self, body: str) -> None:
        return None


class _Gateway:
    def __init__(self, index: int, policy: str, clock: list[float], seed: int, push: bool) -> None:
        def now() -> float:
            return clock[0]

        self.index = index
        self.push = push
        self.local = LocalLoad(clock=now)
        self.cache = ViewCache(clock=now)  # loaded with each scrape's view
        share = policy == "picker"
        self.fleet = FleetLoad(f"g{index}", clock=now) if share else None
        self.exchange: Exchange | None = None
        if self.fleet is not None:
            self.exchange = Exchange(_NoRedis(), "sim:gw", self.cache, self.fleet, clock=now)
            # Heard as they happen (HEAR below), or read on each call by a user without
            # the channel's right, who does not publish either.
            self.exchange.subscribed(push)
            self.exchange.publish = push
        self.router = Router(
            self.cache,
            RoutingOptions(share=share),
            local=self.local,
            fleet=self.fleet,
            exchange=self.exchange,
            rng=random.Random(seed),
        )
        self.tickets: dict[int, Ticket] = {}
        self.call_at = math.inf  # the next call scheduled


def run_cell(  # noqa: C901 (one event loop: splitting it would only pass its state around)
    cell: Cell, policy: str, duration_s: float, seed: int, *, push: bool = True
) -> dict[str, Any]:
    """One policy on one cell: latencies of the gateways' requests after a warm-up.
    ``push=False``: the picker's replicas share by reading the others' fields on each
    call, as a user without the channel's right does."""
    rng = random.Random(seed * 7 + 1)
    engines = [_Engine(f"e{i}", s, v) for i, (s, v) in enumerate(MIXES[cell.mix])]
    arrivals = _arrivals(cell, engines, duration_s, seed)
    clock = [0.0]
    gateways = [_Gateway(g, policy, clock, seed * 1000 + g, push) for g in range(cell.gateways)]
    script = ShareScript()  # poller/schema/scripts/share.lua, played in memory
    events: list[tuple[float, int, int, Any]] = []  # (time, seq, kind, data)
    seq = itertools.count()
    ARRIVE, DONE, SCRAPE, CALL, HEAR, LISTEN = 0, 1, 2, 3, 4, 5
    for i, a in enumerate(arrivals):
        heapq.heappush(events, (a[0], next(seq), ARRIVE, i))
    n = len(engines)
    for j in range(n):
        heapq.heappush(events, (cell.interval_s * (j + 0.5) / n, next(seq), SCRAPE, j))
    if policy == "picker":
        for g, gw in enumerate(gateways):
            assert gw.exchange is not None
            gw.call_at = gw.exchange.pacer.floor_s * (g + 0.5) / cell.gateways
            heapq.heappush(events, (gw.call_at, next(seq), CALL, g))
            heapq.heappush(events, (LISTEN_S * (g + 0.5) / cell.gateways, next(seq), LISTEN, g))

    def call_when(gw: _Gateway) -> None:
        """Schedule ``gw``'s next call where its exchange's pacer puts it, if sooner."""
        if gw.exchange is None:
            return
        at = clock[0] + gw.exchange.call_in(clock[0])
        if at < gw.call_at:
            gw.call_at = at
            heapq.heappush(events, (at, next(seq), CALL, gw.index))

    pages: dict[str, EndpointView] = {}
    view: View | None = None
    # The gateways' requests on each engine, now and as a (time, count) history.
    ours = [0] * n
    ours_history: list[list[tuple[float, int]]] = [[(0.0, 0)] for _ in range(n)]
    # "known": the outside requests the last page showed, at the time it shows.
    seen_outside: list[tuple[float, int]] = [(0.0, 0)] * n
    # ... and the outside requests an engine holds on average (its share of the outside
    # rate times the mean service time).
    outside_mean = [cell.outside * cell.load * e.slots * e.speed for e in engines]
    latency: list[float] = []
    end_at = duration_s + 120.0

    def least(load: Callable[[int], float]) -> int:
        """The oracle's rule on ``load``: the least expected time to finish, ties at
        random."""
        return min(
            range(n),
            key=lambda j: (
                max(1.0, (load(j) + 1) / engines[j].slots) / engines[j].speed,
                rng.random(),
            ),
        )

    def start(j: int, work: float, req: int) -> None:
        e = engines[j]
        t = clock[0]
        if e.busy < e.slots:
            e.busy += 1
            heapq.heappush(events, (t + work / e.speed, next(seq), DONE, (j, req)))
        else:
            e.queue.append((work, req))
        e.history.append((t, e.load))

    def page(j: int, t: float) -> EndpointView:
        e = engines[j]
        on = e.at(max(0.0, t - cell.lag_s))
        running, waiting = min(on, e.slots), max(0, on - e.slots)
        raw = {
            "engine": "vllm", "running": str(running), "waiting": str(waiting),
            "interval_ms": str(int(cell.interval_s * 1000)), "scraped_at_ms": str(int(t * 1000)),
            "poller": "p", "token": "1", "seq": "1",
            "kv_cache_usage": f"{KV_FULL * running / e.slots:.3f}",
            "kv_capacity_tokens": str(e.slots * 1000),
        }  # fmt: skip
        return EndpointView(e.id, state="fresh", age_ms=0, owner="p", token=1, raw=("", raw, {}))

    while events:
        t, _, kind, data = heapq.heappop(events)
        if t > end_at:
            break
        clock[0] = t
        if kind == ARRIVE:
            at, work, g, target = arrivals[data]
            if g < 0:
                start(target, work, data)
                continue
            gw = gateways[g]
            ticket = None
            if policy == "oracle":
                best = least(lambda j: engines[j].load)
            elif policy == "known":

                def guess(j: int, t: float = t) -> float:
                    # each outside request seen stays with exp(-age / mean); the
                    # engine's mean fills in for those that left
                    shown_s, seen = seen_outside[j]
                    stay = math.exp(-(t - shown_s) / MEAN_S)
                    return ours[j] + seen * stay + outside_mean[j] * (1 - stay)

                best = least(guess)
            elif view is not None:
                ticket = gw.router.pick()
            if ticket is not None:
                best = int(ticket.id[1:])
            else:  # the oracle's choice, or nowhere picked: a random engine
                if policy not in ("oracle", "known"):
                    best = rng.randrange(n)
                ticket = gw.router.track(engines[best].id)
            gw.tickets[data] = ticket
            ours[best] += 1
            ours_history[best].append((t, ours[best]))
            start(best, work, data)
            call_when(gw)
        elif kind == DONE:
            j, req = data
            e = engines[j]
            e.busy -= 1
            if e.queue:
                work, nxt = e.queue.pop(0)
                e.busy += 1
                heapq.heappush(events, (t + work / e.speed, next(seq), DONE, (j, nxt)))
            e.history.append((t, e.load))
            arrived = arrivals[req]
            if arrived[2] >= 0:
                ours[j] -= 1
                ours_history[j].append((t, ours[j]))
                gw = gateways[arrived[2]]
                gw.tickets.pop(req).done()
                if arrived[0] >= 0.1 * duration_s:
                    latency.append(t - arrived[0])
                call_when(gw)
        elif kind == SCRAPE:
            pages[engines[data].id] = page(data, t)
            shown_s = max(0.0, t - cell.lag_s)
            outside = engines[data].at(shown_s) - _at(ours_history[data], shown_s)
            seen_outside[data] = (shown_s, outside)
            view = View(int(t * 1000), 1, dict(pages), offset_ms=0.0)
            for gw in gateways:
                gw.cache.load(view)
                gw.cache.healthy = True
            if t + cell.interval_s < duration_s:
                heapq.heappush(events, (t + cell.interval_s, next(seq), SCRAPE, data))
        elif kind == CALL:
            gw = gateways[data]
            exchange = gw.exchange
            assert exchange is not None
            if t != gw.call_at:
                continue  # a later schedule of a call made sooner since
            _, args, numbers = exchange.prepare()
            reply, message = script.call(round(t * 1_000_000), args)
            if message is not None:
                for other in gateways:
                    if other is not gw:
                        heapq.heappush(
                            events, (t + PUSH_S, next(seq), HEAR, (other.index, message))
                        )
            exchange.answered(reply, numbers)
            gw.call_at = math.inf
            if t + exchange.pacer.floor_s < duration_s + 30:
                call_when(gw)
        elif kind == HEAR:
            g, message = data
            exchange = gateways[g].exchange
            assert exchange is not None
            exchange.heard(message)
            exchange.listen()
        elif kind == LISTEN:  # the exchange loop's own wake-up: the pages taken in
            exchange = gateways[data].exchange
            assert exchange is not None
            exchange.listen()
            if t + LISTEN_S < duration_s + 30:
                heapq.heappush(events, (t + LISTEN_S, next(seq), LISTEN, data))
    return {
        "requests": len(latency),
        "p50_s": round(percentile(latency, 0.5), 3) if latency else None,
        "p99_s": round(percentile(latency, 0.99), 3) if latency else None,
        "commands_per_s_per_replica": round(
            sum(gw.exchange.calls for gw in gateways if gw.exchange is not None)
            / (duration_s + 30) / cell.gateways, 1),
    }  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 2)


def run_family(
    cells: Sequence[Cell], duration_s: float, seed: int, say: Any = print
) -> dict[str, Any]:
    """Every cell under every policy; rows with p50/p99 and their ratios to the oracle."""
    started = time.monotonic()
    rows = []
    say(f"routing family: {len(cells)} cells of {duration_s:g} s virtual time, "
        f"policies {', '.join(POLICIES)}")  # fmt: skip
    say(FAMILY_HEADER)
    for k, cell in enumerate(cells):
        result = {p: run_cell(cell, p, duration_s, seed + k) for p in POLICIES}
        oracle, picker, noshare, known = (result[p] for p in POLICIES)
        row = {
            **vars(cell),
            "cell": cell.name(),
            **{f"{p}_{q}": result[p][q] for p in POLICIES for q in ("p50_s", "p99_s")},
            "p50_x": _ratio(picker["p50_s"], oracle["p50_s"]),
            "p99_x": _ratio(picker["p99_s"], oracle["p99_s"]),
            "noshare_p99_x": _ratio(noshare["p99_s"], oracle["p99_s"]),
            "known_p50_x": _ratio(known["p50_s"], oracle["p50_s"]),
            "known_p99_x": _ratio(known["p99_s"], oracle["p99_s"]),
            "requests": oracle["requests"],
            "commands_per_s_per_replica": picker["commands_per_s_per_replica"],
        }
        rows.append(row)
        say(format_family_row(row))
    worst = max(rows, key=lambda r: r["p99_x"] or 0.0) if rows else None
    return {
        "cells": len(rows),
        "duration_s": duration_s,
        "rows": rows,
        "worst_p99": worst,
        "worst_p50": max(rows, key=lambda r: r["p50_x"] or 0.0) if rows else None,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


FAMILY_HEADER = (
    f"{'cell':<52} {'reqs':>6} {'oracle p50/p99':>15} {'picker p50/p99':>15} "
    f"{'p50 x':>6} {'p99 x':>6} {'noshare p99 x':>13} {'known p50/p99 x':>15} {'cmd/s':>5}"
)


def format_family_row(row: dict[str, Any]) -> str:
    def pair(p: str) -> str:
        return f"{row[p + '_p50_s']:.2f}/{row[p + '_p99_s']:.2f}"

    return (
        f"{row['cell']:<52} {row['requests']:>6} {pair('oracle'):>15} {pair('picker'):>15} "
        f"{row['p50_x']:>6} {row['p99_x']:>6} {row['noshare_p99_x']:>13} "
        f"{_pair_x(row['known_p50_x'], row['known_p99_x']):>15} "
        f"{row['commands_per_s_per_replica']:>5}"
    )


def _pair_x(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a:.2f}/{b:.2f}"
