"""``poller bench --section readers``: what cached readers cost Redis and themselves.

One ``poller run`` writes N simulated endpoints at the interval; then 0, 1, 8 and 24
gateway replicas (``StatsReader.router()``, one process each) follow the view for one
window each. Measured per reader count: Redis CPU s/s (``INFO cpu`` of the embedded
redis-server, the poller's writes included), Redis commands/s, scripts/s (EVALSHA: the
poller's writes, so how much the poller kept up, and the readers' reads), each reader's
CPU per update it applied, and event-to-cache latency: from the write's Redis ``TIME`` stamp
(``scraped_at_ms``, the same machine's clock) to the moment the reader's cache stored it.

The reader processes hook the cache's store step on the class (``set_stats`` today;
``apply`` on readers that re-read each event), so the same bench measures an older
reader for the before/after table in docs/performance.md. Bounded in time: every step
has a deadline, every process is stopped by pid.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from typing import Any

from poller_lab.bench_fleet import percentile

__all__ = ["READER_COUNTS", "bench_readers", "format_readers"]

READER_COUNTS = (0, 1, 8, 24)
READY_TIMEOUT_S = 60.0


def _hook_cache(seen: list[float]) -> None:
    """Record (wall ms at store - write ms) for every update the cache stores."""
    import poller.reader

    cls: Any = poller.reader.ViewCache
    original = cls.set_stats

    def set_stats(self: Any, endpoint_id: str, record: str) -> None:
        original(self, endpoint_id, record)
        seen.append(time.time() * 1000 - int(record[: record.find(" ")]))

    cls.set_stats = set_stats


def _reader_process(url: str, namespace: str, ready: Any, go: Any, done: Any, out: Any) -> None:
    """One gateway replica: a Router, measured over the window [go, done]."""
    from poller.reader import StatsReader

    seen: list[float] = []
    _hook_cache(seen)

    async def run() -> None:
        reader = StatsReader.from_url(url, namespace)
        try:
            async with reader.router():
                ready.set()
                await asyncio.to_thread(go.wait)  # the loop keeps following meanwhile
                cpu0, n0 = time.process_time(), len(seen)
                await asyncio.to_thread(done.wait)
                cpu, window = time.process_time() - cpu0, seen[n0:]
                # Reported before leaving: an older reader could hang there (Python 3.11).
                out.put({"cpu_s": cpu, "updates": len(window), "latencies_ms": window})
        finally:
            await reader.aclose()

    try:
        asyncio.run(run())
    except Exception as exc:  # reported by the parent, never a silent hole in the table
        out.put({"error": repr(exc)})


def _redis_counters(client: Any) -> tuple[float, int, int]:
    """(CPU s, commands, EVALSHA calls: the poller's writes plus a few reader scripts)."""
    cpu = client.info("cpu")
    stats = client.info("stats")
    evalsha = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    return (
        float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        int(stats["total_commands_processed"]),
        int(evalsha),
    )


def measure(
    url: str, namespace: str, readers: int, window_s: float, writer_pids: list[int]
) -> dict[str, Any]:
    """One window with ``readers`` reader processes following the view."""
    import redis

    from poller_lab.embedded import process_cpu_s

    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Event()
    out: Any = ctx.Queue()
    procs, readies = [], []
    for _ in range(readers):
        ready = ctx.Event()
        proc = ctx.Process(
            target=_reader_process, args=(url, namespace, ready, go, done, out), daemon=True
        )
        proc.start()
        procs.append(proc)
        readies.append(ready)
    client = redis.Redis.from_url(url, decode_responses=True)
    results: list[dict[str, Any]] = []
    hung = 0  # readers that did not exit within 10 s of the window's end
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for ready in readies:
            if not ready.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{readers} readers not ready in {READY_TIMEOUT_S:.0f} s")
        time.sleep(1.0)  # past the start-up snapshots
        writer0 = sum(process_cpu_s(p) for p in writer_pids)
        redis0, commands0, scripts0 = _redis_counters(client)
        t0 = time.monotonic()
        go.set()
        time.sleep(window_s)
        done.set()
        elapsed = time.monotonic() - t0
        redis1, commands1, scripts1 = _redis_counters(client)
        writer_cpu = sum(process_cpu_s(p) for p in writer_pids) - writer0
        for _ in procs:
            results.append(out.get(timeout=30))
    finally:
        done.set()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                hung += 1
                proc.kill()  # by pid: this process's own child
                proc.join(5)
        client.close()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"a reader failed: {errors[0]}")
    latencies = [x for r in results for x in r["latencies_ms"]]
    updates = sum(r["updates"] for r in results)
    cpu = sum(r["cpu_s"] for r in results)
    return {
        "readers": readers,
        "window_s": round(elapsed, 1),
        "redis_cpu_s_per_s": round((redis1 - redis0) / elapsed, 4),
        "redis_commands_per_s": round((commands1 - commands0) / elapsed),
        "scripts_per_s": round((scripts1 - scripts0) / elapsed),
        "poller_cpu_s_per_s": round(writer_cpu / elapsed, 3),
        "updates_per_s_per_reader": round(updates / readers / elapsed) if readers else None,
        "reader_cpu_us_per_update": round(cpu / updates * 1e6, 1) if updates else None,
        "reader_cpu_s_per_s_each": round(cpu / readers / elapsed, 4) if readers else None,
        "event_to_cache_p50_ms": round(percentile(latencies, 0.5), 2) if latencies else None,
        "event_to_cache_p99_ms": round(percentile(latencies, 0.99), 2) if latencies else None,
        "readers_hung_on_exit": hung,
    }


def bench_readers(
    url: str,
    namespace: str,
    writer_pids: list[int],
    window_s: float = 8.0,
    counts: tuple[int, ...] = READER_COUNTS,
) -> dict[str, Any]:
    """Every reader count in turn against the same running poller."""
    rows = [measure(url, namespace, n, window_s, writer_pids) for n in counts]
    result: dict[str, Any] = {"rows": rows, "cpus": os.cpu_count()}
    by = {r["readers"]: r for r in rows}
    if 1 in by and 24 in by and by[1]["redis_cpu_s_per_s"]:
        result["redis_cpu_24_over_1"] = round(
            by[24]["redis_cpu_s_per_s"] / by[1]["redis_cpu_s_per_s"], 2
        )
    return result


def format_readers(result: dict[str, Any]) -> str:
    head = (
        "readers  Redis CPU s/s  Redis cmd/s  scripts/s  poller CPU s/s  updates/s each  "
        "reader CPU us/update  event->cache p50 / p99 ms  hung on exit"
    )
    lines = [head]
    for r in result["rows"]:
        lines.append(
            f"{r['readers']:>7}  {r['redis_cpu_s_per_s']:>13}  {r['redis_commands_per_s']:>11}  "
            f"{r['scripts_per_s']:>9}  "
            f"{r['poller_cpu_s_per_s']:>14}  {r['updates_per_s_per_reader'] or '-':>14}  "
            f"{r['reader_cpu_us_per_update'] or '-':>20}  "
            f"{r['event_to_cache_p50_ms'] or '-'} / {r['event_to_cache_p99_ms'] or '-'}"
            f"  {r.get('readers_hung_on_exit', 0)}"
        )
    if "redis_cpu_24_over_1" in result:
        lines.append(f"Redis CPU, 24 readers over 1: {result['redis_cpu_24_over_1']}x")
    return "\n".join(lines)
