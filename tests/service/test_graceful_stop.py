"""A graceful stop lets the scrapes in flight finish before the leases go.

The engine has answered (or is answering) a scrape when SIGTERM comes: cancelling it would
leave the previous scrape's time in Redis, and the next owner, keeping that rhythm, would
ask the engine again at once: two scrapes in one interval.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import fakeredis
import httpx
import pytest

from poller.config import Settings
from poller.schema.endpoint import Endpoint
from poller.service.worker import Worker
from poller.store.store import RedisStore
from tests.support.paths import DATA

VLLM = (DATA / "vllm-v1-synthetic-61k.txt").read_bytes()


async def test_stop_writes_the_scrape_in_flight_then_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    asked, answer = asyncio.Event(), asyncio.Event()

    async def engine(_: httpx.Request) -> httpx.Response:
        asked.set()
        await answer.wait()
        return httpx.Response(200, content=VLLM)

    store = RedisStore(client, "t")
    worker = Worker(
        Settings(id="p1"), store, transport_factory=lambda _: httpx.MockTransport(engine)
    )
    try:
        await store.put_endpoint(Endpoint.model_validate({"id": "e1", "url": "http://e1.test"}))
        await store.ensure_schema()
        worker.jobs.start()  # APScheduler runs the scrape, as in a real poller
        await worker.step()
        scheduler = worker.jobs._scheduler
        assert scheduler is not None
        scheduler.modify_job("e1", next_run_time=datetime.now(UTC))
        await asyncio.wait_for(asked.wait(), 30)
        # stop() has reached the jobs: from here it waits for the scrape, the lease kept
        draining = asyncio.Event()
        stop_jobs = worker.jobs.stop

        async def stop_jobs_signalling(timeout_s: float) -> None:
            draining.set()
            await stop_jobs(timeout_s)

        monkeypatch.setattr(worker.jobs, "stop", stop_jobs_signalling)
        stopping = asyncio.create_task(worker.stop(timeout_s=30))
        await asyncio.wait_for(draining.wait(), 30)
        await asyncio.sleep(0)  # and has had its turn with the scrape in flight
        assert not stopping.done() and await store.lease_holder("e1") == ("p1", 1)
        answer.set()
        await asyncio.wait_for(stopping, 30)
        stats = await store.read_stats("e1")
        assert stats.get("poller") == "p1" and stats.get("running")  # written, then released
        assert await store.lease_holder("e1") is None
        assert worker.metrics.missed.labels("cancelled")._value.get() == 0
    finally:
        answer.set()
        await client.aclose()
