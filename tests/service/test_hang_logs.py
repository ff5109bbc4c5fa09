"""A Redis that hangs logs a few lines per coordination pass, not one per endpoint per run.

While Redis is paused every job's write hangs, so APScheduler skips every job's next runs
(one WARNING each from APScheduler itself), every lease goes unconfirmed and many fenced
writes fail at once when it returns. The worker says each of those once per pass
(docs/operations.md, "Logs"); tests/bench/bench_hang_logs.py measures it at 1,000
endpoints with `poller run` processes.
"""

from __future__ import annotations

import logging
import re
from collections import Counter

import httpx
import pytest

from poller.config import Settings
from poller.schema.endpoint import Endpoint
from poller.service.worker import Worker
from poller.store.store import RedisStore
from tests.support.procs import until
from tests.support.redisproc import RedisProcess

N = 100
INTERVAL_S = 0.25
PAGE = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n"


def _settings(url: str) -> Settings:
    return Settings(
        id="p1",
        redis={"url": url, "namespace": "hang"},
        scrape={"interval_s": INTERVAL_S, "timeout_s": 0.2},
        # A lease TTL well inside the hang: every lease goes unconfirmed.
        coordination={
            "lease_ttl_ms": 1000,
            "member_ttl_ms": 1000,
            "heartbeat_interval_ms": 300,
            "reconcile_interval_ms": 500,
        },
    )


def _kind(message: str) -> str:
    """A line's message without its numbers: one kind per summary."""
    return re.sub(r"\d+", "N", message)


@pytest.mark.slow
async def test_a_hung_redis_logs_lines_per_pass_not_per_endpoint(
    own_redis: RedisProcess, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(own_redis.url)
    store = RedisStore.from_settings(settings.redis)
    for i in range(N):
        await store.put_endpoint(Endpoint(id=f"e{i}", url=f"http://e{i}.test:8000"))
    worker = Worker(
        settings,
        store,
        transport_factory=lambda _: httpx.MockTransport(
            lambda r: httpx.Response(200, content=PAGE)
        ),
    )
    passes = 0
    one_pass = worker._pass

    async def counted(*, full: bool) -> None:
        nonlocal passes
        passes += 1
        await one_pass(full=full)

    monkeypatch.setattr(worker, "_pass", counted)
    # As `poller run` sets it up (poller/util/logs.py): APScheduler at WARNING.
    caplog.set_level(logging.WARNING, logger="apscheduler")
    caplog.set_level(logging.INFO)
    metrics = worker.metrics

    def skipped() -> float:
        return float(metrics.missed.labels("still_running")._value.get())

    def gained() -> float:
        return float(metrics.leases_gained._value.get())

    await worker.start()
    try:
        await until(lambda: len(worker.owned) == N, 60, "every endpoint owned")
        await until(lambda: metrics.scrapes.labels("vllm", "ok")._value.get() >= N, 60, "scrapes")
        mark, passes_before = len(caplog.records), passes
        own_redis.pause()
        try:
            # Ten skipped runs per endpoint on average: the hang outlasts the lease TTL
            # (each skip is a due time passing while the previous run still waits).
            await until(lambda: skipped() >= 10 * N, 60, "runs skipped while Redis hangs")
        finally:
            own_redis.resume()
        await until(lambda: gained() >= 2 * N, 60, "every lease taken again")
        settled = passes
        await until(lambda: passes >= settled + 3, 30, "three more passes")
        lines = caplog.records[mark:]
        ran = passes - passes_before
    finally:
        await worker.stop()

    kinds = Counter(_kind(r.getMessage()) for r in lines)
    said = "\n".join(f"{n:>5} {k}" for k, n in kinds.most_common())
    assert not [r for r in lines if r.name.startswith("apscheduler")], said
    assert any(k.startswith("lease unconfirmed for a TTL") for k in kinds), said
    assert any(k.startswith("scrape runs skipped") for k in kinds), said
    # Bounded by passes: each kind at most once per pass (plus stop's last word), a few
    # kinds; with neither endpoints nor seconds in the formula.
    assert all(n <= ran + 1 for n in kinds.values()), (ran, said)
    assert len(lines) <= 6 * (ran + 1), (ran, said)
    assert len(lines) < N, said
