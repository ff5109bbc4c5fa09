"""What the ``poller bench`` sections share: the configuration, the fleet (Redis and the
simulator), and measuring pollers over a window (CPU, scrapes at the engines, lateness).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from poller.redis.clock import server_ms
from poller_lab.embedded import (
    Proc,
    http_json,
    http_text,
    process_cpu_s,
    process_rss_mb,
    start_sim,
    wait_until,
)

__all__ = [
    "NS",
    "PAGES",
    "BenchConfig",
    "Columns",
    "Fleet",
    "format_columns",
    "header",
    "percentile",
    "sync_registry",
]

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
        try:
            self.registry_file = registry
            self.ids = [e["id"] for e in json.loads(registry.read_text())]
            asyncio.run(sync_registry(redis_url, NS, registry))
        except BaseException:  # Redis refused or unreachable: leave no simulator behind
            self.close()
            raise

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
        now_ms = server_ms(self.client.time())
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
    from poller.config.registry_file import endpoints_from_file
    from poller.store.store import RedisStore

    store = RedisStore.from_settings(RedisSettings(url=redis_url, namespace=namespace))
    try:
        await store.ensure_schema()
        await store.replace_registry(endpoints_from_file(path))
    finally:
        await store.close()


#: A report's columns: (title, width, the row's key).
Columns = Sequence[tuple[str, int, str]]


def header(columns: Columns) -> str:
    """The titles of ``columns``, right-aligned to their widths."""
    return "  ".join(f"{title:>{width}}" for title, width, _ in columns)


def format_columns(row: Mapping[str, Any], columns: Columns) -> str:
    """One row under ``header(columns)``: floats as ``%g``, absent values as ``-``."""
    cells = []
    for _, width, key in columns:
        value = row.get(key)
        text = "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
        cells.append(f"{text:>{width}}")
    return "  ".join(cells)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (NaN when there are none)."""
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
