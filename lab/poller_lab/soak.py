"""``poller soak``: hours of trouble in minutes, with the invariants checked all along.

3 pollers (with ``--endpoints-file``) scrape N simulated endpoints while a schedule of
disruptions runs: SIGKILL and SIGTERM of pollers (restarted after a pause), an empty
Redis restart, engine faults switched on and off, and endpoint churn through the file.
A checker reads Redis directly every 100 ms and counts violations of what the product
promises:

- a fenced write accepted with an older token than one already seen for the endpoint
  (a stale write; tokens restart only with an empty Redis, which resets the tracking);
- a stats hash older than its TTL, or without a TTL;
- an endpoint not fresh again within ``recovery_bound_s`` after a disruption;
- after every recovery and at the end: a lease held by a live poller that still has no
  scheduled job (same token) one pass later (each poller's ``/v1/jobs``), and a healthy
  endpoint whose last write is older than its TTL.

It also counts duplicate scrapes at the simulator (two hits of one endpoint closer than
half an interval) and reports poller RSS at the start and the end. Everything it starts
is stopped by pid; it ends by itself after ``duration_s``.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from poller.redis.errors import REDIS_ERRORS
from poller_lab.embedded import (
    Proc,
    free_port,
    http_json,
    process_rss_mb,
    start_pollers,
    start_redis_server,
    start_sim,
    wait_until,
    workdir,
)
from poller_lab.soak_checks import NS, Checker

__all__ = ["SoakConfig", "run_soak"]


@dataclass(frozen=True)
class SoakConfig:
    endpoints: int = 300
    pollers: int = 3
    duration_s: float = 600.0
    interval_s: float = 1.0
    #: Seconds between disruptions.
    every_s: float = 20.0
    recovery_bound_s: float = 10.0
    seed: int = 1


class Soak:
    def __init__(self, work: Path, cfg: SoakConfig) -> None:
        self.work, self.cfg = work, cfg
        self.rng = random.Random(cfg.seed)
        self.redis_port = free_port()
        self._start_redis()
        self.url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.client = redis.Redis(
            port=self.redis_port, decode_responses=True, socket_timeout=2, socket_connect_timeout=2
        )
        self.sim, self.admin, registry = start_sim(work, cfg.endpoints, "vllm,sglang,tgi,vllm-v0")
        self.entries: dict[str, dict[str, Any]] = {
            e["id"]: e for e in json.loads(registry.read_text())
        }
        self.file = work / "endpoints.json"
        self._write_file()
        self.ids = [f"soak-{i}" for i in range(cfg.pollers)]
        self.pollers: dict[str, Proc] = {}
        self.health: dict[str, int] = {}
        for poller_id in self.ids:
            self._start_poller(poller_id)
        self.faulted: set[str] = set()
        self.restart_later: str | None = None
        self.checks = Checker(
            self.client,
            interval_s=cfg.interval_s,
            rng=self.rng,
            pollers=self.pollers,
            health=self.health,
            healthy_ids=self.healthy_ids,
        )
        self.tally = self.checks.tally
        self.added = 0

    # --- processes ---------------------------------------------------------------------

    def _start_redis(self) -> None:
        with _signals_held():  # started is kept: close() stops it, whenever Ctrl-C comes
            self.redis_proc = start_redis_server(self.work, self.redis_port)
        wait_until(lambda: _pong(self.redis_port), 10, "redis-server")

    def _start_poller(self, poller_id: str) -> None:
        with _signals_held():  # started is kept: close() stops it, whenever Ctrl-C comes
            [(proc, port)] = start_pollers(
                self.work,
                self.url,
                NS,
                [poller_id],
                interval_s=self.cfg.interval_s,
                extra=("--endpoints-file", str(self.file)),
            )
            self.pollers[poller_id] = proc
            self.health[poller_id] = port

    def _write_file(self) -> None:
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"endpoints": list(self.entries.values())}))
        tmp.replace(self.file)  # atomic: pollers never read half a file

    def close(self) -> None:
        for proc in self.pollers.values():
            proc.stop()
        self.sim.stop()
        self.redis_proc.stop()
        self.client.close()

    def healthy_ids(self) -> list[str]:
        return [e for e in self.entries if e not in self.faulted]

    def wait_recovered(
        self, what: str, started: float, since_ms: int, *, bound_s: float | None = None
    ) -> None:
        """Wait until every healthy endpoint is written again; a recovery slower than
        ``bound_s`` (default: the configured bound) counts as a violation."""
        bound_s = self.cfg.recovery_bound_s if bound_s is None else bound_s
        deadline = started + bound_s + 20
        while time.monotonic() < deadline:
            self.checks.check()
            if self.checks.written_since(since_ms):
                took = time.monotonic() - started
                self.tally.disruptions.append((what, round(took, 2)))
                if took > bound_s:
                    self.tally.slow_recoveries += 1
                return
            time.sleep(0.1)
        self.tally.disruptions.append((what, float("inf")))
        self.tally.slow_recoveries += 1

    # --- disruptions -------------------------------------------------------------------

    def kill_poller(self, sig: int) -> str:
        """Kill (or stop) one poller; it is restarted once the others have recovered."""
        victim = self.rng.choice(self.ids)
        self.pollers[victim].signal(sig)
        self.pollers[victim].popen.wait(15)
        self.restart_later = victim
        return f"{signal.Signals(sig).name} {victim}"

    def restart_redis(self) -> str:
        self.redis_proc.stop()
        time.sleep(2)
        self._start_redis()
        self.tally.tokens.clear()  # an empty Redis starts the fence again (documented)
        return "redis restart (empty)"

    def faults(self) -> str:
        for endpoint_id in list(self.faulted):
            http_json(f"{self.admin}/admin/endpoints/{endpoint_id}/fault", {"mode": "ok"})
        self.faulted.clear()
        modes = ["http500", "slow", "hang", "garbage", "missing", "http401"]
        for endpoint_id in self.rng.sample(list(self.entries), max(1, len(self.entries) // 10)):
            body: dict[str, Any] = {"mode": self.rng.choice(modes)}
            if body["mode"] == "slow":
                body["delay_s"] = 3.0
            http_json(f"{self.admin}/admin/endpoints/{endpoint_id}/fault", body)
            self.faulted.add(endpoint_id)
        return f"faults on {len(self.faulted)} endpoints"

    def churn(self) -> str:
        removed = self.rng.sample(
            [e for e in self.entries if e not in self.faulted], min(10, len(self.entries) // 10)
        )
        for endpoint_id in removed:
            del self.entries[endpoint_id]
        new = []
        for _ in range(len(removed)):
            self.added += 1
            spec = {"id": f"churn-{self.added}", "engine": self.rng.choice(["vllm", "sglang"])}
            http_json(f"{self.admin}/admin/endpoints", spec)
            new.append(spec["id"])
        registry = {e["id"]: e for e in http_json(f"{self.admin}/admin/registry")}
        for endpoint_id in new:
            self.entries[endpoint_id] = registry[endpoint_id]
        self._write_file()
        return f"churn: -{len(removed)} +{len(new)} endpoints"


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (their handlers run then): a process
    started in it is recorded before a Ctrl-C can unwind past it. Handlers are swapped,
    not the signal mask, which the processes started would inherit."""
    got: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    old = {signum: signal.signal(signum, lambda n, _f: got.append(n)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)
        for number in got:
            handler = old[signal.Signals(number)]
            if callable(handler):
                handler(number, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(number)


def _pong(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.2).ping())
    except REDIS_ERRORS:
        return False


def run_soak(cfg: SoakConfig, say: Callable[[str], None]) -> dict[str, Any]:
    with workdir("poller-soak-") as work:
        soak = Soak(work, cfg)
        try:
            started = time.monotonic()
            # Start is not a disruption: booting the processes takes what the machine
            # gives it, so it only has to finish (within a minute), not within the bound.
            soak.wait_recovered("start", started, 0, bound_s=60.0)
            rss_start = {p: process_rss_mb(proc.pid) for p, proc in soak.pollers.items()}
            schedule: list[Callable[[], str]] = [
                lambda: soak.kill_poller(signal.SIGKILL),
                soak.faults,
                soak.churn,
                lambda: soak.kill_poller(signal.SIGTERM),
                soak.restart_redis,
                soak.faults,
            ]
            step = 0
            next_at = time.monotonic() + cfg.every_s / 2
            while time.monotonic() - started < cfg.duration_s:
                soak.checks.check()
                if step % 20 == 0:
                    soak.checks.check_ttls()
                if time.monotonic() >= next_at:
                    t0, since_ms = time.monotonic(), soak.checks.redis_now_ms()
                    what = schedule[(len(soak.tally.disruptions) - 1) % len(schedule)]()
                    soak.wait_recovered(what, t0, since_ms if "redis" not in what else 0)
                    soak.checks.check_jobs()
                    soak.checks.check_written()
                    say(f"{what}: recovered in {soak.tally.disruptions[-1][1]} s")
                    if soak.restart_later is not None:
                        soak._start_poller(soak.restart_later)  # rebalances back
                        soak.restart_later = None
                    next_at = time.monotonic() + cfg.every_s
                step += 1
                time.sleep(0.1)
            soak.checks.check_jobs()
            soak.checks.check_written()
            hits = http_json(f"{soak.admin}/admin/hits")["times"]
            duplicates = sum(
                1
                for times in hits.values()
                for a, b in zip(times, times[1:], strict=False)
                if b - a < cfg.interval_s / 2
            )
            rss_end = {p: process_rss_mb(proc.pid) for p, proc in soak.pollers.items()}
            recoveries = [t for _, t in soak.tally.disruptions[1:]]
            return {
                "config": cfg.__dict__,
                "disruptions": len(soak.tally.disruptions) - 1,
                "recovery_max_s": max(recoveries) if recoveries else None,
                "recovery_median_s": round(statistics.median(recoveries), 2)
                if recoveries
                else None,
                "slow_recoveries": soak.tally.slow_recoveries,
                "stale_writes_accepted": soak.tally.stale_writes,
                "stats_older_than_ttl": soak.tally.old_stats,
                "stats_without_ttl": soak.tally.no_ttl,
                "held_unscheduled_leases": soak.tally.held_unscheduled,
                "endpoints_unwritten_within_ttl": soak.tally.unwritten,
                "duplicate_scrapes": duplicates,
                "checks": soak.tally.checks,
                "rss_start_mb": round(statistics.mean(rss_start.values()), 1),
                "rss_end_mb": round(statistics.mean(rss_end.values()), 1),
                "events": soak.tally.disruptions,
            }
        finally:
            soak.close()


def format_summary(r: dict[str, Any]) -> str:
    rows = [
        ("disruptions survived", r["disruptions"]),
        ("max recovery (s)", r["recovery_max_s"]),
        ("median recovery (s)", r["recovery_median_s"]),
        ("recoveries over the bound", r["slow_recoveries"]),
        ("stale writes accepted", r["stale_writes_accepted"]),
        ("stats older than their TTL", r["stats_older_than_ttl"]),
        ("stats without a TTL", r["stats_without_ttl"]),
        ("leases held but unscheduled", r["held_unscheduled_leases"]),
        ("endpoints unwritten within TTL", r["endpoints_unwritten_within_ttl"]),
        ("duplicate scrapes at the engines", r["duplicate_scrapes"]),
        ("invariant checks run", r["checks"]),
        ("poller RSS start / end (MB)", f"{r['rss_start_mb']} / {r['rss_end_mb']}"),
    ]
    c = r["config"]
    head = (
        f"soak: {c['endpoints']} endpoints, {c['pollers']} pollers, {c['duration_s']:g} s, "
        f"a disruption every {c['every_s']:g} s"
    )
    width = max(len(k) for k, _ in rows)
    return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)])


def violations(r: dict[str, Any]) -> int:
    return int(
        r["slow_recoveries"]
        + r["stale_writes_accepted"]
        + r["stats_older_than_ttl"]
        + r["stats_without_ttl"]
        + r["held_unscheduled_leases"]
        + r["endpoints_unwritten_within_ttl"]
    )
