"""The running poller: APScheduler jobs for owned endpoints, and the coordination loop.

One ``AsyncIOScheduler`` with its private in-memory job store holds one interval job per
endpoint whose lease we hold. The coordination loop heartbeats, follows the registry
(events on ``P:events``, with a revision poll as the fallback), reconciles leases, and
adds or removes jobs. A scrape is an ordinary coroutine, ``scrape_once``, that tests call
directly; a rejected fenced write means the lease is gone and the job goes at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, EVENT_JOB_SUBMITTED
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from poller.config import Settings
from poller.errors import ConfigError, PollerError, SchemaMismatch, ScrapeError, StoreError
from poller.redis.store import RedisStore
from poller.registry import Endpoint, endpoints_from_file, validate_endpoint_id
from poller.scrape.engines import EngineMapping, mapping_for
from poller.scrape.http import Scraper, TransportFactory
from poller.service.coordinator import Coordinator, ReconcileResult
from poller.service.metrics import PollerMetrics
from poller.stats import prefix_hit_rate, stats_fields

__all__ = ["GridJitterTrigger", "Worker"]

log = logging.getLogger(__name__)


class GridJitterTrigger(IntervalTrigger):  # type: ignore[misc]
    """An interval trigger whose jitter does not drift.

    APScheduler 3.x computes the next run from the previous *jittered* run and adds a
    positive jitter again, so the period stretches by the mean jitter every run
    (1,000 jobs at 1 s with 0.1 s jitter ran 954 times a second). Here every run is
    placed on the unjittered grid ``start + k * interval`` and then moved by up to
    +-jitter, so the mean period stays exactly the interval.
    """

    def __init__(self, *, seconds: float, start_date: datetime, jitter_s: float) -> None:
        super().__init__(seconds=seconds, start_date=start_date, timezone=UTC)
        self.jitter_s = jitter_s

    def get_next_fire_time(
        self, previous_fire_time: datetime | None, now: datetime
    ) -> datetime | None:
        interval: float = self.interval_length
        start: datetime = self.start_date
        if previous_fire_time is None:
            if start > now:
                return start
            k = math.ceil((now - start).total_seconds() / interval)
        else:
            # Snap the jittered previous run back to its grid slot (|jitter| < interval/2).
            k = round((previous_fire_time - start).total_seconds() / interval) + 1
        slot: datetime = start + timedelta(seconds=k * interval)
        if self.jitter_s:
            slot += timedelta(seconds=random.uniform(-self.jitter_s, self.jitter_s))
        if previous_fire_time is not None and slot <= previous_fire_time:
            slot = previous_fire_time + timedelta(seconds=interval / 2)
        return slot


@dataclass(slots=True)
class Owned:
    """What we keep for an endpoint whose lease we hold."""

    endpoint_id: str
    token: int
    endpoint: Endpoint | None  # None: the registry entry is invalid (config failure)
    config_error: str | None = None
    mapping: EngineMapping | None = None
    interval_s: float = 1.0
    timeout_s: float = 0.8
    prev_hits: float | None = None
    prev_queries: float | None = None
    prev_rate: float | None = None
    last_reason: str | None = None
    scraped_ok: bool = field(default=False)


class Worker:
    """One poller instance. ``start()``/``stop()``; ``scrape_once(id)`` is the job body."""

    def __init__(
        self,
        settings: Settings,
        store: RedisStore | None = None,
        *,
        transport_factory: TransportFactory | None = None,
        metrics: PollerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.id = settings.id
        self.store = store or RedisStore.from_settings(settings.redis)
        self.coordinator = Coordinator(self.store, self.id, settings.coordination)
        self.scraper = Scraper(
            max_body_bytes=settings.scrape.max_body_bytes,
            http_client=settings.scrape.http_client,
            transport_factory=transport_factory,
            allowed_hosts=settings.scrape.allowed_hosts,
        )
        self.metrics = metrics or PollerMetrics()
        self.owned: dict[str, Owned] = {}
        self.registry_rev = -1
        self.entries: dict[str, Endpoint] = {}
        self.invalid: dict[str, str] = {}
        self.redis_ok = False
        self._redis_known = False  # no Redis call made yet: the first outcome is logged
        self.last_heartbeat = 0.0  # monotonic time of the last successful heartbeat
        self.clock_offset_ms = 0.0  # Redis clock minus local clock
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._scheduler: AsyncIOScheduler | None = None
        self._file_mtime: float | None = None
        self._started = False  # leftovers of an earlier run of this id released
        self._epoch = ""  # the Redis data epoch seen at the last heartbeat
        self._unusable: set[str] = set()
        #: Set when the poller must stop (another schema version in Redis).
        self.fatal: PollerError | None = None
        self.on_fatal: Callable[[], None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._scheduler = AsyncIOScheduler(timezone=UTC)
        self._scheduler.add_listener(
            self._on_scheduler_event,
            EVENT_JOB_SUBMITTED | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES,
        )
        self._scheduler.start()
        self._tasks = [
            asyncio.create_task(self._coordination_loop(), name="coordination"),
            asyncio.create_task(self._events_loop(), name="events"),
        ]

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Stop scraping, leave membership, release every lease, close connections."""
        self._stopping.set()
        self._wake.set()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            async with asyncio.timeout(timeout_s):
                released = await self.coordinator.leave()
            log.info("left: released=%d leases", released)
        except (StoreError, TimeoutError) as exc:
            log.warning("could not leave cleanly (leases will lapse by TTL): %s", exc)
        self.owned.clear()
        self.metrics.leases_held.set(0)
        await self.scraper.aclose()
        await self.store.close()

    @property
    def ready(self) -> bool:
        """Redis reachable and our membership fresh."""
        fresh_s = self.settings.coordination.member_ttl_ms / 1000
        return self.redis_ok and time.monotonic() - self.last_heartbeat < fresh_s

    # --- coordination ----------------------------------------------------------------------

    async def _coordination_loop(self) -> None:
        c = self.settings.coordination
        last_reconcile = -math.inf
        failures = 0
        while not self._stopping.is_set():
            delay = c.heartbeat_interval_ms / 1000
            try:
                # The heartbeat also claims or checks the schema version, so a Redis that
                # restarted empty is noticed (and re-claimed) within one heartbeat.
                changed = await self._heartbeat()
                due = time.monotonic() - last_reconcile >= c.reconcile_interval_ms / 1000
                if changed or due or self._wake.is_set():
                    self._wake.clear()
                    await self._sync_registry()
                    if not self._started:
                        # A stable id (pod name) may find leases its previous run left:
                        # release them so they get new tokens, fencing off that run.
                        await self.store.release_leftovers(self.id, self.scraped_ids())
                        self._started = True
                    await self._reconcile()
                    last_reconcile = time.monotonic()
                failures = 0
            except SchemaMismatch as exc:
                self.fatal = exc
                log.error("%s", exc)
                if self.on_fatal is not None:
                    self.on_fatal()
                return
            except StoreError as exc:
                failures += 1
                self._redis_state(False, str(exc))
                # Capped exponential backoff with jitter, so a fleet does not stampede.
                delay = min(5.0, delay * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0)
            except Exception:
                # A bug or a client library surprise must not silently end coordination
                # (leases would lapse while the process looks alive): log it and go on.
                failures += 1
                self.metrics.redis_errors.labels("unexpected").inc()
                log.exception("coordination step failed; retrying")
                delay = min(5.0, delay * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            except TimeoutError:
                pass

    def _redis_state(self, ok: bool, detail: str = "") -> None:
        """Log once per change of Redis reachability, not once per retry."""
        if ok != self.redis_ok or not self._redis_known:
            self._redis_known = True
            if ok:
                log.info("redis reachable")
            else:
                log.warning("redis unreachable: %s", detail)
        self.redis_ok = ok
        self.metrics.redis_up.set(1 if ok else 0)
        if not ok:
            self.metrics.redis_errors.labels("coordination").inc()

    async def _heartbeat(self) -> bool:
        before = time.time()
        changed = await self.coordinator.heartbeat()
        if self.store.epoch != self._epoch:
            if self._epoch:
                # Redis lost everything (an empty restart): its registry revision may
                # repeat an old number, so read the registry and the file again.
                log.warning("redis lost its data (new epoch): re-reading the registry")
                self.registry_rev = -1
                self._file_mtime = None
                changed = True
            self._epoch = self.store.epoch
        now_ms = self.coordinator.redis_now_ms
        self.clock_offset_ms = now_ms - (before + time.time()) * 500
        self.last_heartbeat = time.monotonic()
        self._redis_state(True)
        self.metrics.members.set(len(self.coordinator.members))
        return changed

    async def _sync_registry(self) -> None:
        """Follow the registry; keep it equal to --endpoints-file when one is given."""
        await self._sync_file()
        rev = await self.store.registry_rev()
        if rev == self.registry_rev:
            return
        registry = await self.store.read_registry()
        self.registry_rev = registry.rev
        self.entries = {
            e: ep for e, ep in registry.endpoints.items() if (ep.engine or "") != "external"
        }
        self.invalid = {}
        for endpoint_id, error in registry.invalid.items():
            try:
                validate_endpoint_id(endpoint_id)
            except ConfigError:
                # An id that breaks keys, events or log lines cannot carry a failure
                # record: it is left alone (and shown by `poller endpoints ls`).
                if endpoint_id not in self._unusable:
                    self._unusable.add(endpoint_id)
                    log.error("registry id %r is unusable; ignoring it", endpoint_id[:100])
                continue
            self.invalid[endpoint_id] = error
        for _endpoint_id, owned in self.owned.items():
            self._configure(owned)
            self._schedule(owned, replace=True)
        if self.settings.endpoints_file and not registry.raw:
            self._file_mtime = None  # registry emptied (a Redis restart): sync again now

    async def _sync_file(self) -> None:
        path = self.settings.endpoints_file
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime
        except OSError as exc:
            log.warning("endpoints file %s unreadable: %s", path, exc.strerror)
            return
        if mtime == self._file_mtime:
            return
        try:
            wanted = endpoints_from_file(path)
        except ConfigError as exc:
            log.error("endpoints file not applied: %s", exc)
            self._file_mtime = mtime  # do not retry until it changes
            return
        rev, added, changed, removed = await self.store.replace_registry(wanted)
        self._file_mtime = mtime
        if added or changed or removed:
            log.info(
                "registry synced from %s: rev=%d added=%d changed=%d removed=%d",
                path,
                rev,
                len(added),
                len(changed),
                len(removed),
            )

    def scraped_ids(self) -> list[str]:
        return [*self.entries, *self.invalid]

    async def _reconcile(self) -> None:
        result = await self.coordinator.reconcile(self.scraped_ids())
        self.metrics.reconcile_duration.observe(result.duration_s)
        await self._apply(result)
        if result.orphaned:
            # A dead poller's leases lapse at most a lease TTL after its last renewal:
            # try again shortly instead of a whole reconcile interval later.
            asyncio.get_running_loop().call_later(0.2, self._wake.set)

    async def _apply(self, result: ReconcileResult) -> None:
        for endpoint_id in result.lost:
            await self._drop(endpoint_id, "released")
        if result.gained:
            self.metrics.leases_gained.inc(len(result.gained))
            previous = await self.store.read_stats_many(list(result.gained))
            for endpoint_id, token in result.gained.items():
                owned = Owned(endpoint_id, token, None)
                self._configure(owned)
                self._seed(owned, previous.get(endpoint_id, {}))
                self.owned[endpoint_id] = owned
                self._schedule(owned, first_run=self._first_run(owned, previous.get(endpoint_id)))
            log.info("acquired %d endpoints: %s", len(result.gained), _few(result.gained))
        self.metrics.leases_held.set(len(self.owned))

    def _configure(self, owned: Owned) -> None:
        s = self.settings.scrape
        endpoint = self.entries.get(owned.endpoint_id)
        owned.endpoint = endpoint
        owned.config_error = self.invalid.get(owned.endpoint_id)
        owned.mapping = None
        if endpoint is not None:
            try:
                owned.mapping = mapping_for(endpoint.engine or s.default_engine, endpoint.overrides)
            except (ConfigError, KeyError) as exc:
                owned.config_error = str(exc)
            owned.interval_s = endpoint.interval_s or s.interval_s
            timeout = endpoint.timeout_s or s.timeout_s
            owned.timeout_s = min(timeout, owned.interval_s * 0.8)
        else:
            owned.interval_s = s.interval_s

    @staticmethod
    def _seed(owned: Owned, stats: dict[str, str]) -> None:
        """Continue the previous owner's hit-rate window instead of starting blank."""

        def num(name: str) -> float | None:
            value = stats.get(name)
            try:
                return float(value) if value is not None else None
            except ValueError:
                return None

        owned.prev_hits = num("prefix_cache_hits_total")
        owned.prev_queries = num("prefix_cache_queries_total")
        owned.prev_rate = num("prefix_cache_hit_rate")

    def _first_run(self, owned: Owned, stats: dict[str, str] | None) -> datetime:
        """Keep the previous owner's rhythm; spread fresh endpoints over one interval."""
        now = datetime.now(UTC)
        interval = owned.interval_s
        scraped_at = (stats or {}).get("scraped_at_ms", "")
        if scraped_at.isdigit():
            local_ms = int(scraped_at) - self.clock_offset_ms
            due = datetime.fromtimestamp(local_ms / 1000 + interval, UTC)
            if due > now:
                return due
            # Overdue (a takeover): scrape now, spread a little so a big handover is smooth.
            return now + timedelta(seconds=random.uniform(0, min(0.1, interval / 10)))
        return now + timedelta(seconds=random.uniform(0, interval))

    def _schedule(
        self, owned: Owned, *, first_run: datetime | None = None, replace: bool = False
    ) -> None:
        if self._scheduler is None or self._stopping.is_set():
            return
        job = self._scheduler.get_job(owned.endpoint_id)
        if replace:
            if job is None or job.trigger.interval_length == owned.interval_s:
                return
            first_run = job.next_run_time
        trigger = GridJitterTrigger(
            seconds=owned.interval_s,
            start_date=first_run or datetime.now(UTC),
            jitter_s=min(self.settings.scrape.jitter_s, owned.interval_s / 4),
        )
        self._scheduler.add_job(
            self.scrape_once,
            trigger,
            args=[owned.endpoint_id],
            id=owned.endpoint_id,
            name=owned.endpoint_id,
            max_instances=1,
            coalesce=True,
            misfire_grace_time=max(1, math.ceil(owned.interval_s)),
            replace_existing=True,
        )

    async def _drop(self, endpoint_id: str, why: str, token: int | None = None) -> None:
        owned = self.owned.pop(endpoint_id, None)
        if token is None and owned is not None:
            token = owned.token  # never forget a lease re-acquired under a newer token
        self.coordinator.forget(endpoint_id, token)
        if self._scheduler is not None and self._scheduler.get_job(endpoint_id) is not None:
            self._scheduler.remove_job(endpoint_id)
        await self.scraper.discard(endpoint_id)
        if owned is not None:
            log.debug("dropped endpoint=%s why=%s", endpoint_id, why)
        self.metrics.leases_held.set(len(self.owned))

    def _on_scheduler_event(self, event: Any) -> None:
        if event.code == EVENT_JOB_SUBMITTED:
            planned = event.scheduled_run_times[-1]
            self.metrics.lateness.observe(max(0.0, (datetime.now(UTC) - planned).total_seconds()))
        elif event.code == EVENT_JOB_MISSED:
            self.metrics.missed.labels("misfire").inc()
        else:
            self.metrics.missed.labels("still_running").inc()

    async def _events_loop(self) -> None:
        """Wake the coordination loop on registry changes and released leases."""
        failures = 0
        while not self._stopping.is_set():
            try:
                async with self.store.subscribe() as pubsub:
                    failures = 0
                    self._wake.set()  # we may have missed events while disconnected
                    while not self._stopping.is_set():
                        message = await pubsub.get_message(timeout=1.0)
                        if message is None:
                            continue
                        kind, _, _ = str(message["data"]).partition(" ")
                        if kind in ("endpoints", "released"):
                            self._wake.set()
            except (StoreError, OSError, ConnectionError) as exc:
                failures += 1
                log.debug("event subscription lost: %s", exc)
            except Exception as exc:  # redis-py raises its own errors from get_message
                failures += 1
                log.debug("event subscription lost: %r", exc)
            await asyncio.sleep(min(5.0, 0.1 * 2**failures) * random.uniform(0.5, 1.0))

    # --- one scrape ------------------------------------------------------------------------

    async def scrape_once(self, endpoint_id: str) -> None:
        """Fetch, parse and write one endpoint: the job body (tests call it directly)."""
        owned = self.owned.get(endpoint_id)
        if owned is None or not self.ready:
            return  # no lease, or no Redis to write to (or a stuck one): spare the engine
        engine = owned.mapping.engine if owned.mapping else "unknown"
        started = time.perf_counter()
        try:
            if owned.config_error is not None or owned.endpoint is None or owned.mapping is None:
                raise ScrapeError(owned.config_error or "no registry entry", reason="config")
            fetched = await self.scraper.fetch(
                owned.endpoint, owned.mapping.metrics_path, owned.timeout_s
            )
            signals = owned.mapping.read(fetched.body, fetched.content_type)
        except ScrapeError as exc:
            self.metrics.scrapes.labels(engine, exc.reason).inc()
            await self._write_failure(owned, exc)
            return
        elapsed = time.perf_counter() - started
        self.metrics.scrapes.labels(engine, "ok").inc()
        self.metrics.scrape_duration.observe(elapsed)
        rate = prefix_hit_rate(
            signals.prefix_cache_hits_total,
            signals.prefix_cache_queries_total,
            owned.prev_hits,
            owned.prev_queries,
            owned.prev_rate,
        )
        if rate is None:
            rate = signals.prefix_cache_hit_rate
        fields = stats_fields(
            signals,
            prefix_cache_hit_rate=rate,
            scrape_ms=elapsed * 1000,
            interval_ms=round(owned.interval_s * 1000),
        )
        try:
            result = await self.store.write_stats(
                endpoint_id,
                self.id,
                owned.token,
                fields,
                lease_ttl_ms=self.settings.coordination.lease_ttl_ms,
                stats_ttl_ms=self._ttl_ms(owned),
            )
        except StoreError as exc:
            self.metrics.redis_errors.labels("write_stats").inc()
            log.debug("write failed endpoint=%s: %s", endpoint_id, exc)
            return
        if not result.accepted:
            await self._lease_lost(owned, result.holder)
            return
        owned.prev_hits = signals.prefix_cache_hits_total
        owned.prev_queries = signals.prefix_cache_queries_total
        owned.prev_rate = rate
        if owned.last_reason is not None:
            log.info("endpoint recovered: endpoint=%s after=%s", endpoint_id, owned.last_reason)
            owned.last_reason = None

    def _ttl_ms(self, owned: Owned) -> int:
        return round(owned.interval_s * self.settings.scrape.stats_ttl_intervals * 1000)

    async def _write_failure(self, owned: Owned, exc: ScrapeError) -> None:
        self._log_failure(owned, exc)
        try:
            result = await self.store.write_failure(
                owned.endpoint_id,
                self.id,
                owned.token,
                reason=exc.reason,
                detail=exc.detail,
                missing=getattr(exc, "missing", ()),
                lease_ttl_ms=self.settings.coordination.lease_ttl_ms,
                failure_ttl_ms=self._ttl_ms(owned),
            )
        except StoreError as store_exc:
            self.metrics.redis_errors.labels("write_failure").inc()
            log.debug("write failed endpoint=%s: %s", owned.endpoint_id, store_exc)
            return
        if not result.accepted:
            await self._lease_lost(owned, result.holder)

    def _log_failure(self, owned: Owned, exc: ScrapeError) -> None:
        """Once per change of reason; contract violations are WARNINGs (routing is blind)."""
        if exc.reason == owned.last_reason:
            log.debug(
                "scrape failed endpoint=%s reason=%s detail=%s",
                owned.endpoint_id,
                exc.reason,
                exc.detail,
            )
            return
        owned.last_reason = exc.reason
        level = logging.WARNING if exc.reason in ("contract", "config", "auth") else logging.INFO
        log.log(
            level,
            "scrape failed endpoint=%s reason=%s detail=%s",
            owned.endpoint_id,
            exc.reason,
            exc.detail,
        )

    async def _lease_lost(self, owned: Owned, holder: str) -> None:
        self.metrics.write_rejections.inc()
        if self.owned.get(owned.endpoint_id) is not owned:
            # A write with an old token came back rejected after the lease was lost and
            # re-acquired under a new token: the new ownership stands.
            return
        self.metrics.lease_losses.inc()
        log.warning("lease lost endpoint=%s holder=%s", owned.endpoint_id, holder or "(none)")
        await self._drop(owned.endpoint_id, "lease lost", owned.token)
        self._wake.set()


def _few(ids: Any, limit: int = 5) -> str:
    items = sorted(ids)
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return " ".join(items[:limit]) + more
