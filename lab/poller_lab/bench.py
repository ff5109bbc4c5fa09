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
import shutil
import signal
import statistics
import time
from collections.abc import Callable
from typing import Any

from poller_lab.bench_fleet import (
    NS,
    BenchConfig,
    Fleet,
    _gaps,
    _measure_pollers,
    percentile,
)
from poller_lab.embedded import (
    Proc,
    free_port,
    process_cpu_s,
    process_rss_mb,
    redis_for,
    start_pollers,
    wait_until,
    workdir,
)

__all__ = ["BenchConfig", "run_bench"]


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
                # keep only what the poller reads: the fair comparison (docs/performance.md)
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
            async with reader.router() as router:
                ids = router.cache.ids() or ["none"]
                n = 20000
                t = time.perf_counter()
                for i in range(n):
                    router.get(ids[i % len(ids)])
                lookup_us = (time.perf_counter() - t) / n * 1e6
            return {
                "endpoints": len(fleet.ids),
                "snapshot_p50_ms": round(percentile(latencies, 0.5), 3),
                "snapshot_p99_ms": round(percentile(latencies, 0.99), 3),
                "cached_lookup_us": round(lookup_us, 2),
            }
        finally:
            await reader.aclose()

    return asyncio.run(go())


def bench_readers_section(fleet: Fleet) -> dict[str, Any]:
    """One poller writes the fleet; reader processes follow it (bench_readers.py)."""
    from poller_lab.bench_readers import bench_readers

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


def run_bench(
    cfg: BenchConfig, redis_url: str | None = None, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run the selected sections; returns every figure (JSON-ready). ``say`` gets a line
    as each step starts (a run takes minutes: the operator sees where it is)."""
    started = time.monotonic()

    def step(what: str) -> None:
        if say is not None:
            say(f"bench [{time.monotonic() - started:6.1f}s] {what}")

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
            window = f"{cfg.endpoints} endpoints, {cfg.duration_s:g} s window"
            try:
                if "scrape" in cfg.sections:
                    step(f"scrape: one poller, {window}")
                    result["scrape"] = bench_scrape(fleet)
                if cfg.vs_prometheus:
                    step(f"prometheus: the same endpoints, {window}")
                    prom = bench_prometheus(fleet)
                    result["prometheus"] = prom
                    ours = result.get("scrape", {}).get("cpu_ms_per_scrape")
                    if ours and prom.get("cpu_ms_per_scrape"):
                        # Another round in the opposite order, so that a change in the
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
                    step(f"cluster and failover: {cfg.pollers} pollers, {window}")
                    result.update(bench_cluster_and_failover(fleet, "failover" in cfg.sections))
                if "reader" in cfg.sections:
                    step("reader: snapshot and pick latency")
                    result["reader"] = bench_reader(fleet)
                if "readers" in cfg.sections:
                    step("readers: cached readers following the update feed")
                    result["readers"] = bench_readers_section(fleet)
            finally:
                fleet.close()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    step("done")
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
        from poller_lab.bench_readers import format_readers

        lines.append(format_readers(result["readers"]))
    lines.append(f"  (took {result['elapsed_s']} s)")
    return "\n".join(lines)
