"""The running poller: a coordination pass that converges on a desired state.

Each pass heartbeats, follows the registry, reconciles leases, and then compares what
should run (the leases Redis just confirmed, with their registry entries) with what
runs (the scheduled jobs): it starts the difference, stops the surplus and replaces the
job of every changed entry. Whatever fails in a pass, the next clean pass leaves no
lease without a job and no job without a lease (docs/architecture.md).

``step()`` runs one pass; tests drive the worker with it, without sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping

from poller.config import Settings
from poller.errors import (
    IdentityConflict,
    PollerError,
    SchemaMismatch,
    StoreAuthError,
    StoreError,
)
from poller.redis.errors import redis_call
from poller.scrape.http.client import KeyPolicy, Scraper, TransportFactory
from poller.service.coordinator import Coordinator
from poller.service.drain import Drain
from poller.service.follow import RegistryFollower
from poller.service.jobs import JobRunner
from poller.service.metrics import PollerMetrics, Surprises
from poller.service.notices import Notices
from poller.service.owned import Holdings, JobSpec, Owned, first_run, job_spec
from poller.service.redis_state import RedisState
from poller.store.namespaces import namespaces
from poller.store.store import RedisStore
from poller.util.backoff import backoff_s, member_ttl_cap_s
from poller.util.logs import count, few

__all__ = ["Worker"]

log = logging.getLogger(__name__)


class Worker:
    """One poller instance: ``start()``/``stop()``, or ``step()`` one pass at a time."""

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
        #: One record per held lease, shared by the coordinator (leases) and the jobs.
        self.holdings = Holdings()
        self.coordinator = Coordinator(self.store, self.id, settings.coordination, self.holdings)
        self.follower = RegistryFollower(settings, self.store)
        self.scraper = Scraper(
            max_body_bytes=settings.scrape.max_body_bytes,
            transport_factory=transport_factory,
            allowed_hosts=settings.scrape.allowed_hosts,
            key_policy=KeyPolicy.from_settings(settings.scrape),
        )
        self.metrics = metrics or PollerMetrics()
        self.surprises = Surprises(self.metrics)
        self.jobs = JobRunner(
            settings,
            self.store,
            self.scraper,
            self.metrics,
            self.surprises,
            ready=lambda: self.writable,
            holdings=self.holdings,
            wake=lambda: self._wake.set(),
        )
        #: Reachable, unreachable or refusing us; when a refusal stops the poller.
        self.redis = RedisState(settings.coordination.lease_ttl_ms, self.metrics.redis_up.set)
        self._broken = ""  # the unexpected error the last coordination pass ended in
        self.last_heartbeat = 0.0  # monotonic time of the last successful heartbeat
        self.clock_offset_ms = 0.0  # Redis clock minus local clock
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False  # leftovers of an earlier run of this id released
        self._epoch = ""  # the Redis data epoch seen at the last heartbeat
        self._retry_cap_s = member_ttl_cap_s(settings.coordination.member_ttl_ms)
        self.notices = Notices(self.id, settings.redis.namespace)
        self.drain = Drain(self.store, self.coordinator, self._wake.set)
        #: Set when the poller must stop (another schema version in Redis).
        self.fatal: PollerError | None = None
        self.on_fatal: Callable[[], None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self.jobs.start()
        self._tasks = [
            asyncio.create_task(self._coordination_loop(), name="coordination"),
            asyncio.create_task(self._events_loop(), name="events"),
        ]

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Stop the loops, let the scrapes in flight finish (cancelled after ``timeout_s``),
        then leave membership, release every lease and close the clients."""
        self._stopping.set()
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.jobs.stop(timeout_s)
        self.jobs.say()
        # Never joined: nothing to leave. Our id taken: the membership is the other's.
        joined = self.last_heartbeat or self.holdings
        if joined and not isinstance(self.fatal, IdentityConflict):
            try:
                async with asyncio.timeout(timeout_s):
                    released = await self.coordinator.leave()
                log.info("left the members: released %s", count(released, "lease"))
            except (StoreError, TimeoutError) as exc:
                log.warning("could not leave cleanly (leases will lapse by TTL): %s", exc)
        self.metrics.leases_held.set(0)
        await self.scraper.aclose()
        await self.store.close()

    @property
    def redis_ok(self) -> bool:
        return self.redis.ok

    @redis_ok.setter
    def redis_ok(self, ok: bool) -> None:
        self.redis.ok = ok

    @property
    def writable(self) -> bool:
        """Redis reachable and our membership fresh (and not stopped for good): the
        scrapes of the leases we hold may run and write."""
        fresh_s = self.settings.coordination.member_ttl_ms / 1000
        fresh = time.monotonic() - self.last_heartbeat < fresh_s
        return self.fatal is None and self.redis_ok and fresh

    @property
    def ready(self) -> bool:
        """``writable``, and the last whole coordination pass did not fail unexpectedly."""
        return self.writable and not self._broken

    def unready_reason(self) -> str:
        """Why the poller is not ready ("" when it is), for ``/readyz``'s body."""
        if self.fatal is not None:
            return f"stopped: {self.fatal}"
        if not self.redis_ok:
            return self.redis.problem
        if self._broken:
            return self._broken
        age_s = time.monotonic() - self.last_heartbeat
        fresh_s = self.settings.coordination.member_ttl_ms / 1000
        if age_s >= fresh_s:
            return f"heartbeat stale: last written {age_s:.1f}s ago (member TTL {fresh_s:g}s)"
        if self.draining:
            return f"draining (`poller drain {self.id} --undo` returns it to service)"
        return ""

    @property
    def draining(self) -> bool:
        """A drain of this poller is requested: it holds nothing and takes nothing."""
        return self.drain.active

    @property
    def owned(self) -> dict[str, JobSpec]:
        """endpoint id -> the record of its scheduled job."""
        return self.jobs.specs

    async def scrape_once(self, endpoint_id: str) -> None:
        """Run one scrape of an owned endpoint now, with its job's record."""
        spec = self.jobs.specs.get(endpoint_id)
        if spec is not None:
            await self.jobs.scrape_once(spec)

    # --- one pass ------------------------------------------------------------------------

    async def step(self) -> None:
        """One whole coordination pass: heartbeat, registry, leases, jobs.

        Raises StoreError (Redis failed part-way) or SchemaMismatch. Jobs whose lease could
        not be confirmed within a lease TTL are stopped even when the pass fails.
        """
        if not self.jobs.started:
            self.jobs.start(paused=True)  # driven by hand (tests): jobs never fire
        await self._pass(full=True)

    async def _pass(self, *, full: bool) -> None:
        try:
            # The heartbeat also claims or checks the schema version, so a Redis that
            # restarted empty is noticed (and re-claimed) within one heartbeat.
            changed = await self._heartbeat()
            if self.drain.asked and await self.drain.write_request():
                return  # a pass follows at once, with a heartbeat that sees it
            if full or changed:
                await self.follower.sync()
                empty = self.follower.size == 0
                await self.notices.registry(empty, lambda: namespaces(self.store.client))
                if not self._started:
                    # A stable id (pod name) may find leases its previous run left:
                    # release them so they get new tokens, fencing off that run.
                    await self.store.release_leftovers(self.id, self.follower.ids())
                    self._started = True
                result = await self.coordinator.reconcile(self.follower.ids())
                self.metrics.reconcile_duration.observe(result.duration_s)
                if result.orphaned:
                    # A dead poller's leases lapse at most a lease TTL after its last
                    # renewal: try again shortly instead of a whole reconcile later.
                    asyncio.get_running_loop().call_later(0.2, self._wake.set)
                await self._converge()
                # Every call the leases need made: a renewal, or nothing to hold (a lease
                # just acquired, or one another holds, waits for a pass that renews).
                complete = result.renewed > 0 or not (self.holdings or result.contested)
                self.redis.refusals.passed(time.monotonic(), complete=complete)
                self.redis.seen(None, time.monotonic())
        finally:
            self._expire_unconfirmed()
            self.jobs.say()

    async def _converge(self) -> None:
        """Make the jobs match the leases Redis confirmed in this pass."""
        self.jobs.sweep("lease released or lost")
        fresh: list[tuple[Owned, JobSpec]] = []
        entries, invalid = self.follower.entries, self.follower.invalid
        for record in self.holdings.records():
            endpoint_id = record.endpoint_id
            endpoint, error = entries.get(endpoint_id), invalid.get(endpoint_id)
            spec = job_spec(endpoint_id, record.token, endpoint, error, self.settings.scrape)
            if record.spec is None:
                fresh.append((record, spec))
            elif record.spec != spec:
                self.jobs.replace(record, spec)
        if fresh:
            self.metrics.leases_gained.inc(len(fresh))
            ids = [record.endpoint_id for record, _ in fresh]
            previous = await self._previous_stats(ids)
            for record, spec in fresh:
                if self.holdings.get(record.endpoint_id) is not record:
                    continue  # discarded while the stats were read
                stats = previous.get(record.endpoint_id)
                start = first_run(spec, stats, self.clock_offset_ms)
                self.jobs.add(record, spec, start, stats)
            log.info("acquired %s", count(len(ids), "endpoint"), extra={"endpoints": few(ids)})
        self.metrics.leases_held.set(len(self.jobs.specs))

    async def _previous_stats(self, endpoint_ids: list[str]) -> Mapping[str, dict[str, str]]:
        """The previous owner's stats (rhythm and hit-rate window); best effort: without
        them a job starts on a fresh rhythm, but it starts."""
        try:
            return await self.store.read_stats_many(endpoint_ids)
        except StoreError as exc:
            self.metrics.redis_errors.labels("read_stats").inc()
            log.debug("previous stats unavailable: %s", exc)
            return {}

    def _expire_unconfirmed(self) -> None:
        expired = self.coordinator.expire(time.monotonic())
        if expired:
            # One line per pass: a Redis that hung for a TTL leaves every lease unconfirmed.
            n = count(len(expired), "endpoint")
            fields = {"endpoints": few(expired)}
            log.warning("lease unconfirmed for a TTL, stopping its job: %s", n, extra=fields)
        self.jobs.sweep("lease not confirmed")
        self.metrics.leases_held.set(len(self.jobs.specs))

    async def _heartbeat(self) -> bool:
        before = time.time()
        changed = await self.coordinator.heartbeat()
        if self.coordinator.epoch != self._epoch:
            if self._epoch:
                log.warning("redis lost its data (new epoch): re-reading the registry")
                self.follower.forget()
                self.notices.forget()
                changed = True
            self._epoch = self.coordinator.epoch
        now_ms = self.coordinator.redis_now_ms
        self.clock_offset_ms = now_ms - (before + time.time()) * 500
        self.last_heartbeat = time.monotonic()
        self.redis.seen(None, self.last_heartbeat)
        self.metrics.members.set(len(self.coordinator.members))
        self.notices.drain(self.draining, len(self.holdings))
        self.metrics.draining.set(1 if self.draining else 0)
        return changed

    # --- loops -----------------------------------------------------------------------------

    async def _coordination_loop(self) -> None:
        c = self.settings.coordination
        last_full = -math.inf
        failures = 0
        while not self._stopping.is_set():
            due = time.monotonic() - last_full >= c.reconcile_interval_ms / 1000
            full = due or self._wake.is_set()
            self._wake.clear()
            if await self.attempt(full=full):
                failures += 1
                delay = backoff_s(failures, cap_s=self._retry_cap_s)
            else:
                failures = 0
                delay = c.heartbeat_interval_ms / 1000
                if full:
                    last_full = time.monotonic()
            if self.fatal is not None:
                return
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def attempt(self, *, full: bool = True) -> bool:
        """One pass as the coordination loop runs it: what fails is logged, counted and
        shown on ``/readyz``, or stops the poller (``fatal``), never raised. Returns
        whether the pass failed."""
        try:
            await self._pass(full=full)
        except SchemaMismatch as exc:
            self._fail(exc)
        except IdentityConflict as exc:
            self._drop_everything()
            self._fail(exc)
        except StoreError as exc:
            if isinstance(exc, StoreAuthError) and self.redis.refusals.fatal(exc, time.monotonic()):
                # Refused what Redis never allowed: a wrong password or user in the
                # settings, or an ACL without a command the poller uses; stop with that
                # one line rather than retry forever (service/redis_state.py).
                self._fail(exc)
                return True
            self.redis.seen(exc, time.monotonic())
            self.metrics.redis_errors.labels("coordination").inc()
        except Exception as exc:
            # A bug or a client library surprise must not silently end coordination
            # (leases would lapse while the process looks alive).
            self.surprises.report("coordination", exc)
            self._broken = f"coordination failing: {type(exc).__name__}: {exc}"[:300]
        else:
            if full:
                self._broken = ""
            return False
        return True

    def _drop_everything(self) -> None:
        """Another process holds our id: end every job and forget every lease at once,
        releasing nothing (a lease of our id may be the other's now; the rest lapse)."""
        for record in self.holdings.records():
            self.jobs.remove(record.endpoint_id)
        self.metrics.leases_held.set(0)

    def _fail(self, exc: PollerError) -> None:
        """Stop the poller for good (``serve`` exits with ``exit_status``)."""
        self.fatal = exc
        self.redis.problem = str(exc)
        log.error("%s", exc)
        if self.on_fatal is not None:
            self.on_fatal()

    @property
    def exit_status(self) -> int:
        """0, or why the poller stopped: 2 for a mistake in its settings (credentials
        Redis refused, an id another live process holds at start), 1 otherwise."""
        if self.fatal is None:
            return 0
        refused = isinstance(self.fatal, IdentityConflict) and not self.fatal.joined
        return 2 if isinstance(self.fatal, StoreAuthError) or refused else 1

    async def _events_loop(self) -> None:
        """Wake the coordination loop on registry changes and released leases."""
        failures = 0
        while not self._stopping.is_set():
            try:
                async with self.store.subscribe() as pubsub:
                    failures = 0
                    self._wake.set()  # we may have missed events while disconnected
                    while not self._stopping.is_set():
                        message = await redis_call(pubsub.get_message(timeout=1.0), "events")
                        if message is None:
                            continue
                        kind, _, _ = str(message["data"]).partition(" ")
                        if kind in ("endpoints", "released"):
                            self._wake.set()
            except StoreError as exc:
                # The coordination loop reports Redis's state; this loop only retries.
                failures += 1
                self.metrics.redis_errors.labels("events").inc()
                log.debug("event subscription lost: %s", exc)
            except Exception as exc:
                failures += 1
                self.surprises.report("events", exc)
            await asyncio.sleep(backoff_s(failures, cap_s=self._retry_cap_s))
