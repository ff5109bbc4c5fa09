"""The worker converges on a desired state (issue: six ways the view went silently wrong).

Each pass compares the leases Redis confirmed with the scheduled jobs and repairs the
difference. The invariant, after any failure in any pass and one clean pass: every lease
this poller holds in Redis has a scheduled job with the same token, and no job runs
without a lease. The tests drive the worker in process with ``Worker.step()``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import fakeredis
import httpx
import pytest

from poller.config import Settings
from poller.errors import StoreError
from poller.schema.endpoint import Endpoint
from poller.service import worker as worker_module
from poller.service.worker import Worker
from poller.store.store import RedisStore
from poller.util.backoff import backoff_s, member_ttl_cap_s
from tests.support.paths import DATA
from tests.support.procs import until

VLLM = (DATA / "vllm-v1-synthetic-61k.txt").read_bytes()
T = TypeVar("T")


class FaultyStore(RedisStore):
    """A store whose ``n``-th Redis call fails: before it is sent, or after it ran in Redis
    with its reply lost (the harder case: the effect happened, the poller cannot know)."""

    def __init__(self, client: Any, namespace: str) -> None:
        super().__init__(client, namespace)
        self.calls: list[str] = []
        self.fail_at: int | None = None
        self.mode = "before"

    async def _call(self, awaitable: Awaitable[T], what: str) -> T:
        index = len(self.calls)
        self.calls.append(what)
        if index == self.fail_at:
            if self.mode == "before":
                if inspect.iscoroutine(awaitable):
                    awaitable.close()
                else:
                    asyncio.ensure_future(awaitable).cancel()
                raise StoreError(f"injected: {what} not sent")
            await awaitable
            raise StoreError(f"injected: reply to {what} lost")
        return await super()._call(awaitable, what)


def ep(endpoint_id: str, **extra: object) -> Endpoint:
    return Endpoint.model_validate(
        {"id": endpoint_id, "url": f"http://{endpoint_id}.test", **extra}
    )


async def leases_of(store: RedisStore, poller_id: str) -> dict[str, int]:
    out = {}
    async for key in store.client.scan_iter(match=store.keys.lease("*")):
        value = await store.client.get(key)
        if value and value.split(" ")[0] == poller_id:
            out[key.rsplit(":", 1)[1]] = int(value.split(" ")[1])
    return out


async def assert_invariant(worker: Worker) -> None:
    """Every lease ours in Redis is a scheduled job with its token, and nothing more."""
    in_redis = await leases_of(worker.store, worker.id)
    scheduled = worker.jobs.scheduled_ids()
    records = {e: spec.token for e, spec in worker.jobs.specs.items()}
    assert records == in_redis, (records, in_redis)
    assert scheduled == set(in_redis)
    assert worker.coordinator.held == in_redis


@pytest.fixture
async def fake() -> AsyncIterator[Any]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    yield client
    await client.aclose()


def make_worker(
    client: Any, handler: Callable[[httpx.Request], Any] | None = None, *, lease_ttl_ms: int = 0
) -> Worker:
    """A worker on ``client``; ``lease_ttl_ms``: a lease that outlasts a slow scrape on a
    loaded machine (the default's 2 s can pass between ``step`` and a big page's write)."""
    store = FaultyStore(client, "t")

    def factory(_: Endpoint) -> httpx.AsyncBaseTransport:
        return httpx.MockTransport(handler or (lambda r: httpx.Response(200, content=VLLM)))

    settings = Settings(id="p1")
    if lease_ttl_ms:
        settings = Settings(id="p1", coordination={"lease_ttl_ms": lease_ttl_ms})
    return Worker(settings, store, transport_factory=factory)


async def close(worker: Worker) -> None:
    await worker.jobs.stop()
    await worker.scraper.aclose()


# --- 1. a lease that is never scheduled --------------------------------------------------


async def test_a_failed_read_after_acquiring_still_schedules_the_lease(fake: Any) -> None:
    worker = make_worker(fake)
    store = worker.store
    assert isinstance(store, FaultyStore)
    try:
        await store.put_endpoint(ep("e1"))
        await store.ensure_schema()
        store.calls.clear()
        store.fail_at = 5  # heartbeat, GET rev, read registry, MGET leftovers, acquire, *read*
        await worker.step()  # the previous owner's stats could not be read: start anyway
        assert store.calls[5] == "read stats"
        assert "e1" in worker.owned
        await assert_invariant(worker)
        store.fail_at = None
        for _ in range(3):
            await worker.step()
            await assert_invariant(worker)
    finally:
        await close(worker)


# --- the fault-injection sweep: every Redis call of a pass ---------------------------------


async def _scenario(client: Any) -> Worker:
    """A worker that holds e0..e9, then a pass with every kind of call: a second member
    appears (releases), e9 leaves the registry, e10..e12 arrive (acquires, stats read)."""
    worker = make_worker(client)
    store = worker.store
    await store.ensure_schema()
    for i in range(10):
        await store.put_endpoint(ep(f"e{i}"))
    await worker.step()
    await worker.step()
    assert len(worker.owned) == 10
    await store.heartbeat("p2", 60_000)
    await store.remove_endpoint("e9")
    for i in range(10, 13):
        await store.put_endpoint(ep(f"e{i}"))
    return worker


async def test_every_redis_call_of_a_pass_can_fail_and_the_next_pass_repairs() -> None:
    server = fakeredis.FakeServer()
    probe_client = fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
    probe = await _scenario(probe_client)
    assert isinstance(probe.store, FaultyStore)
    probe.store.calls.clear()
    await probe.step()
    calls = list(probe.store.calls)
    await close(probe)
    await probe_client.aclose()
    kinds = set(calls)
    assert {"heartbeat", "release leases", "renew leases", "acquire leases", "read stats"} <= kinds

    for mode in ("before", "after"):
        for index, what in enumerate(calls):
            client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
            worker = await _scenario(client)
            store = worker.store
            assert isinstance(store, FaultyStore)
            try:
                store.calls.clear()
                store.fail_at, store.mode = index, mode
                try:
                    await worker.step()
                except StoreError:
                    pass
                store.fail_at = None
                await worker.step()
                try:
                    await assert_invariant(worker)
                except AssertionError as exc:
                    raise AssertionError(f"call {index} ({what}) failed {mode}: {exc}") from None
            finally:
                await close(worker)
                await client.aclose()


# --- 2. reconfiguring under a running scrape -------------------------------------------------


async def test_a_scrape_in_flight_finishes_with_the_record_it_started_with(fake: Any) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def engine(request: httpx.Request) -> httpx.Response:
        # The request was sent to a vLLM engine: its page must be read as one, whatever
        # the entry says by the time the answer arrives.
        started.set()
        await release.wait()
        return httpx.Response(200, content=VLLM)

    worker = make_worker(fake, engine)
    try:
        await worker.store.put_endpoint(ep("e1", engine="vllm"))
        await worker.store.ensure_schema()
        await worker.step()
        old = worker.owned["e1"]
        scrape = asyncio.create_task(worker.jobs.run(old))
        await started.wait()
        # The entry switches engine (and then becomes invalid) while the scrape awaits.
        await worker.store.put_endpoint(ep("e1", engine="sglang"))
        await worker.step()
        new = worker.owned["e1"]
        assert new is not old and new.token == old.token and new.engine == "sglang"
        await worker.store.client.hset("{t}:endpoints", "e1", '{"url": 5}')
        await worker.store.client.incr("{t}:endpoints:rev")  # as a foreign writer would
        await worker.step()
        assert worker.owned["e1"].mapping is None
        release.set()
        await asyncio.wait_for(scrape, 30)
        stats = await worker.store.read_stats("e1")
        assert stats["engine"] == "vllm" and stats["running"] == "17"
        assert await worker.store.read_failure("e1") == {}
        assert worker.metrics.unexpected._metrics == {}
        await assert_invariant(worker)
    finally:
        release.set()
        await close(worker)


# --- 3. drops and shutdown cancel scrapes in flight ------------------------------------------


async def test_dropping_an_endpoint_cancels_its_scrape_in_flight(fake: Any) -> None:
    started, never = asyncio.Event(), asyncio.Event()

    async def hang(_: httpx.Request) -> httpx.Response:
        started.set()
        await never.wait()
        raise AssertionError("unreachable")

    worker = make_worker(fake, hang)
    try:
        await worker.store.put_endpoint(ep("e1"))
        await worker.store.ensure_schema()
        await worker.step()
        scrape = asyncio.create_task(worker.jobs.run(worker.owned["e1"]))
        await started.wait()
        await worker.store.remove_endpoint("e1")
        await worker.step()
        await asyncio.wait_for(scrape, 30)  # cancelled, not left hanging
        assert "e1" not in worker.owned and worker.jobs.scheduled_ids() == set()
        assert worker.metrics.missed.labels("cancelled")._value.get() == 1
    finally:
        await close(worker)


async def test_stop_awaits_the_cancelled_scrapes_before_closing_clients(fake: Any) -> None:
    started, never = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def hang(_: httpx.Request) -> httpx.Response:
        started.set()
        try:
            await never.wait()
        finally:
            order.append("scrape ended")
        raise AssertionError("unreachable")

    worker = make_worker(fake, hang)
    closing = worker.scraper.aclose

    async def traced_close() -> None:
        order.append("scraper closed")
        await closing()

    worker.scraper.aclose = traced_close  # type: ignore[method-assign]
    await worker.store.put_endpoint(ep("e1"))
    await worker.store.ensure_schema()
    await worker.step()
    scrape = asyncio.create_task(worker.jobs.run(worker.owned["e1"]))
    await started.wait()
    await worker.stop()
    assert scrape.done()
    assert order == ["scrape ended", "scraper closed"]
    assert await leases_of(worker.store, "p1") == {}


# --- 4. parsing does not block the loop -------------------------------------------------------


async def test_large_bodies_are_mapped_off_the_event_loop(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = VLLM + b"# padding\n" * (Settings().scrape.thread_map_bytes // 10)
    worker = make_worker(fake, lambda r: httpx.Response(200, content=big), lease_ttl_ms=600_000)
    try:
        await worker.store.put_endpoint(ep("e1"))
        await worker.store.ensure_schema()
        await worker.step()
        spec = worker.owned["e1"]
        assert spec.mapping is not None
        threads: list[str] = []
        read = type(spec.mapping).read

        def traced(self: Any, *args: Any) -> Any:
            threads.append(threading.current_thread().name)
            return read(self, *args)

        monkeypatch.setattr(type(spec.mapping), "read", traced)
        await worker.scrape_once("e1")
        assert threads and threads[0] != threading.main_thread().name
        assert (await worker.store.read_stats("e1"))["running"] == "17"
    finally:
        await close(worker)


async def test_a_page_with_too_many_wanted_samples_is_too_large(fake: Any) -> None:
    lines = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(20_000))
    page = lines.encode() + VLLM
    worker = make_worker(fake, lambda r: httpx.Response(200, content=page), lease_ttl_ms=600_000)
    try:
        await worker.store.put_endpoint(ep("e1"))
        await worker.store.ensure_schema()
        await worker.step()
        await worker.scrape_once("e1")
        failure = await worker.store.read_failure("e1")
        assert failure["reason"] == "too_large"
        assert "more than 10000 samples" in failure["detail"]
    finally:
        await close(worker)


# --- 5. backoff bounded by the TTLs ------------------------------------------------------------


def test_backoff_never_exceeds_a_third_of_the_member_ttl() -> None:
    cap = member_ttl_cap_s(2000)
    waits = [backoff_s(n, cap_s=cap) for n in range(1, 60) for _ in range(20)]
    assert max(waits) <= cap and min(waits) > 0
    assert max(waits) > cap * 0.5  # it does grow to the cap


async def test_the_coordination_loop_backs_off_within_the_member_ttl(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(fake)
    store = worker.store
    assert isinstance(store, FaultyStore)
    waits: list[float] = []
    done = asyncio.Event()

    def recording(failures: int, **kwargs: float) -> float:
        waits.append(backoff_s(failures, **kwargs))
        if len(waits) >= 12:
            done.set()
        return 0.001

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreError("Redis unreachable during heartbeat: injected")

    monkeypatch.setattr(worker_module, "backoff_s", recording)
    monkeypatch.setattr(store, "heartbeat", down)
    await worker.start()
    try:
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await worker.stop(timeout_s=0.5)
    ttl_third = worker.settings.coordination.member_ttl_ms / 3000
    assert max(waits) <= ttl_third


# --- 6. nothing silenced -----------------------------------------------------------------------


async def test_skipped_scrapes_are_counted_with_their_cause(fake: Any) -> None:
    worker = make_worker(fake)
    try:
        await worker.store.put_endpoint(ep("e1"))
        await worker.store.ensure_schema()
        await worker.step()
        worker.redis_ok = False  # Redis went away after the last heartbeat
        await worker.scrape_once("e1")
        assert worker.metrics.missed.labels("redis_unavailable")._value.get() == 1
        assert await worker.store.read_stats("e1") == {}
    finally:
        await close(worker)


async def test_unexpected_errors_in_the_events_loop_are_warned_once_and_counted(
    fake: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker = make_worker(fake)
    monkeypatch.setattr(worker_module, "backoff_s", lambda failures, **kw: 0.001)
    attempts = 0
    subscribed = asyncio.Event()
    real_subscribe = worker.store.subscribe

    def flaky_subscribe() -> Any:
        nonlocal attempts
        attempts += 1
        if attempts <= 3:
            raise ValueError("a library surprise")
        subscribed.set()
        return real_subscribe()

    monkeypatch.setattr(worker.store, "subscribe", flaky_subscribe)
    await worker.store.ensure_schema()
    with caplog.at_level(logging.DEBUG, logger="poller.service.metrics"):
        await worker.start()
        try:
            await asyncio.wait_for(subscribed.wait(), 30)
        finally:
            await worker.stop(timeout_s=0.5)
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and r.name.endswith(".metrics")
    ]
    assert len(warnings) == 1 and "ValueError in events" in warnings[0].getMessage()
    assert worker.metrics.unexpected.labels("events", "ValueError")._value.get() == 3


async def test_a_coordination_pass_that_keeps_failing_unexpectedly_is_not_ready(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The heartbeat still beats, but no lease is renewed: /readyz must not say ready.
    worker = make_worker(fake)
    monkeypatch.setattr(worker_module, "backoff_s", lambda failures, **kw: 0.01)
    broken = True
    real_reconcile = worker.coordinator.reconcile

    async def reconcile(endpoint_ids: Any) -> Any:
        if broken:
            raise ValueError("a library surprise")
        return await real_reconcile(endpoint_ids)

    monkeypatch.setattr(worker.coordinator, "reconcile", reconcile)
    await worker.store.ensure_schema()
    await worker.start()
    try:
        failed = worker.metrics.unexpected.labels("coordination", "ValueError")._value.get
        await until(lambda: failed() >= 2, 30, "two failed passes", interval_s=0.01)
        assert not worker.ready
        assert worker.unready_reason() == "coordination failing: ValueError: a library surprise"
        assert worker.writable  # the scrapes of leases still confirmed go on
        broken = False
        await until(lambda: worker.ready, 30, "ready once a pass succeeds", interval_s=0.01)
        assert worker.unready_reason() == ""
    finally:
        await worker.stop(timeout_s=0.5)
