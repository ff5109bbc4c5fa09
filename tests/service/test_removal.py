"""Removing an endpoint while its scrape runs ends the scrape quietly: no ERROR record.

The job runs under APScheduler (not ``scrape_once``), because APScheduler is what logs a
job whose task ends cancelled as ``ERROR ... Error running job``. The engine's answer is
held with an event, so the removal lands while the scrape is in flight, in both orders a
real removal can take: the coordination pass drops the job first, or the scrape's fenced
write finds the lease already released (``lease lost ... holder=(none)``) first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import fakeredis
import httpx
import pytest
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, JobExecutionEvent

from poller.config import ScrapeSettings, Settings
from poller.schema.endpoint import Endpoint
from poller.service.worker import Worker
from poller.store.store import RedisStore

PAGE = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"


class HeldEngine:
    """Answers once ``release`` is set; ``asked`` is set when a request arrives."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    def factory(self, endpoint: Endpoint) -> httpx.AsyncBaseTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            self.asked.set()
            await self.release.wait()
            return httpx.Response(200, content=PAGE)

        return httpx.MockTransport(handle)


@pytest.fixture
async def running() -> AsyncIterator[tuple[Worker, HeldEngine]]:
    engine = HeldEngine()
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    settings = Settings(id="p1", scrape=ScrapeSettings(interval_s=0.5, timeout_s=0.4))
    worker = Worker(settings, RedisStore(client, "t"), transport_factory=engine.factory)
    worker.jobs.start()  # a real scheduler: jobs fire on their own
    yield worker, engine
    engine.release.set()
    await worker.jobs.stop()
    await worker.scraper.aclose()
    await client.aclose()


class _Ended(logging.Handler):
    """Resolves a future when APScheduler logs that a run failed: such a run dispatches
    no event, only its ERROR line."""

    def __init__(self, ended: asyncio.Future[object]) -> None:
        super().__init__(logging.ERROR)
        self.ended = ended

    def emit(self, record: logging.LogRecord) -> None:
        if not self.ended.done():
            self.ended.set_result(record)


@contextmanager
def job_ends(worker: Worker) -> Iterator[asyncio.Future[object]]:
    """A future resolved when the job's run ends: with APScheduler's event (success or
    exception) or with the ERROR record it logs for a run that ended cancelled."""
    ended: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    def listener(event: JobExecutionEvent) -> None:
        if not ended.done():
            ended.set_result(event)

    scheduler = worker.jobs._scheduler
    assert scheduler is not None
    scheduler.add_listener(listener, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    handler = _Ended(ended)
    executor_log = logging.getLogger("apscheduler.executors.default")
    executor_log.addHandler(handler)
    try:
        yield ended
    finally:
        executor_log.removeHandler(handler)
        scheduler.remove_listener(listener)


@pytest.mark.parametrize("first", ["pass", "write"])
async def test_removing_an_endpoint_while_it_is_scraped_logs_no_error(
    running: tuple[Worker, HeldEngine], caplog: pytest.LogCaptureFixture, first: str
) -> None:
    worker, engine = running
    store = worker.store
    await store.put_endpoint(Endpoint(id="e1", url="http://engine.test:8000"))
    await store.ensure_schema()
    await worker.step()
    assert set(worker.owned) == {"e1"}
    with job_ends(worker) as ended:
        caplog.set_level(logging.INFO)
        await asyncio.wait_for(engine.asked.wait(), 30)  # the job fired; its scrape is held
        await store.remove_endpoint("e1")
        if first == "pass":
            await worker.step()  # releases the lease and drops the job: cancels the scrape
            engine.release.set()
        else:
            # The pass released the lease (as `endpoints rm` makes it do) while the
            # scrape's write was on its way: the write is rejected first, then the pass.
            await store.client.delete("{t}:lease:e1")
            engine.release.set()
        event = await asyncio.wait_for(ended, 30)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert isinstance(event, JobExecutionEvent)
    await worker.step()
    assert event.code == EVENT_JOB_EXECUTED and event.exception is None
    assert worker.owned == {} and worker.jobs.scheduled_ids() == set()
    if first == "write":
        assert any(r.getMessage().startswith("lease lost") for r in caplog.records)
    value = worker.metrics.registry.get_sample_value
    if first == "pass":
        assert value("poller_scrapes_missed_total", {"why": "cancelled"}) == 1
    else:
        assert value("poller_write_rejections_total") == 1
