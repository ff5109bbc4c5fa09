"""``poller bench --section sharing``: what the gateway replicas' sharing costs Redis and
each replica, as replicas are added.

For each replica count R (8, 32, 64, 128 by default): a private redis-server, a
registry of ``ENDPOINTS`` endpoints with their stats (as pollers write them), R - 1
simulated replicas and one real one. A simulated replica makes the share script's call
(poller/schema/scripts/share.lua) at ``rate`` calls a second, every call carrying a
changed record (a busy replica: requests in flight on a few endpoints, moving), as the
exchange writes it, and reads the reply; it costs Redis what a replica costs it, and
its own client next to nothing (raw sockets: the replies parsed for their change number
only). The
real replica is a ``Router`` of the product (``reader.router()``) in a process of its
own, idle: its CPU over the window is what taking in the others' updates costs a
replica. Measured over ``window_s``: Redis CPU (``INFO cpu``) per replica, commands per
second, reply bytes per call, bytes pushed to each replica, and the real replica's CPU
share of a core, whole and beyond what it uses alone (a run with no other replica).

Simulated replicas run in ``WORKERS`` processes; every process is stopped by pid at the
end, and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hiredis

from poller.reader.exchange.wire import PUBLISH_EVERY_MS
from poller.schema.keys import Keys
from poller.schema.lua import lua
from poller_lab.embedded import embedded_redis, process_cpu_s, workdir

__all__ = ["REPLICAS", "bench_sharing", "format_sharing"]

NS = "sharing"
REPLICAS = (8, 32, 64, 128)
ENDPOINTS = 64
#: Calls a second per simulated replica: the exchange's pacer at its sustained rate.
RATE_PER_S = 16.0
WORKERS = 2
TTL_MS = 800
#: Endpoints a simulated replica has requests in flight on at a time.
BUSY_ON = 4


def _pack(*parts: Any) -> bytes:
    command: Any = tuple(str(p) for p in parts)
    return bytes(hiredis.pack_command(command))


def _record(rng: random.Random, now_ms: int) -> str:
    """A busy replica's field: a few endpoints with requests in flight, as the exchange
    writes it (``{endpoint: [now, at its page's scrape, scraped_ms]}``)."""
    counts = {
        f"ep-{e}": [rng.randrange(1, 4), rng.randrange(0, 3), now_ms - rng.randrange(0, 1000)]
        for e in rng.sample(range(ENDPOINTS), BUSY_ON)
    }
    return json.dumps(counts, separators=(",", ":"))


async def _replica(
    url_host: str, port: int, sha: str, keys: Keys, replica: str, rate: float, stop_at: float,
    start_at: float, counters: dict[str, int], subscribe: bool,
) -> None:  # fmt: skip
    """One simulated replica: its calls at ``rate`` (staggered from ``start_at``), and the
    channel's pushes drained when ``subscribe``."""
    rng = random.Random(replica)
    reader, writer = await asyncio.open_connection(url_host, port)
    subscriber = None
    if subscribe:
        sub_reader, sub_writer = await asyncio.open_connection(url_host, port)
        sub_writer.write(_pack("SSUBSCRIBE", keys.gateways_updates))
        subscriber = asyncio.create_task(_drain(sub_reader, counters, "pushed_bytes"))
    last: list[Any] = [""]  # the change number of the last reply: reads only what moved
    replies = asyncio.create_task(_drain(reader, counters, "reply_bytes", last))
    period = 1.0 / rate
    at = start_at + rng.random() * period
    try:
        while at < stop_at:
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            record = _record(rng, int(time.time() * 1000))
            writer.write(
                _pack(
                    "EVALSHA",
                    sha,
                    5,
                    keys.gateways_inflight,
                    keys.gateways_updates,
                    keys.gateways_load,
                    keys.gateways_changed,
                    keys.gateways_alive,
                    replica,
                    TTL_MS,
                    record,
                    1,
                    last[0],
                    PUBLISH_EVERY_MS,
                )  # fmt: skip
            )
            counters["calls"] += 1
            at += period
        await writer.drain()
    finally:
        for task in (replies, subscriber):
            if task is not None:
                task.cancel()
        writer.close()


async def _drain(
    reader: asyncio.StreamReader, counters: dict[str, int], name: str, last: list[Any] | None = None
) -> None:
    """Counts the bytes; with ``last``, parses the script's replies and keeps their change
    number in ``last[0]`` (as the exchange does)."""
    parser = hiredis.Reader()
    while True:
        data = await reader.read(65536)
        if not data:
            return
        counters[name] += len(data)
        if last is not None:
            parser.feed(data)
            while (reply := parser.gets()) is not False:
                if isinstance(reply, list):
                    last[0] = int(reply[3])


def _worker(
    url: str, replicas: Sequence[str], rate: float, window_s: float, go: Any, out: Any,
    subscribe: bool,
) -> None:  # fmt: skip
    """A process of simulated replicas, from ``go`` for ``window_s`` (+ a warm-up)."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    keys = Keys(NS)
    counters = {"calls": 0, "reply_bytes": 0, "pushed_bytes": 0}

    async def run() -> None:
        import redis

        sha = redis.Redis.from_url(url).script_load(lua("share"))
        go.wait(60)
        start = time.monotonic()
        stop_at = start + window_s + 2.0
        await asyncio.gather(
            *(
                _replica(
                    host, int(port), str(sha), keys, r, rate, stop_at, start, counters, subscribe
                )  # fmt: skip
                for r in replicas
            )
        )

    try:
        asyncio.run(run())
        out.put(counters)
    except Exception as exc:  # reported by the parent
        out.put({"error": repr(exc)})


_OBSERVER = """
import asyncio, sys, time
from poller.reader import StatsReader

async def main() -> None:
    async with StatsReader.from_url(sys.argv[1], sys.argv[2]) as reader:
        async with reader.router(replica_id="observer") as router:
            print("ready", flush=True)
            while True:
                await asyncio.sleep(0.5)

asyncio.run(main())
"""


def _registry(url: str) -> None:
    """``ENDPOINTS`` endpoints with stats that last the run, as pollers write them."""
    import redis.asyncio as aioredis

    from poller.schema.endpoint import Endpoint
    from poller.store.store import RedisStore

    async def fill() -> None:
        client = aioredis.Redis.from_url(url, decode_responses=True)
        store = RedisStore(client, NS)
        await store.ensure_schema()
        await store.heartbeat("p1", 600_000)
        ids = [f"ep-{e}" for e in range(ENDPOINTS)]
        for i, e in enumerate(ids):
            await store.put_endpoint(Endpoint(id=e, url=f"http://10.0.{i // 250}.{i % 250}:8000"))
        for lease in await store.acquire_leases("p1", ids, 600_000):
            stats = {"engine": "vllm", "running": "2", "waiting": "0", "interval_ms": "1000"}
            await store.write_stats(
                lease.endpoint_id, "p1", lease.token or 0, stats,
                lease_ttl_ms=600_000, stats_ttl_ms=600_000,
            )  # fmt: skip
        await client.aclose()

    asyncio.run(fill())


def _redis_counters(client: Any) -> tuple[float, int]:
    cpu = client.info("cpu")
    stats = client.info("stats")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), int(
        stats["total_commands_processed"]
    )


def one_count(url: str, replicas: int, rate: float, window_s: float) -> dict[str, Any]:
    """R - 1 simulated replicas and one real one, measured over ``window_s``."""
    import redis

    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{Keys(NS).prefix}:*", count=1000):
        client.delete(key)  # this bench's namespace only
    _registry(url)
    observer = subprocess.Popen(
        [sys.executable, "-c", _OBSERVER, url, NS], stdout=subprocess.PIPE, text=True
    )
    procs: list[Any] = []
    try:
        assert observer.stdout is not None
        if observer.stdout.readline().strip() != "ready":
            raise RuntimeError("the observing replica did not start")
        ids = [f"sim-{i}" for i in range(replicas - 1)]
        ctx = mp.get_context("fork")
        go, out = ctx.Event(), ctx.Queue()
        shares = [ids[w::WORKERS] for w in range(WORKERS)]
        procs = [
            ctx.Process(target=_worker, args=(url, share, rate, window_s, go, out, True))
            for share in shares
            if share
        ]
        for p in procs:
            p.start()
        go.set()
        time.sleep(2.0)  # every replica calling, the observer's peers all known
        cpu0, commands0 = _redis_counters(client)
        observer0 = process_cpu_s(observer.pid)
        t0 = time.monotonic()
        time.sleep(window_s)
        elapsed = time.monotonic() - t0
        cpu1, commands1 = _redis_counters(client)
        observer_s = process_cpu_s(observer.pid) - observer0
        results = [out.get(timeout=60) for _ in procs]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(f"a simulated replica failed: {errors[0]}")
        calls = sum(r["calls"] for r in results)
        reply_bytes = sum(r["reply_bytes"] for r in results)
        pushed = sum(r["pushed_bytes"] for r in results)
        redis_s = (cpu1 - cpu0) / elapsed
        return {
            "replicas": replicas,
            "redis_cpu_s_per_s": round(redis_s, 4),
            "redis_cpu_ms_per_s_per_replica": round(1000 * redis_s / replicas, 3),
            "commands_per_s": round((commands1 - commands0) / elapsed, 1),
            "calls_per_s": round(calls / (window_s + 2.0), 1),
            "reply_bytes_per_call": round(reply_bytes / max(1, calls)),
            "pushed_bytes_per_s_per_replica": round(
                pushed / (window_s + 2.0) / max(1, replicas - 1)
            ),
            "replica_cpu_share": round(observer_s / elapsed, 4),
        }
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        observer.terminate()
        try:
            observer.wait(10)
        except subprocess.TimeoutExpired:
            observer.kill()
        client.close()


def bench_sharing(
    counts: Sequence[int] = REPLICAS,
    rate: float = RATE_PER_S,
    window_s: float = 10.0,
    redis_url: str | None = None,
) -> dict[str, Any]:
    """Every replica count in turn, on ``redis_url`` (its ``{sharing}`` keys only) or an
    embedded redis-server."""
    rows = []
    with contextlib.ExitStack() as stack:
        url = redis_url
        if url is None:
            work = stack.enter_context(workdir("llmgw-sharing-"))
            url, _ = stack.enter_context(embedded_redis(Path(work)))
        idle = one_count(url, 1, rate, window_s)["replica_cpu_share"]  # a replica alone
        for r in counts:
            rows.append(one_count(url, r, rate, window_s))
    base = rows[0]["redis_cpu_ms_per_s_per_replica"] if rows else 0.0
    for row in rows:
        row["per_replica_x_first"] = round(row["redis_cpu_ms_per_s_per_replica"] / base, 2)
        row["replica_cpu_for_others"] = round(max(0.0, row["replica_cpu_share"] - idle), 4)
    return {
        "rate_per_s": rate,
        "window_s": window_s,
        "endpoints": ENDPOINTS,
        "idle_replica_cpu_share": idle,
        "rows": rows,
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def format_sharing(report: dict[str, Any]) -> str:
    lines = [
        f"sharing: replicas calling the share script at {report['rate_per_s']:g}/s, "
        f"{report['endpoints']} endpoints, {report['window_s']:g} s windows, "
        f"load average {report['load_average'][0]:.2f}; a replica alone uses "
        f"{report['idle_replica_cpu_share']:.1%} of a core",
        f"{'replicas':>8} {'redis s/s':>9} {'ms/s/replica':>12} {'x first':>7} "
        f"{'cmds/s':>8} {'calls/s':>8} {'reply B/call':>12} {'pushed B/s/rep':>14} "
        f"{'replica cpu':>11} {'for others':>10}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['replicas']:>8} {r['redis_cpu_s_per_s']:>9.3f} "
            f"{r['redis_cpu_ms_per_s_per_replica']:>12.3f} {r['per_replica_x_first']:>7} "
            f"{r['commands_per_s']:>8.0f} {r['calls_per_s']:>8.0f} "
            f"{r['reply_bytes_per_call']:>12} {r['pushed_bytes_per_s_per_replica']:>14} "
            f"{r['replica_cpu_share']:>11.1%} {r['replica_cpu_for_others']:>10.1%}"
        )
    return "\n".join(lines)


def main() -> None:
    counts = tuple(int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "8,32,64,128").split(","))
    window = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    sys.stdout.write(format_sharing(bench_sharing(counts, window_s=window)) + "\n")


if __name__ == "__main__":
    main()
