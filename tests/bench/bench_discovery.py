"""Measure DNS discovery end to end: three `poller run`, dnsmasq, the engine simulator.

Usage: python tests/bench/bench_discovery.py [--engines 6] [--refresh 1] [--rounds 3]

Starts a private redis-server, a simulator with ``--engines`` vLLM endpoints (one port
each), a dnsmasq (tests/support/dnsproc.py) publishing SRV records for the first half of them, and
three pollers with ``--discover dns+srv://...?refresh=R``. Then, ``--rounds`` times, it
changes the records (restarting dnsmasq with the new set, as a zone change would) and
times, from the moment dnsmasq answers with the new records:

- add: until the registry holds the new engine, and until the view shows it ``fresh``;
- remove: until the registry drops the engine (two answers without it are needed);
- takeover: SIGKILL the poller resolving the source, until another one has written its
  status (after the dead one's membership and lease lapse).

It also counts the SRV queries dnsmasq logged over a quiet window across all three
pollers, per refresh period (the target is one). Prints one table. Bounded: every wait
has a deadline; everything it started is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script run from a checkout

import redis.asyncio as aioredis

from poller.reader.reader import StatsReader
from poller.store.discovery import read_sources
from poller.store.store import RedisStore
from poller_lab.embedded import (
    free_port,
    start_pollers,
    start_redis_server,
    wait_until,
    workdir,
)
from poller_lab.sim import EndpointSpec, Simulator
from tests.support.dnsproc import DnsProcess

SRV = "_metrics._tcp.vllm.test"
NS = "bench"


async def until(cond, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``await cond()`` is true (polled every 20 ms)."""
    start = time.monotonic()
    while not await cond():
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def main(engines: int, refresh_s: float, rounds: int) -> None:
    with workdir("poller-bench-discovery-") as work:
        port = free_port()
        redis_proc = start_redis_server(work, port)
        url = f"redis://127.0.0.1:{port}/0"
        dns = DnsProcess()
        procs = []
        try:
            wait_until(lambda: redis_proc.alive(), 5, "redis")
            specs = [EndpointSpec(f"vllm-{i}", "vllm", "port") for i in range(engines)]
            async with Simulator(specs) as sim:
                ports = [int(sim.base_url(e).rsplit(":", 1)[1]) for e in sim.ids]
                live = set(ports[: engines // 2])
                dns.set(srv=[(SRV, "localhost", p) for p in sorted(live)]).start()
                uri = f"dns+srv://{SRV}?engine=vllm&name=vllm&refresh={refresh_s}"
                uri += f"&nameserver={dns.nameserver}"
                pairs = start_pollers(work, url, NS, ["p0", "p1", "p2"], extra=("--discover", uri))
                procs = [p for p, _ in pairs]
                client = aioredis.Redis.from_url(url, decode_responses=True)
                store = RedisStore(client, NS)
                reader = StatsReader(client, NS)

                async def ids() -> set[int]:
                    registry = await store.read_registry()
                    return {int(e.rsplit(":", 1)[1]) for e in registry.endpoints}

                async def fresh(p: int) -> bool:
                    view = await reader.snapshot()
                    e = view.endpoints.get(f"vllm/localhost:{p}")
                    return e is not None and e.state == "fresh"

                async def has_all() -> bool:
                    return await ids() == live

                await until(has_all, 60, "the first engines")
                add_registry, add_fresh, remove_registry = [], [], []
                spare = [p for p in ports if p not in live]
                for r in range(rounds):
                    new = spare[r % len(spare)]
                    live.add(new)
                    dns.set(srv=[(SRV, "localhost", p) for p in sorted(live)]).restart()

                    async def added(new: int = new) -> bool:
                        return new in await ids()

                    t_reg = await until(added, 30, "an added engine in the registry")
                    t_fresh = t_reg + await until(lambda new=new: fresh(new), 30, "fresh")
                    add_registry.append(t_reg)
                    add_fresh.append(t_fresh)
                    gone = new
                    live.discard(gone)
                    dns.set(srv=[(SRV, "localhost", p) for p in sorted(live)]).restart()

                    async def removed(gone: int = gone) -> bool:
                        return gone not in await ids()

                    remove_registry.append(await until(removed, 30, "a removed engine"))
                window_s = max(10 * refresh_s, 5.0)
                before = dns.queries(SRV)
                await asyncio.sleep(window_s)
                queries = dns.queries(SRV) - before
                # takeover: SIGKILL the resolving poller, time until another one resolves
                [status] = await read_sources(client, store.keys)
                victim = next(p for p in procs if p.name == status["holder"])
                victim.signal(signal.SIGKILL)
                killed_at_ms = int(status["at_ms"])

                async def taken_over() -> bool:
                    [s] = await read_sources(client, store.keys)
                    return s["holder"] not in (None, victim.name) and int(s["at_ms"]) > killed_at_ms

                takeover_s = await until(taken_over, 30, "another poller resolving")
                await client.aclose()
        finally:
            for p in procs:
                p.stop()
            dns.cleanup()
            redis_proc.stop()

    def row(name: str, values: list[float]) -> str:
        return (
            f"{name:<44} median {statistics.median(values):5.2f} s"
            f"   max {max(values):5.2f} s   (n={len(values)})"
        )

    print(f"3 pollers, {engines} simulated vLLM engines, dnsmasq SRV, refresh {refresh_s:g} s")
    print(row("record added -> entry in the registry", add_registry))
    print(row("record added -> engine fresh in the view", add_fresh))
    print(row("record removed -> entry gone (2 answers)", remove_registry))
    print(f"{'resolver SIGKILLed -> another one resolving':<44} {takeover_s:5.2f} s")
    print(
        f"{'SRV queries per refresh, all 3 pollers':<44} {queries / (window_s / refresh_s):5.2f}"
        f"   ({queries} queries in {window_s:g} s)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=6)
    parser.add_argument("--refresh", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.engines, args.refresh, args.rounds))
