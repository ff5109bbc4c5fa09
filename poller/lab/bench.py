"""``poller bench``: size a deployment on this machine, with real processes on loopback.

Sections (each bounded in time, every process stopped by pid at the end):

- scrape: one ``poller run`` against N simulated vLLM endpoints (61 KB pages): poller CPU
  per 1,000 scrapes, endpoints one core sustains at the interval, p99 lateness, RSS,
  Redis CPU per 1,000 scrapes; with ``--vs-prometheus``, Prometheus scraping the same
  endpoints at the same interval in the same run.
- cluster: P pollers, the same endpoints: duplicates per endpoint-interval, ownership
  balance, Redis CPU per 1,000 scrapes.
- failover: SIGKILL one poller (time until its endpoints are written again), then SIGTERM
  another (intervals missed across the handover).
- reader: snapshot latency and cached lookup cost against that view.
- readers (only when asked for): one poller, then 0, 1, 8 and 24 cached reader processes:
  Redis CPU and commands per second, reader CPU per update, event-to-cache latency
  (``bench_readers.py``).

The poller is pinned to core 0 and the simulator and Redis to core 1 when there are two.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from poller.lab.embedded import (
    Proc,
    free_port,
    http_json,
    http_text,
    process_cpu_s,
    process_rss_mb,
    redis_for,
    start_pollers,
    start_sim,
    wait_until,
    workdir,
)

__all__ = ["BenchConfig", "run_bench"]

NS = "bench"

#: Simulator arguments for each ``BenchConfig.page``.
PAGES: dict[str, tuple[str, ...]] = {
    "61k": (),
    "200k": ("--dp", "4", "--lora", ",".join(f"adapter-{i}" for i in range(8))),
}


@dataclass(frozen=True)
class BenchConfig:
    endpoints: int = 200
    pollers: int = 3
    interval_s: float = 1.0
    duration_s: float = 20.0
    vs_prometheus: bool = False
    sections: tuple[str, ...] = ("scrape", "cluster", "failover", "reader")
    #: The vLLM page the engines serve: "61k" (one engine, the bundled page) or "200k"
    #: (data-parallel 4 with 8 LoRA adapters: every family, histograms included, four
    #: times over, ~186 KB).
    page: str = "61k"

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(endpoints=30, pollers=3, duration_s=4.0)


class Fleet:
    """Redis + simulator shared by the sections."""

    def __init__(self, work: Path, cfg: BenchConfig, redis_url: str, redis_proc: Proc | None):
        self.work = work
        self.cfg = cfg
        self.redis_url = redis_url
        self.redis_proc = redis_proc
        self.client = redis.Redis.from_url(redis_url, decode_responses=True)
        self.sim, self.admin, registry = start_sim(
            work, cfg.endpoints, "vllm", extra=PAGES[cfg.page]
        )
        self.registry_file = registry
        self.ids = [e["id"] for e in json.loads(registry.read_text())]
        asyncio.run(sync_registry(redis_url, NS, registry))

    def close(self) -> None:
        self.sim.stop()
        self.client.close()

    def hits(self) -> tuple[dict[str, int], dict[str, list[float]]]:
        answer = http_json(f"{self.admin}/admin/hits")
        return answer["hits"], answer["times"]

    def reset_hits(self) -> None:
        http_json(f"{self.admin}/admin/hits/reset", {})

    def redis_cpu_s(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def fresh_count(self) -> int:
        now_s, now_us = self.client.time()
        now_ms = now_s * 1000 + now_us // 1000
        pipe = self.client.pipeline(transaction=False)
        for e in self.ids:
            pipe.hget(f"{{{NS}}}:stats:{e}", "scraped_at_ms")
        values = pipe.execute()
        return sum(1 for v in values if v and now_ms - int(v) < 2500 * self.cfg.interval_s)

    def owners(self) -> dict[str, str]:
        pipe = self.client.pipeline(transaction=False)
        for e in self.ids:
            pipe.get(f"{{{NS}}}:lease:{e}")
        return {e: v.split(" ")[0] for e, v in zip(self.ids, pipe.execute(), strict=True) if v}

    def clear_view(self) -> None:
        keys = [
            k
            for pattern in ("stats", "failure", "lease")
            for k in self.client.scan_iter(f"{{{NS}}}:{pattern}:*", count=1000)
        ]
        if keys:
            self.client.delete(*keys)
        self.client.delete(f"{{{NS}}}:members")


async def sync_registry(redis_url: str, namespace: str, path: Path) -> None:
    from poller.config import RedisSettings
    from poller.redis.store import RedisStore
    from poller.registry import endpoints_from_file

    store = RedisStore.from_settings(RedisSettings(url=redis_url, namespace=namespace))
    try:
        await store.ensure_schema()
        await store.replace_registry(endpoints_from_file(path))
    finally:
        await store.close()


def _p(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _hist_quantile(metrics_text: str, name: str, q: float) -> float:
    """Upper bound of the bucket holding quantile q of a Prometheus histogram."""
    buckets: list[tuple[float, float]] = []
    for line in metrics_text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((math.inf if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return math.nan
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return math.inf


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def _wait_fresh(fleet: Fleet, timeout_s: float) -> None:
    wait_until(
        lambda: fleet.fresh_count() == len(fleet.ids), timeout_s, "every endpoint fresh", 0.2
    )


def _measure_pollers(
    fleet: Fleet, procs: list[tuple[Proc, int]], window_s: float
) -> dict[str, Any]:
    cfg = fleet.cfg
    _wait_fresh(fleet, 30 + len(fleet.ids) / 50)
    time.sleep(min(2.0, cfg.interval_s * 2))
    fleet.reset_hits()
    cpu0 = {p.pid: process_cpu_s(p.pid) for p, _ in procs}
    redis0 = fleet.redis_cpu_s()
    t0 = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - t0
    cpu = sum(process_cpu_s(p.pid) - cpu0[p.pid] for p, _ in procs)
    redis_cpu = fleet.redis_cpu_s() - redis0
    hits, times = fleet.hits()
    scrapes = sum(hits.values())
    expected = len(fleet.ids) * elapsed / cfg.interval_s
    duplicates = sum(1 for t in times.values() for g in _gaps(t) if g < cfg.interval_s / 2)
    late = [
        _hist_quantile(
            http_text(f"http://127.0.0.1:{port}/metrics"), "poller_scheduler_lateness_seconds", 0.99
        )
        for _, port in procs
    ]
    return {
        "window_s": round(elapsed, 1),
        "scrapes": scrapes,
        "scrapes_expected": round(expected),
        "scrape_ratio": round(scrapes / expected, 3) if expected else None,
        "cpu_ms_per_scrape": round(cpu / scrapes * 1000, 3) if scrapes else None,
        "cpu_s_per_1000_scrapes": round(cpu / scrapes * 1000, 3) if scrapes else None,
        "redis_cpu_s_per_1000_scrapes": round(redis_cpu / scrapes * 1000, 4) if scrapes else None,
        "duplicates_per_endpoint_interval": round(duplicates / expected, 5) if expected else None,
        "p99_lateness_s_le": max(late) if late else None,
        "rss_mb": round(max(process_rss_mb(p.pid) for p, _ in procs), 1),
    }


def bench_scrape(fleet: Fleet) -> dict[str, Any]:
    cfg = fleet.cfg
    fleet.clear_view()
    procs = start_pollers(
        fleet.work, fleet.redis_url, NS, ["scrape-0"], interval_s=cfg.interval_s, cpu=0
    )
    try:
        result = _measure_pollers(fleet, procs, cfg.duration_s)
    finally:
        for p, _ in procs:
            p.stop()
    per = result["cpu_ms_per_scrape"]
    result["endpoints_per_core"] = int(1000 * cfg.interval_s / per) if per else None
    return result


def bench_prometheus(fleet: Fleet) -> dict[str, Any]:
    binary = shutil.which("prometheus")
    if binary is None:
        return {"skipped": "no prometheus binary on PATH (Debian: apt-get install prometheus)"}
    cfg = fleet.cfg
    targets = [
        e["url"].removeprefix("http://") for e in json.loads(fleet.registry_file.read_text())
    ]
    # Path-style endpoints share host:port; Prometheus needs one job per path prefix.
    jobs = []
    for i, (endpoint_id, target) in enumerate(zip(fleet.ids, targets, strict=True)):
        host, _, prefix = target.partition("/")
        jobs.append(
            {
                "job_name": f"e{i}",
                "scrape_interval": f"{int(cfg.interval_s * 1000)}ms",
                "scrape_timeout": f"{int(cfg.interval_s * 800)}ms",
                "metrics_path": f"/{prefix}/metrics",
                "static_configs": [{"targets": [host]}],
                # keep only what the poller reads: the fair comparison (PERFORMANCE.md)
                "metric_relabel_configs": [
                    {
                        "source_labels": ["__name__"],
                        "action": "keep",
                        "regex": "vllm:(num_requests_running|num_requests_waiting|"
                        "kv_cache_usage_perc|prefix_cache_.*_total|"
                        "lora_requests_info)",
                    }
                ],
            }
        )
        del endpoint_id
    config = fleet.work / "prometheus.yml"
    config.write_text(json.dumps({"global": {}, "scrape_configs": jobs}))
    port = free_port()
    proc = Proc(
        "prometheus",
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={fleet.work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        fleet.work / "prometheus.log",
        cpu=0,
    )
    try:
        time.sleep(3 + 2 * cfg.interval_s)
        fleet.reset_hits()
        cpu0, t0 = process_cpu_s(proc.pid), time.monotonic()
        time.sleep(cfg.duration_s)
        elapsed, cpu = time.monotonic() - t0, process_cpu_s(proc.pid) - cpu0
        scrapes = sum(fleet.hits()[0].values())
        expected = round(len(fleet.ids) * elapsed / cfg.interval_s)
        return {
            "scrapes": scrapes,
            "scrapes_expected": expected,
            "scrapes_ratio": round(scrapes / expected, 3) if expected else None,
            "cpu_ms_per_scrape": round(cpu / scrapes * 1000, 3) if scrapes else None,
            "cpu_s_per_1000_scrapes": round(cpu / scrapes * 1000, 3) if scrapes else None,
            "rss_mb": round(process_rss_mb(proc.pid), 1),
        }
    finally:
        proc.stop()


def bench_cluster_and_failover(fleet: Fleet, failover: bool) -> dict[str, Any]:
    cfg = fleet.cfg
    fleet.clear_view()
    ids = [f"poller-{i}" for i in range(cfg.pollers)]
    procs = start_pollers(fleet.work, fleet.redis_url, NS, ids, interval_s=cfg.interval_s)
    out: dict[str, Any] = {}
    try:
        out["cluster"] = _measure_pollers(fleet, procs, cfg.duration_s)
        owned: dict[str, int] = {}
        for owner in fleet.owners().values():
            owned[owner] = owned.get(owner, 0) + 1
        mean = len(fleet.ids) / cfg.pollers
        out["cluster"]["pollers"] = cfg.pollers
        out["cluster"]["max_over_mean_ownership"] = round(max(owned.values()) / mean, 3)
        if failover and cfg.pollers >= 3:
            out["failover"] = _failover(fleet, procs, ids)
    finally:
        for p, _ in procs:
            p.stop()
    return out


def _failover(fleet: Fleet, procs: list[tuple[Proc, int]], ids: list[str]) -> dict[str, Any]:
    cfg = fleet.cfg
    owners = fleet.owners()
    victims = [e for e, o in owners.items() if o == ids[0]]
    t0 = time.time()
    procs[0][0].signal(signal.SIGKILL)
    rewritten: dict[str, float] = {}

    def done() -> bool:
        pipe = fleet.client.pipeline(transaction=False)
        for e in victims:
            pipe.hmget(f"{{{NS}}}:stats:{e}", "poller", "scraped_at_ms")
        for e, (poller, at) in zip(victims, pipe.execute(), strict=True):
            if e not in rewritten and poller and poller != ids[0] and int(at) > t0 * 1000:
                rewritten[e] = int(at) / 1000 - t0
        return len(rewritten) == len(victims)

    wait_until(done, 15, "takeover after SIGKILL", 0.02)
    time.sleep(2 * cfg.interval_s)
    owners = fleet.owners()
    leaving = [e for e, o in owners.items() if o == ids[1]]
    fleet.reset_hits()
    time.sleep(2 * cfg.interval_s)
    procs[1][0].signal(signal.SIGTERM)
    exit_code = procs[1][0].popen.wait(15)
    time.sleep(3 * cfg.interval_s)
    _, times = fleet.hits()
    missed = sum(
        max(0, round(g / cfg.interval_s) - 1)
        for e in leaving
        for g in _gaps(times[e])
        if g > 1.5 * cfg.interval_s
    )
    doubled = sum(1 for e in leaving for g in _gaps(times[e]) if g < cfg.interval_s / 2)
    values = list(rewritten.values())
    return {
        "sigkill_endpoints": len(victims),
        "sigkill_rewritten_max_s": round(max(values), 2) if values else None,
        "sigkill_rewritten_p50_s": round(statistics.median(values), 2) if values else None,
        "sigterm_endpoints": len(leaving),
        "sigterm_exit_code": exit_code,
        "sigterm_missed_intervals": missed,
        "sigterm_doubled_intervals": doubled,
    }


def bench_reader(fleet: Fleet) -> dict[str, Any]:
    from poller.reader.reader import StatsReader

    async def go() -> dict[str, Any]:
        reader = StatsReader.from_url(fleet.redis_url, NS)
        try:
            latencies = []
            for _ in range(200):
                t = time.perf_counter()
                await reader.snapshot()
                latencies.append((time.perf_counter() - t) * 1000)
            async with reader.cached() as cache:
                ids = cache.ids() or ["none"]
                n = 20000
                t = time.perf_counter()
                for i in range(n):
                    cache.get(ids[i % len(ids)])
                lookup_us = (time.perf_counter() - t) / n * 1e6
            return {
                "endpoints": len(fleet.ids),
                "snapshot_p50_ms": round(_p(latencies, 0.5), 3),
                "snapshot_p99_ms": round(_p(latencies, 0.99), 3),
                "cached_lookup_us": round(lookup_us, 2),
            }
        finally:
            await reader.aclose()

    return asyncio.run(go())


def bench_readers_section(fleet: Fleet) -> dict[str, Any]:
    """One poller writes the fleet; reader processes follow it (bench_readers.py)."""
    from poller.lab.bench_readers import bench_readers

    cfg = fleet.cfg
    fleet.clear_view()
    procs = start_pollers(
        fleet.work, fleet.redis_url, NS, ["readers-0"], interval_s=cfg.interval_s, cpu=0
    )
    try:
        # A loaded machine may not keep every endpoint fresh: wait for most of them, and
        # measure anyway after the wait (scripts/s says how much the poller kept up).
        try:
            wait_until(
                lambda: fleet.fresh_count() >= 0.9 * len(fleet.ids),
                30 + len(fleet.ids) / 50,
                "most endpoints fresh",
                0.5,
            )
        except TimeoutError:
            pass
        fresh = fleet.fresh_count() / max(1, len(fleet.ids))
        result = bench_readers(fleet.redis_url, NS, [p.pid for p, _ in procs], cfg.duration_s)
        return result | {"fresh_at_start": round(fresh, 3)}
    finally:
        for p, _ in procs:
            p.stop()


def run_bench(cfg: BenchConfig, redis_url: str | None = None) -> dict[str, Any]:
    """Run the selected sections; returns every figure (JSON-ready)."""
    started = time.monotonic()
    result: dict[str, Any] = {
        "config": {
            "endpoints": cfg.endpoints,
            "pollers": cfg.pollers,
            "interval_s": cfg.interval_s,
            "duration_s": cfg.duration_s,
            "page": cfg.page,
        },
    }
    with workdir("poller-bench-") as work:
        with redis_for(work, redis_url) as (url, proc):
            fleet = Fleet(work, cfg, url, proc)
            try:
                if "scrape" in cfg.sections:
                    result["scrape"] = bench_scrape(fleet)
                if cfg.vs_prometheus:
                    prom = bench_prometheus(fleet)
                    result["prometheus"] = prom
                    ours = result.get("scrape", {}).get("cpu_ms_per_scrape")
                    if ours and prom.get("cpu_ms_per_scrape"):
                        # A second round in the opposite order, so that a change in the
                        # machine's load during the run does not favour either side.
                        again = bench_prometheus(fleet)
                        ours2 = bench_scrape(fleet).get("cpu_ms_per_scrape")
                        rounds = [(ours, prom["cpu_ms_per_scrape"])]
                        if ours2 and again.get("cpu_ms_per_scrape"):
                            rounds.append((ours2, again["cpu_ms_per_scrape"]))
                        prom["rounds_ms_ours_prometheus"] = rounds
                        prom["ours_over_prometheus"] = round(
                            sum(o for o, _ in rounds) / sum(q for _, q in rounds), 3
                        )
                if "cluster" in cfg.sections or "failover" in cfg.sections:
                    result.update(bench_cluster_and_failover(fleet, "failover" in cfg.sections))
                if "reader" in cfg.sections:
                    result["reader"] = bench_reader(fleet)
                if "readers" in cfg.sections:
                    result["readers"] = bench_readers_section(fleet)
            finally:
                fleet.close()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    return result


ROWS = [
    ("scrape", "cpu_ms_per_scrape", "poller CPU ms per scrape"),
    ("scrape", "cpu_s_per_1000_scrapes", "poller CPU s per 1,000 scrapes"),
    ("scrape", "endpoints_per_core", "endpoints per core at the interval"),
    ("scrape", "scrape_ratio", "scrapes done / expected"),
    ("scrape", "p99_lateness_s_le", "p99 scheduler lateness (s, bucket bound)"),
    ("scrape", "rss_mb", "poller RSS (MB)"),
    ("scrape", "redis_cpu_s_per_1000_scrapes", "Redis CPU s per 1,000 scrapes"),
    ("prometheus", "cpu_ms_per_scrape", "Prometheus CPU ms per scrape"),
    ("prometheus", "cpu_s_per_1000_scrapes", "Prometheus CPU s per 1,000 scrapes"),
    ("prometheus", "scrapes_ratio", "Prometheus scrapes done / expected"),
    ("prometheus", "rss_mb", "Prometheus RSS (MB)"),
    ("prometheus", "rounds_ms_ours_prometheus", "rounds: (ours, Prometheus) ms per scrape"),
    ("prometheus", "ours_over_prometheus", "ours / Prometheus CPU per scrape"),
    ("cluster", "duplicates_per_endpoint_interval", "duplicates per endpoint-interval"),
    ("cluster", "max_over_mean_ownership", "max/mean endpoints owned"),
    ("cluster", "cpu_s_per_1000_scrapes", "cluster CPU s per 1,000 scrapes"),
    ("cluster", "redis_cpu_s_per_1000_scrapes", "cluster Redis CPU s per 1,000 scrapes"),
    ("failover", "sigkill_rewritten_max_s", "SIGKILL: rewritten after, max (s)"),
    ("failover", "sigkill_rewritten_p50_s", "SIGKILL: rewritten after, p50 (s)"),
    ("failover", "sigterm_missed_intervals", "SIGTERM: intervals missed"),
    ("failover", "sigterm_doubled_intervals", "SIGTERM: intervals doubled"),
    ("reader", "snapshot_p50_ms", "reader snapshot p50 (ms)"),
    ("reader", "snapshot_p99_ms", "reader snapshot p99 (ms)"),
    ("reader", "cached_lookup_us", "reader cached lookup (us)"),
]


PAGE_LABELS = {"61k": "61 KB", "200k": "~186 KB dp=4 + 8 LoRA"}


def format_table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"poller bench: {c['endpoints']} simulated vLLM endpoints "
        f"({PAGE_LABELS.get(c.get('page', '61k'), c.get('page'))} pages), "
        f"{c['pollers']} pollers, interval {c['interval_s']} s, windows {c['duration_s']} s"
    ]
    width = max(len(label) for _, _, label in ROWS)
    for section, key, label in ROWS:
        if section in result and key in result[section]:
            lines.append(f"  {label:<{width}}  {result[section][key]}")
    if "skipped" in result.get("prometheus", {}):
        lines.append(f"  prometheus: {result['prometheus']['skipped']}")
    if "readers" in result:
        from poller.lab.bench_readers import format_readers

        lines.append(format_readers(result["readers"]))
    lines.append(f"  (took {result['elapsed_s']} s)")
    return "\n".join(lines)
