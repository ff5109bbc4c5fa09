"""The soak's invariant checks: they read Redis directly (and each poller's ``/v1/jobs``)
and count violations of what the product promises (``soak.py`` lists them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from random import Random

import redis

from poller.config import CoordinationSettings, ScrapeSettings, default_timeout_s
from poller.redis.clock import server_ms
from poller.redis.errors import REDIS_ERRORS
from poller.service.ttl import stats_ttl_ms
from poller_lab.embedded import Proc, http_json

__all__ = ["Checker", "Tally"]

NS = "soak"


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


class Checker:
    """The checks of one soak; ``tally`` holds what they counted."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        interval_s: float,
        rng: Random,
        pollers: Mapping[str, Proc],
        health: Mapping[str, int],
        healthy_ids: Callable[[], list[str]],
    ) -> None:
        self.client = client
        self.interval_s = interval_s
        self.rng = rng
        self.pollers = pollers  # the soak's own dicts: restarts show up here
        self.health = health
        self.healthy_ids = healthy_ids
        self.tally = Tally()

    def _records(self) -> dict[str, str]:
        raw = self.client.hgetall(f"{{{NS}}}:view:stats")
        return {str(k): str(v) for k, v in raw.items()}

    def check(self) -> None:
        """One pass over the view: no write accepted with an older token than one seen."""
        try:
            records = self._records()
        except REDIS_ERRORS:
            return  # Redis is down on purpose; the recovery check covers it
        self.tally.checks += 1
        for endpoint_id, record in records.items():
            token = int(record.partition("|")[0].split(" ")[4])
            if token < self.tally.tokens.get(endpoint_id, 0):
                self.tally.stale_writes += 1
            self.tally.tokens[endpoint_id] = max(token, self.tally.tokens.get(endpoint_id, 0))

    def check_ttls(self) -> None:
        """Sampled: every stats hash has a TTL and is younger than it (the TTL the
        pollers set: 3 intervals, at least a takeover; service/ttl.py)."""
        try:
            now_ms = server_ms(self.client.time())
            keys = list(self.client.scan_iter(f"{{{NS}}}:stats:*", count=1000))
            sample = self.rng.sample(keys, min(50, len(keys)))
            pipe = self.client.pipeline(transaction=False)
            for key in sample:
                pipe.pttl(key)
                pipe.hmget(key, "scraped_at_ms", "interval_ms")
            replies = pipe.execute()
        except REDIS_ERRORS:
            return
        for ttl, (scraped, interval) in zip(replies[::2], replies[1::2], strict=True):
            if ttl == -1:
                self.tally.no_ttl += 1
            elif scraped and interval and now_ms - int(scraped) > _ttl_ms(int(interval)) + 250:
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
        except REDIS_ERRORS:
            return

    def check_written(self) -> None:
        """Every healthy endpoint was written within the last 3 intervals (tighter than
        its stats TTL, which is at least a takeover: ``_ttl_ms``)."""
        try:
            now_ms = self.redis_now_ms()
            records = self._records()
        except REDIS_ERRORS:
            return
        bound_ms = 3 * self.interval_s * 1000
        for endpoint_id in self.healthy_ids():
            record = records.get(endpoint_id)
            if record is None or now_ms - int(record.partition(" ")[0]) > bound_ms + 250:
                self.tally.unwritten += 1

    def redis_now_ms(self) -> int:
        try:
            return server_ms(self.client.time())
        except REDIS_ERRORS:
            return int(time.time() * 1000)  # Redis is down: the local clock will do

    def written_since(self, since_ms: int) -> bool:
        """Every healthy endpoint written again after ``since_ms`` (Redis clock)."""
        try:
            records = self._records()
        except REDIS_ERRORS:
            return False
        for endpoint_id in self.healthy_ids():
            record = records.get(endpoint_id)
            if record is None or int(record.partition(" ")[0]) <= since_ms:
                return False
        return True


def _ttl_ms(interval_ms: int) -> int:
    """The stats TTL of the soak's pollers (default settings but the interval)."""
    interval_s = interval_ms / 1000
    ttl_intervals = ScrapeSettings.model_fields["stats_ttl_intervals"].default
    coordination = CoordinationSettings()
    return stats_ttl_ms(interval_s, default_timeout_s(interval_s), coordination, ttl_intervals)
