"""Time the gateway read path (``poller.reader``) against a private redis-server.

Usage: python tests/bench/bench_reader.py [--endpoints 1000] [--json]

Fills a redis-server of its own (never the shared one) with N registered endpoints, each
with the stats hash a worker writes (``stats_fields`` of a full vLLM ``Signals``, through
``RedisStore.write_stats`` under real leases of three pollers); 5% also carry a newer
failure, 2% only a failure, 1% nothing. Then it times:

- ``StatsReader.snapshot()``: end to end, split into the EVALSHA round trip and
  ``build_view``, and again with every endpoint's ``.stats`` parsed by the caller; the
  round trip is split further into the server's Lua time (``INFO latencystats``) and the
  hiredis parse of the captured reply bytes;
- ``SyncStatsReader.snapshot()``;
- the cached mode: ``cache.get(id)`` (with and without ``.stats``) and ``cache.view()``;
- event -> cache propagation: a separate writer process calls ``write_stats`` at a steady
  rate; the time a new seq becomes visible is recorded inside this process by wrapping
  ``ViewCache.apply``/``load`` on the cache instance (no polling granularity);
- CPU per snapshot: this process (``process_time``) and redis-server (``INFO cpu``,
  ``INFO commandstats``).

Prints one table; with ``--json`` the table goes to stderr and JSON to stdout. Runs in
about a minute at most (each timed loop stops after LOOP_BUDGET_S). Timings come from
whatever machine runs it, often shared and noisy: compare runs on one machine, not
single numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import random
import socket
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests"):  # a checkout without `pip install -e .`; redisproc
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import hiredis  # noqa: E402
import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from poller.config import RedisSettings  # noqa: E402
from poller.reader import StatsReader, SyncStatsReader  # noqa: E402
from poller.reader.view import View  # noqa: E402
from poller.reader.view.decode import Held, build_view, held_after, snapshot_call  # noqa: E402
from poller.redis.connection import connect  # noqa: E402
from poller.schema.endpoint import Endpoint  # noqa: E402
from poller.schema.keys import Keys  # noqa: E402
from poller.schema.lua import lua  # noqa: E402
from poller.schema.records import json_int  # noqa: E402
from poller.schema.stats import Signals, prefix_hit_rate, stats_fields  # noqa: E402
from poller.store.store import RedisStore  # noqa: E402
from tests.support.redisproc import RedisProcess  # noqa: E402

NS = "bench"
POLLERS = ("poller-0", "poller-1", "poller-2")
# Leases and hashes must outlive the whole run (production: 2 s and 3 intervals).
LEASE_TTL_MS = 600_000
STATS_TTL_MS = 600_000
# A long interval keeps every endpoint in the state it was set up in for the whole run;
# judging a 1 s interval costs the same.
INTERVAL_MS = 60_000
SNAPSHOTS = 300
LOOP_BUDGET_S = 10.0  # per timed loop, so a busy machine cannot stretch the run past ~1 min
WARMUP = 20
LOOKUPS = 50_000
WRITE_RATE = 200  # writes/s during the propagation test
WRITE_SECONDS = 5.0
MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct")

Row = dict[str, Any]


# --- statistics ---------------------------------------------------------------------------


def pct(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def summary(name: str, seconds: list[float], target: str = "", limit_us: float = 0.0) -> Row:
    v = sorted(s * 1e6 for s in seconds)
    row: Row = {
        "name": name,
        "n": len(v),
        "p50_us": pct(v, 0.50),
        "p99_us": pct(v, 0.99),
        "max_us": v[-1],
        "mean_us": sum(v) / len(v),
    }
    if target:
        row["target"] = target
        row["ok"] = row["p99_us"] <= limit_us
    return row


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# --- data set -----------------------------------------------------------------------------


def signals(rng: random.Random) -> Signals:
    queries = rng.randint(10_000, 50_000_000)
    return Signals(
        engine="vllm",
        running=rng.randint(0, 64),
        waiting=rng.randint(0, 12),
        kv_cache_usage=round(rng.random(), 4),
        prefix_cache_hits_total=float(int(queries * rng.uniform(0.1, 0.9))),
        prefix_cache_queries_total=float(queries),
        lora_running=("sql-lora", "chat-lora")[: rng.randint(1, 2)],
        lora_waiting=("summarize-lora",),
        lora_max=4,
        models=(rng.choice(MODELS),),
    )


def fields_for(rng: random.Random) -> dict[str, str]:
    s = signals(rng)
    prev_q = (s.prefix_cache_queries_total or 0) * 0.99
    rate = prefix_hit_rate(
        s.prefix_cache_hits_total, s.prefix_cache_queries_total, None, prev_q, None
    )
    return stats_fields(
        s, prefix_cache_hit_rate=rate, scrape_ms=rng.uniform(2, 15), interval_ms=INTERVAL_MS
    )


async def populate(store: RedisStore, n: int, rng: random.Random) -> dict[str, Any]:
    """Registry, members, leases, stats and failures as pollers leave them."""
    ids = [f"vllm-{i:05d}" for i in range(n)]
    for poller in POLLERS:
        await store.heartbeat(poller, LEASE_TTL_MS)
    registry = {
        e: Endpoint(
            id=e,
            url=f"http://10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000",
            engine="vllm",
            labels={"pool": f"pool-{i % 8}", "zone": f"zone-{i % 3}"},
        )
        for i, e in enumerate(ids)
    }
    await store.replace_registry(registry)
    owners: dict[str, tuple[str, int]] = {}
    for k, poller in enumerate(POLLERS):
        mine = ids[k :: len(POLLERS)]
        for acquired in await store.acquire_leases(poller, mine, LEASE_TTL_MS):
            assert acquired.token is not None, acquired
            owners[acquired.endpoint_id] = (poller, acquired.token)
    roll = {e: rng.random() for e in ids}
    no_stats = [e for e in ids if roll[e] < 0.03]  # 2% failure only, 1% nothing
    failing = [e for e in ids if roll[e] < 0.02 or 0.03 <= roll[e] < 0.08]
    seqs: dict[str, int] = {}

    async def write(e: str) -> None:
        poller, token = owners[e]
        result = await store.write_stats(
            e, poller, token, fields_for(rng), lease_ttl_ms=LEASE_TTL_MS, stats_ttl_ms=STATS_TTL_MS
        )
        assert result.accepted, result
        seqs[e] = result.value

    async def fail(e: str) -> None:
        poller, token = owners[e]
        reason = rng.choice(("timeout", "unreachable", "http_status"))
        result = await store.write_failure(
            e,
            poller,
            token,
            reason=reason,
            detail="HTTP 503" if reason == "http_status" else "",
            lease_ttl_ms=LEASE_TTL_MS,
            failure_ttl_ms=STATS_TTL_MS,
        )
        assert result.accepted, result

    with_stats = [e for e in ids if e not in set(no_stats)]
    for chunk in range(0, len(with_stats), 100):
        await asyncio.gather(*(write(e) for e in with_stats[chunk : chunk + 100]))
    await asyncio.gather(*(fail(e) for e in failing))
    return {"ids": ids, "owners": owners, "seqs": seqs}


# --- the reply on the wire ----------------------------------------------------------------


def raw_reply(port: int, sha: str, keys: list[str], args: list[str]) -> bytes:
    """The snapshot script's reply bytes exactly as Redis sends them (RESP2)."""
    parts = [b"EVALSHA", sha.encode(), str(len(keys)).encode(), *(s.encode() for s in keys)]
    parts += [a.encode() for a in args]
    cmd = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    reader = hiredis.Reader()
    buf = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(cmd)
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            buf += chunk
            reader.feed(chunk)
            if reader.gets() is not False:
                return bytes(buf)


def hiredis_parse(data: bytes) -> None:
    reader = hiredis.Reader(encoding="utf-8")  # as redis-py with decode_responses=True
    reader.feed(data)
    reader.gets()


# --- Redis server counters ----------------------------------------------------------------


async def server_cpu(client: aioredis.Redis) -> dict[str, float]:
    info = await client.info("cpu")
    return {
        "total": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
        "main": float(info.get("used_cpu_user_main_thread", 0.0))
        + float(info.get("used_cpu_sys_main_thread", 0.0)),
    }


async def evalsha_server_stats(client: aioredis.Redis) -> dict[str, float]:
    """Server-side EVALSHA time since CONFIG RESETSTAT: mean and latency percentiles."""
    out: dict[str, float] = {}
    stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
    out["calls"] = float(stats.get("calls", 0))
    out["usec_per_call"] = float(stats.get("usec_per_call", 0.0))
    latency = (await client.info("latencystats")).get("latency_percentiles_usec_evalsha", {})
    for key, value in latency.items():  # {"p50": 1.0, "p99": ..., "p99.9": ...}
        out[f"latency_{key}_us"] = float(value)
    return out


# --- phases -------------------------------------------------------------------------------


async def repeat(step: Callable[[], Awaitable[tuple[float, ...]]]) -> list[list[float]]:
    """Up to SNAPSHOTS runs of `step` (each returns its durations), within LOOP_BUDGET_S."""
    deadline = time.monotonic() + LOOP_BUDGET_S
    runs = []
    while len(runs) < SNAPSHOTS and (len(runs) < 30 or time.monotonic() < deadline):
        runs.append(await step())
    return [list(series) for series in zip(*runs, strict=True)]


async def bench_snapshots(
    server: RedisProcess, client: aioredis.Redis, reader: StatsReader
) -> tuple[list[Row], dict[str, Any], View]:
    script = client.register_script(lua("snapshot"))
    for _ in range(WARMUP):
        view = await reader.snapshot()
    # What snapshot() does in steady state: the registry is held, so the reply leaves it
    # out; `full` is the call of a new reader, or the first after a registry change.
    held: Held | None = None
    full_keys, full_args = snapshot_call(Keys(NS))

    async def split() -> tuple[float, float]:
        nonlocal held
        keys, args = snapshot_call(Keys(NS), held)
        t0 = time.perf_counter()
        reply = await script(keys=keys, args=args)
        t1 = time.perf_counter()
        held = held_after(reply, build_view(reply, held=held))
        return t1 - t0, time.perf_counter() - t1

    async def full() -> tuple[float]:
        t0 = time.perf_counter()
        build_view(await script(keys=full_keys, args=full_args))
        return (time.perf_counter() - t0,)

    async def end_to_end() -> tuple[float]:
        t0 = time.perf_counter()
        await reader.snapshot()
        return (time.perf_counter() - t0,)

    async def with_stats() -> tuple[float, float]:
        t0 = time.perf_counter()
        view = await reader.snapshot()
        t1 = time.perf_counter()
        for e in view.endpoints.values():
            e.stats  # noqa: B018 - the lazy parse is what is timed
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    await client.config_resetstat()
    cpu0, proc0 = await server_cpu(client), time.process_time()
    [total] = await repeat(end_to_end)
    proc1, cpu1 = time.process_time(), await server_cpu(client)
    usec_per_call = (await evalsha_server_stats(client))["usec_per_call"]
    # Server-side percentiles from the very calls whose round trips are split here.
    await client.config_resetstat()
    trip, build = await repeat(split)
    server_side = await evalsha_server_stats(client)
    [whole] = await repeat(full)
    proc2 = time.process_time()
    touched, touch_only = await repeat(with_stats)
    proc3 = time.process_time()

    assert held is not None, "the bench's Redis has no epoch: every snapshot reads the registry"
    keys, args = snapshot_call(Keys(NS), held)
    data = raw_reply(server.port, script.sha, keys, args)
    full_bytes = len(raw_reply(server.port, script.sha, full_keys, full_args))
    parse = sorted(timed(lambda: hiredis_parse(data), 200))
    rest = pct(sorted(trip), 0.5) - server_side.get("latency_p50_us", 0) / 1e6 - pct(parse, 0.5)
    rows = [
        summary("snapshot() async, end to end", total, "p99 <= 5 ms", 5000),
        summary("  EVALSHA round trip (registry held)", trip),
        {
            "name": "    server Lua (latencystats; mean)",
            "n": int(server_side["calls"]),
            "p50_us": server_side.get("latency_p50_us"),
            "p99_us": server_side.get("latency_p99_us"),
            "max_us": server_side.get("latency_p99.9_us"),
            "mean_us": server_side["usec_per_call"],
            "note": "max column = p99.9",
        },
        summary("    hiredis parse of the reply bytes", parse),
        {
            "name": "    rest: socket, asyncio, redis-py",
            "n": len(trip),
            "p50_us": rest * 1e6,
            "note": "p50 trip - p50 server - p50 parse",
        },
        summary("  build_view() (Python)", build),
        summary("the same with the registry (after a change)", whole),
        summary("snapshot() + every .stats parsed", touched),
        summary("  of which the .stats parses", touch_only),
    ]
    cpu = {
        "client_process_ms_per_snapshot": (proc1 - proc0) / len(total) * 1e3,
        "client_process_ms_per_snapshot_with_stats": (proc3 - proc2) / len(touched) * 1e3,
        "redis_cpu_ms_per_snapshot_all_threads": (cpu1["total"] - cpu0["total"]) / len(total) * 1e3,
        "redis_cpu_ms_per_snapshot_main_thread": (cpu1["main"] - cpu0["main"]) / len(total) * 1e3,
        "redis_evalsha_usec_per_call": usec_per_call,
        "reply_bytes": len(data),
        "reply_bytes_with_registry": full_bytes,
    }
    return rows, cpu, view


def bench_sync(url: str) -> tuple[Row, float]:
    reader = SyncStatsReader.from_url(url, NS)
    try:
        for _ in range(WARMUP):
            reader.snapshot()
        proc0 = time.process_time()
        samples = timed(reader.snapshot, SNAPSHOTS)
        cpu_ms = (time.process_time() - proc0) / SNAPSHOTS * 1e3
    finally:
        reader.close()
    return summary("SyncStatsReader.snapshot()", samples, "p99 <= 5 ms", 5000), cpu_ms


def lookup_rows(cache: Any, ids: list[str], rng: random.Random) -> list[Row]:
    """Per-lookup cost: mean from batches (best of 3), p50/p99 from single timed calls."""
    wanted = [rng.choice(ids) for _ in range(LOOKUPS)]
    rows = []
    for name, fn in (
        ("cache.get(id)", cache.get),
        ("cache.get(id).stats", lambda e: cache.get(e).stats),
    ):
        batches = []
        for _ in range(3):
            t0 = time.perf_counter()
            for e in wanted:
                fn(e)
            batches.append((time.perf_counter() - t0) / len(wanted))
        single = []
        for e in wanted[:20_000]:
            t0 = time.perf_counter()
            fn(e)
            single.append(time.perf_counter() - t0)
        row = summary(name, single, "p99 <= 5 us", 5)
        row["mean_us"] = min(batches) * 1e6
        row["note"] = f"mean over {len(wanted)} lookups, best of 3 batches"
        rows.append(row)
    view_times = timed(cache.view, 100)
    rows.append(summary("cache.view() (all N)", view_times))
    return rows


# --- propagation --------------------------------------------------------------------------


def _writer_process(conn: Any, url: str, plan: list[tuple[str, str, int, dict[str, str]]]) -> None:
    """In a process of its own, as a poller is: write `plan` at WRITE_RATE per second."""

    async def run() -> list[tuple[str, int, float, float]]:
        store = RedisStore(connect(RedisSettings(url=url, namespace=NS)), NS)
        out = []
        start = time.perf_counter() + 0.1
        try:
            for i, (e, poller, token, fields) in enumerate(plan):
                delay = start + i / WRITE_RATE - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
                result = await store.write_stats(
                    e, poller, token, fields, lease_ttl_ms=LEASE_TTL_MS, stats_ttl_ms=STATS_TTL_MS
                )
                out.append((e, result.value if result.accepted else -1, t0, time.perf_counter()))
        finally:
            await store.close()
        return out

    conn.send(asyncio.run(run()))
    conn.close()


@contextmanager
def watch_seqs(cache: Any) -> Iterator[dict[str, list[tuple[int, float]]]]:
    """Record (seq, time) whenever an endpoint's seq changes in the cache, by wrapping
    this cache instance's load/set_stats/apply_records (library code untouched)."""
    seen: dict[str, list[tuple[int, float]]] = defaultdict(list)
    load = cache.load
    set_stats, apply_records = cache.set_stats, cache.apply_records

    def wrapped_set_stats(endpoint_id: str, record: str) -> None:
        set_stats(endpoint_id, record)  # an update applied without a read
        seq = json_int(record, "seq") or 0
        if not seen[endpoint_id] or seen[endpoint_id][-1][0] != seq:
            seen[endpoint_id].append((seq, time.perf_counter()))

    def wrapped_apply_records(endpoint_id: str, reply: Any) -> None:
        apply_records(endpoint_id, reply)  # a read-back after a gap
        entry = cache.get(endpoint_id)
        if entry is not None:
            note(endpoint_id, entry, time.perf_counter())

    def note(e: str, entry: Any, now: float) -> None:
        stats = entry.stats  # a hash (events) or a view record (snapshots): parse either
        seq = stats.seq if stats is not None else 0
        if not seen[e] or seen[e][-1][0] != seq:
            seen[e].append((seq, now))

    def wrapped_load(view: View) -> None:
        load(view)
        now = time.perf_counter()
        for e, v in view.endpoints.items():
            note(e, v, now)

    cache.load = wrapped_load
    cache.set_stats, cache.apply_records = wrapped_set_stats, wrapped_apply_records
    try:
        yield seen
    finally:
        cache.load = load
        cache.set_stats, cache.apply_records = set_stats, apply_records


async def bench_propagation(
    url: str, cache: Any, data: dict[str, Any], rng: random.Random
) -> tuple[list[Row], dict[str, Any]]:
    seqs: dict[str, int] = dict(data["seqs"])
    plan = []
    for _ in range(int(WRITE_RATE * WRITE_SECONDS)):
        e = rng.choice(data["ids"])
        plan.append((e, *data["owners"][e], fields_for(rng)))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_writer_process, args=(child, url, plan), daemon=True)
    with watch_seqs(cache) as seen:
        proc.start()
        try:
            deadline = time.monotonic() + WRITE_SECONDS + 30
            while not parent.poll():
                if time.monotonic() > deadline or not proc.is_alive() and not parent.poll():
                    raise RuntimeError("writer process died or hung")
                await asyncio.sleep(0.05)
            writes = parent.recv()
            await asyncio.sleep(0.5)  # let the last events through
        finally:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    latencies, write_trips, missed, rejected = [], [], 0, 0
    for e, seq, t0, t1 in writes:
        if seq < 0:
            rejected += 1
            continue
        seqs[e] = seq
        write_trips.append(t1 - t0)
        when = next((t for s, t in seen.get(e, ()) if s >= seq), None)
        if when is None:
            missed += 1
        else:
            latencies.append(when - t0)
    stale = sum(1 for e, s in seqs.items() if (v := cache.get(e)) and v.stats and v.stats.seq != s)
    rows = [
        summary("event -> cache (write start to seq seen)", latencies, "p99 <= 50 ms", 50_000),
        summary("  write_stats round trip (writer process)", write_trips),
    ]
    info = {
        "writes": len(writes),
        "rate_per_s": WRITE_RATE,
        "seconds": WRITE_SECONDS,
        "missed": missed,
        "rejected": rejected,
        "cache_seq_mismatches_after": stale,
        "method": "t0 in the writer process just before write_stats; seen = when the "
        "cache stored the seq (load/set_stats/apply_records wrapped on the instance, "
        "no polling)",
    }
    return rows, info


# --- report -------------------------------------------------------------------------------


def fmt_us(us: float | None) -> str:
    if us is None or math.isnan(us):
        return "-"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.2f} us" if us < 10 else f"{us:.0f} us"


def miss_note(rows: list[dict[str, Any]], loadavg: str, cores: int) -> list[str]:
    """What a MISS means here: the targets are timings for a quiet core, so on a machine
    busy with other work (a load average above its cores) a miss is the machine's."""
    missed = [row["name"].strip() for row in rows if row.get("ok") is False]
    if not missed:
        return []
    load = float(loadavg.split()[0])
    said = f"MISS ({', '.join(missed)}): the targets are timings on a quiet core; "
    if load > cores:
        said += (
            f"this machine was busy (load average {load:.2f} on {cores} usable cores, "
            "this bench included): the machine missed them, not the reader; run it again "
            "on a quiet machine"
        )
    else:
        said += (
            f"the machine was not busy (load average {load:.2f} on {cores} usable cores): "
            "worth a look; compare with a run of main on this machine"
        )
    return ["", said]


def table(result: dict[str, Any]) -> str:
    m, d, cpu, prop = result["machine"], result["dataset"], result["cpu"], result["propagation"]
    lines = [
        f"llmgw-poller reader bench: {d['endpoints']} endpoints "
        f"({', '.join(f'{v} {k}' for k, v in d['states'].items())}), "
        f"{d['stats_fields']} stats fields/hash, snapshot reply {d['reply_kb']:.0f} KB "
        f"({d['reply_kb_with_registry']:.0f} KB with the registry)",
        f"machine: {m['cores']} cores ({m['usable_cores']} usable), loadavg {m['loadavg']}, "
        f"Python {m['python']}, redis-py {m['redis_py']} + hiredis {m['hiredis']}, "
        f"redis-server {m['redis_server']}",
        "NOTE: a shared, noisy machine (redis-server, this process and the writer share "
        "the cores): compare runs, not single numbers.",
        "",
        f"{'what':<44} {'n':>6} {'p50':>9} {'p99':>9} {'max':>9} {'mean':>9}  target",
    ]
    for row in result["rows"]:
        verdict = ""
        if "target" in row:
            verdict = row["target"] + ("" if "ok" not in row else "  OK" if row["ok"] else "  MISS")
        lines.append(
            f"{row['name']:<44} {row['n']:>6} {fmt_us(row.get('p50_us')):>9} "
            f"{fmt_us(row.get('p99_us')):>9} {fmt_us(row.get('max_us')):>9} "
            f"{fmt_us(row.get('mean_us')):>9}  {verdict}".rstrip()
        )
    lines += miss_note(result["rows"], m["loadavg"], m["usable_cores"])
    lines += [
        "",
        "CPU per snapshot: client process_time "
        f"{cpu['client_process_ms_per_snapshot']:.2f} ms "
        f"({cpu['client_process_ms_per_snapshot_with_stats']:.2f} ms with every .stats), "
        f"SyncStatsReader {cpu['client_process_ms_per_snapshot_sync']:.2f} ms; redis-server "
        f"{cpu['redis_cpu_ms_per_snapshot_all_threads']:.2f} ms all threads / "
        f"{cpu['redis_cpu_ms_per_snapshot_main_thread']:.2f} ms main thread (INFO cpu), "
        f"EVALSHA usec_per_call {cpu['redis_evalsha_usec_per_call']:.0f} (INFO commandstats)",
        f"propagation: {prop['writes']} writes at {prop['rate_per_s']}/s for "
        f"{prop['seconds']:.0f} s from another process, {prop['missed']} never seen, "
        f"{prop['rejected']} rejected, {prop['cache_seq_mismatches_after']} cache/Redis seq "
        f"mismatches after; {prop['method']}",
        "server Lua row: INFO latencystats percentiles (max column = p99.9), mean = "
        "commandstats usec_per_call; lookups: p50/p99 from single timed calls (timer "
        "overhead ~0.1 us included), mean from 50k-lookup batches",
    ]
    return "\n".join(lines)


async def run(n: int, server: RedisProcess) -> dict[str, Any]:
    rng = random.Random(42)
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    store = RedisStore(client, NS)
    reader = StatsReader(connect(RedisSettings(url=server.url, namespace=NS)), NS)
    try:
        data = await populate(store, n, rng)
        rows, cpu, view = await bench_snapshots(server, client, reader)
        sync_row, cpu["client_process_ms_per_snapshot_sync"] = bench_sync(server.url)
        rows.append(sync_row)
        async with reader.router() as router:
            cache = router.cache
            assert cache.healthy and len(cache.ids()) == n
            rows += lookup_rows(cache, data["ids"], rng)
            prop_rows, prop = await bench_propagation(server.url, cache, data, rng)
            rows += prop_rows
        info = await client.info("server")
        field_counts = Counter(
            len(e.stats.to_dict()) for e in view.endpoints.values() if e.stats is not None
        )
        return {
            "machine": {
                "cores": os.cpu_count(),
                "usable_cores": len(os.sched_getaffinity(0)),
                "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                "python": platform.python_version(),
                "redis_py": redis.__version__,
                "hiredis": hiredis.__version__,
                "redis_server": info["redis_version"],
                "noisy_shared_machine": True,
            },
            "dataset": {
                "endpoints": n,
                "states": view.counts(),
                "stats_fields": field_counts.most_common(1)[0][0],
                "reply_kb": cpu["reply_bytes"] / 1024,
                "reply_kb_with_registry": cpu["reply_bytes_with_registry"] / 1024,
            },
            "rows": rows,
            "cpu": cpu,
            "propagation": prop,
        }
    finally:
        await reader.aclose()
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--json", action="store_true", help="JSON on stdout, table on stderr")
    args = parser.parse_args(argv)
    gc.collect()
    server = RedisProcess().start()
    try:
        result = asyncio.run(run(args.endpoints, server))
    finally:
        server.cleanup()
    if args.json:
        print(table(result), file=sys.stderr)
        print(json.dumps(result, indent=2, default=str))
    else:
        print(table(result))
    return 0  # a missed target is a finding, not an error


if __name__ == "__main__":
    sys.exit(main())
