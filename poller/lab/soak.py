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

import json
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from poller.lab.embedded import (
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

__all__ = ["SoakConfig", "run_soak"]

NS = "soak"


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


@dataclass
class Tally:
    disruptions: list[tuple[str, float]] = field(default_factory=list)  # (what, recovery s)
    stale_writes: int = 0
    old_stats: int = 0
    no_ttl: int = 0
    slow_recoveries: int = 0
    held_unscheduled: int = 0
    unwritten: int = 0
    checks: int = 0
    tokens: dict[str, int] = field(default_factory=dict)


class Soak:
    def __init__(self, work: Path, cfg: SoakConfig) -> None:
        self.work, self.cfg = work, cfg
        self.rng = random.Random(cfg.seed)
        self.redis_port = free_port()
        self.redis_proc = self._start_redis()
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
        self.tally = Tally()
        self.added = 0

    # --- processes ---------------------------------------------------------------------

    def _start_redis(self) -> Proc:
        proc = start_redis_server(self.work, self.redis_port)
        wait_until(lambda: _pong(self.redis_port), 10, "redis-server")
        return proc

    def _start_poller(self, poller_id: str) -> None:
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

    # --- checks ------------------------------------------------------------------------

    def _records(self) -> dict[str, str]:
        raw = self.client.hgetall(f"{{{NS}}}:view:stats")
        return {str(k): str(v) for k, v in raw.items()}

    def check(self) -> None:
        """One pass over the view: no write accepted with an older token than one seen."""
        try:
            records = self._records()
        except redis.RedisError:
            return  # Redis is down on purpose; the recovery check covers it
        self.tally.checks += 1
        for endpoint_id, record in records.items():
            token = int(record.partition("|")[0].split(" ")[4])
            if token < self.tally.tokens.get(endpoint_id, 0):
                self.tally.stale_writes += 1
            self.tally.tokens[endpoint_id] = max(token, self.tally.tokens.get(endpoint_id, 0))

    def check_ttls(self) -> None:
        """Sampled: every stats hash has a TTL and is younger than it (3 intervals)."""
        try:
            now_s, now_us = self.client.time()
            keys = list(self.client.scan_iter(f"{{{NS}}}:stats:*", count=1000))
            sample = self.rng.sample(keys, min(50, len(keys)))
            pipe = self.client.pipeline(transaction=False)
            for key in sample:
                pipe.pttl(key)
                pipe.hmget(key, "scraped_at_ms", "interval_ms")
            replies = pipe.execute()
        except redis.RedisError:
            return
        now_ms = now_s * 1000 + now_us // 1000
        for ttl, (scraped, interval) in zip(replies[::2], replies[1::2], strict=True):
            if ttl == -1:
                self.tally.no_ttl += 1
            elif scraped and interval and now_ms - int(scraped) > 3 * int(interval) + 250:
                self.tally.old_stats += 1

    def _leases_and_jobs(self) -> set[tuple[str, str, int]]:
        """(endpoint, poller, token) of every lease a live poller holds without a job."""
        prefix = f"{{{NS}}}:lease:"
        keys = list(self.client.scan_iter(f"{prefix}*", count=1000))
        values = self.client.mget(keys) if keys else []
        jobs: dict[str, dict[str, int]] = {}
        for poller_id, proc in self.pollers.items():
            if proc.popen.poll() is not None:
                continue
            try:
                reply = http_json(f"http://127.0.0.1:{self.health[poller_id]}/v1/jobs", timeout_s=2)
            except OSError:
                continue  # starting or stopping: judged at the next check
            jobs[poller_id] = {e: int(t) for e, t in reply["jobs"].items()}
        out = set()
        for key, value in zip(keys, values, strict=True):
            if not value:
                continue
            holder, _, token = str(value).partition(" ")
            endpoint_id = str(key)[len(prefix) :]
            if holder in jobs and jobs[holder].get(endpoint_id) != int(token):
                out.add((endpoint_id, holder, int(token)))
        return out

    def check_jobs(self) -> None:
        """No lease is held without a scheduled job for longer than one pass: a lease seen
        unscheduled must be scheduled (or gone) a pass later."""
        try:
            suspects = self._leases_and_jobs()
            if suspects:
                time.sleep(1.5)  # one reconcile pass (1 s) and some
                self.tally.held_unscheduled += len(suspects & self._leases_and_jobs())
        except redis.RedisError:
            return

    def check_written(self) -> None:
        """Every healthy endpoint was written within its TTL (3 intervals)."""
        try:
            now_ms = self.redis_now_ms()
            records = self._records()
        except redis.RedisError:
            return
        ttl_ms = 3 * self.cfg.interval_s * 1000
        for endpoint_id in self.healthy_ids():
            record = records.get(endpoint_id)
            if record is None or now_ms - int(record.partition(" ")[0]) > ttl_ms + 250:
                self.tally.unwritten += 1

    def healthy_ids(self) -> list[str]:
        return [e for e in self.entries if e not in self.faulted]

    def redis_now_ms(self) -> int:
        try:
            now_s, now_us = self.client.time()
        except redis.RedisError:
            return int(time.time() * 1000)  # Redis is down: the local clock will do
        return int(now_s) * 1000 + int(now_us) // 1000

    def written_since(self, since_ms: int) -> bool:
        """Every healthy endpoint written again after ``since_ms`` (Redis clock)."""
        try:
            records = self._records()
        except redis.RedisError:
            return False
        for endpoint_id in self.healthy_ids():
            record = records.get(endpoint_id)
            if record is None or int(record.partition(" ")[0]) <= since_ms:
                return False
        return True

    def wait_recovered(self, what: str, started: float, since_ms: int) -> None:
        deadline = started + self.cfg.recovery_bound_s + 20
        while time.monotonic() < deadline:
            self.check()
            if self.written_since(since_ms):
                took = time.monotonic() - started
                self.tally.disruptions.append((what, round(took, 2)))
                if took > self.cfg.recovery_bound_s:
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
        self.redis_proc = self._start_redis()
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


def _pong(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.2).ping())
    except redis.RedisError:
        return False


def run_soak(cfg: SoakConfig, say: Callable[[str], None]) -> dict[str, Any]:
    with workdir("poller-soak-") as work:
        soak = Soak(work, cfg)
        try:
            started = time.monotonic()
            soak.wait_recovered("start", started, 0)
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
                soak.check()
                if step % 20 == 0:
                    soak.check_ttls()
                if time.monotonic() >= next_at:
                    t0, since_ms = time.monotonic(), soak.redis_now_ms()
                    what = schedule[(len(soak.tally.disruptions) - 1) % len(schedule)]()
                    soak.wait_recovered(what, t0, since_ms if "redis" not in what else 0)
                    soak.check_jobs()
                    soak.check_written()
                    say(f"{what}: recovered in {soak.tally.disruptions[-1][1]} s")
                    if soak.restart_later is not None:
                        soak._start_poller(soak.restart_later)  # rebalances back
                        soak.restart_later = None
                    next_at = time.monotonic() + cfg.every_s
                step += 1
                time.sleep(0.1)
            soak.check_jobs()
            soak.check_written()
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
