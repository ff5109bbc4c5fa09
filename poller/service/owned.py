"""One record per endpoint this poller holds a lease on: token, timing, job, scrapes.

The coordinator creates a record when Redis grants a lease and confirms it on each
renewal; the worker gives it a job (``spec``); the job runner tracks its scrapes in it.
Whoever learns that a lease is gone (a failed renewal, a release, a rejected fenced
write, a TTL without confirmation) discards the record here, and with it go the token,
the hit-rate window and the scrapes in flight: nothing else holds a copy to forget.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from poller.config import ScrapeSettings, effective_timeout_s
from poller.errors import ConfigError
from poller.schema.endpoint import Endpoint
from poller.scrape.engines import EngineMapping, mapping_for_endpoint
from poller.service.reporting import FailureLog
from poller.util.text import digits

__all__ = ["Holdings", "JobSpec", "Owned", "Window", "first_run", "job_spec"]


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything one scrape needs, fixed for the life of the job."""

    endpoint_id: str
    token: int
    endpoint: Endpoint | None  # None: the registry entry is invalid (config failure)
    mapping: EngineMapping | None
    config_error: str | None
    interval_s: float
    timeout_s: float

    @property
    def engine(self) -> str:
        return self.mapping.engine if self.mapping is not None else "unknown"


def job_spec(
    endpoint_id: str,
    token: int,
    endpoint: Endpoint | None,
    error: str | None,
    scrape: ScrapeSettings,
) -> JobSpec:
    """The job of a lease on ``endpoint_id`` under ``token``: its registry ``endpoint``
    (None: invalid, ``error`` says why) with its engine mapping, interval and timeout."""
    if endpoint is None:
        return JobSpec(endpoint_id, token, None, None, error, scrape.interval_s, scrape.timeout_s)
    mapping = None
    try:
        mapping = mapping_for_endpoint(endpoint, scrape)
    except (ConfigError, KeyError) as exc:
        error = str(exc)
    interval_s = endpoint.interval_s or scrape.interval_s
    # The Go poller's rule: a timeout at or above the interval is lowered to half of it.
    timeout_s, _ = effective_timeout_s(endpoint.timeout_s, endpoint.interval_s, scrape)
    return JobSpec(endpoint_id, token, endpoint, mapping, error, interval_s, timeout_s)


def first_run(spec: JobSpec, stats: Mapping[str, str] | None, clock_offset_ms: float) -> datetime:
    """When a new job first scrapes: at the previous owner's rhythm (its ``stats``'
    ``scraped_at_ms``, Redis clock, ``clock_offset_ms`` ahead of ours), at once and a
    little spread when overdue (a takeover), anywhere in one interval when new."""
    now = datetime.now(UTC)
    interval = spec.interval_s
    scraped_at = (stats or {}).get("scraped_at_ms", "")
    if digits(scraped_at):
        local_ms = int(scraped_at) - clock_offset_ms
        due = datetime.fromtimestamp(local_ms / 1000 + interval, UTC)
        if due > now:
            return due
        # Overdue (a takeover): scrape now, spread a little so a big handover is smooth.
        return now + timedelta(seconds=random.uniform(0, min(0.1, interval / 10)))
    return now + timedelta(seconds=random.uniform(0, interval))


class Window:
    """What a job carries from one scrape to the next while we hold the lease: the
    counters of the prefix-cache hit-rate window, the failure last reported, and the
    model names read from the engine's /v1/models (None: not asked yet this lease)."""

    __slots__ = ("prev_hits", "prev_queries", "prev_rate", "failures", "models")

    def __init__(self, seed: Mapping[str, str] | None = None) -> None:
        seed = seed or {}
        self.prev_hits = _num(seed.get("prefix_cache_hits_total"))
        self.prev_queries = _num(seed.get("prefix_cache_queries_total"))
        self.prev_rate = _num(seed.get("prefix_cache_hit_rate"))
        self.failures = FailureLog()
        self.models: tuple[str, ...] | None = None


def _num(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


@dataclass(eq=False, slots=True)
class Owned:
    """One held lease and everything that hangs off it."""

    endpoint_id: str
    token: int
    #: Monotonic time just before the call that last confirmed the lease (an acquire or
    #: a renew): the lease lives at least until this plus its TTL.
    confirmed_at: float
    #: The record of its scheduled job; None until the worker schedules one.
    spec: JobSpec | None = None
    window: Window = field(default_factory=Window)
    #: The scrapes in flight for this lease (cancelled when the record is discarded).
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class Holdings:
    """endpoint id -> ``Owned``: the leases this poller holds, and nothing else does."""

    def __init__(self) -> None:
        self._by_id: dict[str, Owned] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, endpoint_id: object) -> bool:
        return endpoint_id in self._by_id

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_id))

    def get(self, endpoint_id: str) -> Owned | None:
        return self._by_id.get(endpoint_id)

    def records(self) -> list[Owned]:
        return list(self._by_id.values())

    def tokens(self) -> dict[str, int]:
        """endpoint id -> fencing token, a copy."""
        return {e: r.token for e, r in self._by_id.items()}

    def hold(self, endpoint_id: str, token: int, confirmed_at: float) -> Owned:
        """Record a lease Redis just granted (a record left for the id is discarded)."""
        self.discard(endpoint_id)
        record = self._by_id[endpoint_id] = Owned(endpoint_id, token, confirmed_at)
        return record

    def current(self, endpoint_id: str, token: int) -> Owned | None:
        """The record of ``endpoint_id`` if we still hold it under ``token``.

        The one place a fencing token is compared: a late answer about an old token
        (the lease was lost and re-acquired meanwhile) leaves the current record alone.
        """
        record = self._by_id.get(endpoint_id)
        return record if record is not None and record.token == token else None

    def discard(self, endpoint_id: str, token: int | None = None) -> Owned | None:
        """Forget a lease (with ``token``: only if still held under it) and cancel its
        scrapes in flight, except the caller's own: their results are not ours to write."""
        record = self._by_id.get(endpoint_id) if token is None else self.current(endpoint_id, token)
        if record is None:
            return None
        del self._by_id[endpoint_id]
        me = _current_task()
        for task in record.tasks:
            if task is not me:
                task.cancel()
        return record


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop (synchronous callers in tests)
        return None
