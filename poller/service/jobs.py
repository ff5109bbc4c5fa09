"""APScheduler jobs, one per held lease (``Owned`` in owned.py), and the scrape each runs.

A job's record (``JobSpec``: endpoint, mapping, token, interval, timeout) never changes:
a change replaces the job, a scrape in flight finishes with the record it started with,
and its fenced write decides whether it still counts. A rejected write discards the
lease's record here (cancelling its other scrapes), unschedules its job and wakes the
worker; ``stop()`` cancels every scrape and waits for them before clients close.

The stats' model names come from names.py; the trigger that places the runs is
trigger.py's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, EVENT_JOB_SUBMITTED
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from poller.config import Settings
from poller.errors import ScrapeError, StoreAuthError, StoreError
from poller.schema.stats import prefix_hit_rate, stats_fields
from poller.scrape.http.client import Scraper
from poller.service.metrics import PollerMetrics, Surprises
from poller.service.missed import MissedRuns, quiet_apscheduler
from poller.service.names import ModelNames
from poller.service.owned import Holdings, JobSpec, Owned, Window
from poller.service.trigger import GridJitterTrigger
from poller.service.ttl import stats_ttl_ms
from poller.store.store import RedisStore, WriteResult
from poller.util.logs import Tally, count

__all__ = ["JobRunner"]

log = logging.getLogger(__name__)


class JobRunner:
    """The scheduler and its jobs; ``scrape_once(spec)`` is the job body."""

    def __init__(
        self,
        settings: Settings,
        store: RedisStore,
        scraper: Scraper,
        metrics: PollerMetrics,
        surprises: Surprises,
        *,
        ready: Callable[[], bool],
        holdings: Holdings | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.scraper = scraper
        self.metrics = metrics
        self.surprises = surprises
        self.holdings = holdings if holdings is not None else Holdings()
        self._ready = ready
        self._wake = wake
        self._scheduler: AsyncIOScheduler | None = None
        self._stopping = False
        self._refusal_logged = False
        self.names = ModelNames(scraper, surprises)
        self._background: set[asyncio.Task[None]] = set()
        # Label children resolved once, not per scrape: (engine, result) -> counter child.
        self._scrape_counters: dict[tuple[str, str], Any] = {}
        self.missed = MissedRuns(metrics)
        # Said once per pass (``say``): a Redis back from a hang rejects many writes at once.
        self._lost = Tally(
            log, logging.WARNING, "lease lost at a fenced write: %(endpoints)s", detail="holders"
        )
        self._lateness_observe = metrics.lateness.observe

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._scheduler is not None

    def start(self, *, paused: bool = False) -> None:
        """Start the scheduler. ``paused``: jobs are kept but never fire (tests drive
        scrapes with ``scrape_once``)."""
        quiet_apscheduler()
        self._scheduler = AsyncIOScheduler(timezone=UTC)
        self._scheduler.add_listener(
            self._on_scheduler_event,
            EVENT_JOB_SUBMITTED | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES,
        )
        self._scheduler.start(paused=paused)

    async def stop(self, timeout_s: float = 3.0) -> None:
        """No new runs; let the scrapes in flight finish, cancelling those still running
        after ``timeout_s`` (the records stay: the worker releases their leases next). The
        engine has been asked already: its answer, written under the lease still held,
        gives the next owner the rhythm (cancelled, the next owner would find the previous
        scrape's time and ask again at once)."""
        self._stopping = True
        if self._scheduler is not None:
            # Paused, not shut down: APScheduler's asyncio executor cancels the runs in
            # flight on shutdown, the very scrapes we wait for here.
            self._scheduler.pause()
        tasks = [t for r in self.holdings.records() for t in r.tasks]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=timeout_s)
                n = count(len(pending), "scrape")
                log.warning("%s did not finish within %.1f s", n, timeout_s)
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
        await asyncio.gather(*self._background, return_exceptions=True)

    # --- what runs ---------------------------------------------------------------------

    @property
    def specs(self) -> dict[str, JobSpec]:
        """endpoint id -> the record of its scheduled job."""
        return {r.endpoint_id: r.spec for r in self.holdings.records() if r.spec is not None}

    def scheduled_ids(self) -> set[str]:
        """Ids of the jobs in APScheduler's job store (what really runs)."""
        if self._scheduler is None:
            return set()
        return {job.id for job in self._scheduler.get_jobs()}

    def add(
        self, record: Owned, spec: JobSpec, first_run: datetime, seed: Mapping[str, str] | None
    ) -> None:
        """Schedule the job of a lease we just got (``seed``: the previous owner's stats)."""
        record.spec = spec
        record.window = Window(seed)
        self._schedule(spec, first_run)

    def replace(self, record: Owned, spec: JobSpec) -> None:
        """A changed entry under the same lease: a new job on the old job's rhythm."""
        old, record.spec = record.spec, spec
        if old is None or old.engine != spec.engine or _target(old) != _target(spec):
            # Another engine's (or model's) counters and names: its hit-rate window and
            # its failures start over, and /v1/models is asked again.
            record.window = Window()
        job = None if self._scheduler is None else self._scheduler.get_job(spec.endpoint_id)
        first_run = job.next_run_time if job is not None else None
        self._schedule(spec, first_run or datetime.now(UTC))

    def remove(self, endpoint_id: str) -> JobSpec | None:
        """Give up an endpoint here: discard its record (cancelling its scrapes in
        flight) and unschedule its job; returns the job's record, if it had one."""
        record = self.holdings.discard(endpoint_id)
        self.unschedule(endpoint_id, "removed")
        return None if record is None else record.spec

    def unschedule(self, endpoint_id: str, why: str) -> None:
        """Remove the job of a lease that is no longer ours (its record is gone, and
        with it its scrapes in flight), and close the endpoint's HTTP clients."""
        if self._scheduler is None or self._scheduler.get_job(endpoint_id) is None:
            return
        self._scheduler.remove_job(endpoint_id)
        log.debug("dropped", extra={"endpoint": endpoint_id, "why": why})
        # The endpoint's prepared request and any client of its own go in the background.
        task = asyncio.get_running_loop().create_task(self.scraper.discard(endpoint_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def sweep(self, why: str) -> None:
        """Unschedule every job without a record that holds it."""
        for endpoint_id in self.scheduled_ids() - self.specs.keys():
            self.unschedule(endpoint_id, why)

    def _schedule(self, spec: JobSpec, first_run: datetime) -> None:
        if self._scheduler is None or self._stopping:
            return
        trigger = GridJitterTrigger(
            seconds=spec.interval_s,
            start_date=first_run,
            jitter_s=min(self.settings.scrape.jitter_s, spec.interval_s / 4),
            tick_s=min(self.settings.scrape.tick_ms / 1000, spec.interval_s / 10),
        )
        self._scheduler.add_job(
            self.run,
            trigger,
            args=[spec],
            id=spec.endpoint_id,
            name=spec.endpoint_id,
            max_instances=1,
            coalesce=True,
            misfire_grace_time=max(1, math.ceil(spec.interval_s)),
            replace_existing=True,
        )

    def _on_scheduler_event(self, event: Any) -> None:
        if event.code == EVENT_JOB_SUBMITTED:
            # Once per run: float seconds, not a datetime subtraction and a timedelta.
            late = time.time() - event.scheduled_run_times[-1].timestamp()
            self._lateness_observe(late if late > 0.0 else 0.0)
        elif event.code == EVENT_JOB_MISSED:
            self.missed.late(event.job_id)
        else:
            self.missed.skipped(event.job_id)

    def say(self) -> None:
        """Say what happened to many endpoints since the last call, a line per kind
        (the worker calls it once per coordination pass)."""
        self.missed.say()
        self._lost.say()

    def _count_scrape(self, engine: str, result: str) -> None:
        key = (engine, result)
        child = self._scrape_counters.get(key)
        if child is None:
            child = self._scrape_counters[key] = self.metrics.scrapes.labels(engine, result)
        child.inc()

    # --- one scrape --------------------------------------------------------------------

    async def run(self, spec: JobSpec) -> None:
        """The job body as APScheduler calls it: tracked in its lease's record, so that
        discarding the record cancels it."""
        task = asyncio.current_task()
        assert task is not None
        record = self.holdings.get(spec.endpoint_id)
        if record is not None:
            record.tasks.add(task)
        try:
            await self.scrape_once(spec)
        except asyncio.CancelledError:
            # Dropped or stopping: the scrape's result would not be ours to write.
            self.missed.count("cancelled")
        except Exception as exc:
            self.surprises.report("scrape", exc)
        finally:
            if record is not None:
                record.tasks.discard(task)

    async def scrape_once(self, spec: JobSpec) -> None:
        """Fetch, map and write one endpoint with this job's record."""
        if not self._ready():
            # No Redis to write to (or a stuck one): spare the engine, count the skip.
            self.missed.count("redis_unavailable")
            return
        record = self.holdings.get(spec.endpoint_id)
        if record is None or record.spec is not spec:
            # Replaced or dropped since APScheduler submitted this run.
            self.missed.count("replaced")
            return
        window = record.window
        started = time.perf_counter()
        try:
            if spec.config_error is not None or spec.endpoint is None or spec.mapping is None:
                raise ScrapeError(spec.config_error or "no registry entry", reason="config")
            fetched = await self.scraper.fetch(
                spec.endpoint, spec.mapping.metrics_path, spec.timeout_s
            )
            max_samples = self.settings.scrape.max_samples
            if len(fetched.body) > self.settings.scrape.thread_map_bytes:
                signals = await asyncio.to_thread(
                    spec.mapping.read, fetched.body, fetched.content_type, max_samples
                )
            else:
                signals = spec.mapping.read(fetched.body, fetched.content_type, max_samples)
        except ScrapeError as exc:
            self._count_scrape(spec.engine, exc.reason)
            await self._write_failure(spec, window, exc)
            return
        elapsed = time.perf_counter() - started
        self._count_scrape(spec.engine, "ok")
        self.metrics.scrape_duration.observe(elapsed)
        signals = await self.names.add(signals, spec, window)
        rate = prefix_hit_rate(
            signals.prefix_cache_hits_total,
            signals.prefix_cache_queries_total,
            window.prev_hits,
            window.prev_queries,
            window.prev_rate,
        )
        if rate is None:
            rate = signals.prefix_cache_hit_rate
        fields = stats_fields(
            signals,
            prefix_cache_hit_rate=rate,
            scrape_ms=elapsed * 1000,
            interval_ms=round(spec.interval_s * 1000),
        )
        written = self.store.write_stats(
            spec.endpoint_id,
            self.settings.id,
            spec.token,
            fields,
            lease_ttl_ms=self.settings.coordination.lease_ttl_ms,
            stats_ttl_ms=self._ttl_ms(spec),
        )
        if not await self._fenced(spec, "write_stats", written):
            return
        window.prev_hits = signals.prefix_cache_hits_total
        window.prev_queries = signals.prefix_cache_queries_total
        window.prev_rate = rate
        window.failures.recovered(spec.endpoint_id)

    def _ttl_ms(self, spec: JobSpec) -> int:
        # Long enough that the record outlives a takeover (service/ttl.py).
        return stats_ttl_ms(
            spec.interval_s,
            spec.timeout_s,
            self.settings.coordination,
            self.settings.scrape.stats_ttl_intervals,
        )

    async def _write_failure(self, spec: JobSpec, window: Window, exc: ScrapeError) -> None:
        window.failures.failed(spec.endpoint_id, exc)
        written = self.store.write_failure(
            spec.endpoint_id,
            self.settings.id,
            spec.token,
            reason=exc.reason,
            detail=exc.detail,
            missing=getattr(exc, "missing", ()),
            lease_ttl_ms=self.settings.coordination.lease_ttl_ms,
            failure_ttl_ms=self._ttl_ms(spec),
        )
        await self._fenced(spec, "write_failure", written)

    async def _fenced(self, spec: JobSpec, what: str, write: Awaitable[WriteResult]) -> bool:
        """Await a fenced write; True when Redis accepted it. A Redis error counts the
        run as missed; a rejection means the lease is someone else's now."""
        try:
            result = await write
        except StoreError as exc:
            self.metrics.redis_errors.labels(what).inc()
            self.missed.count("write_failed")
            fields = {"endpoint": spec.endpoint_id, "why": str(exc)}
            if isinstance(exc, StoreAuthError) and not self._refusal_logged:
                # An ACL that lets the heartbeat through but not the writes (a key, the
                # update channel): every write fails the same way; say it once, loudly.
                self._refusal_logged = True
                log.error("%s failed", what, extra=fields)
            else:
                log.debug("%s failed", what, extra=fields)
            return False
        if not result.accepted:
            self._lease_lost(spec, result.holder)
            return False
        return True

    def _lease_lost(self, spec: JobSpec, holder: str) -> None:
        """A fenced write was rejected: the lease is someone else's (or gone)."""
        self.metrics.write_rejections.inc()
        if self.holdings.discard(spec.endpoint_id, spec.token) is None:
            # A late write under an old token (the lease was lost and re-acquired, or
            # the job dropped meanwhile): the current ownership stands.
            return
        self.metrics.lease_losses.inc()
        self._lost.add(spec.endpoint_id, holder)
        self.unschedule(spec.endpoint_id, "lease lost")
        self.metrics.leases_held.set(len(self.specs))
        self._wake()  # a pass now, to take what rendezvous still gives us


def _target(spec: JobSpec) -> tuple[str, str | None] | None:
    """What a job scrapes: the entry's URL and metrics path."""
    endpoint = spec.endpoint
    return None if endpoint is None else (endpoint.url, endpoint.metrics_path)
