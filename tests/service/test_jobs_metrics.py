"""JobRunner's per-run bookkeeping: cached label children and float lateness
record exactly what the uncached, datetime-based versions did; runs APScheduler skipped
are said once per pass."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, EVENT_JOB_SUBMITTED

from poller.config import Settings
from poller.schema.endpoint import endpoint_from_dict
from poller.service.jobs import JobRunner
from poller.service.metrics import PollerMetrics, Surprises
from poller.service.missed import quiet_apscheduler
from poller.service.owned import JobSpec, job_spec
from poller.util.logs import text_of


def runner() -> tuple[JobRunner, PollerMetrics]:
    metrics = PollerMetrics()
    jobs = JobRunner(
        Settings(id="p1"),
        cast(Any, None),
        cast(Any, None),
        metrics,
        Surprises(metrics),
        ready=lambda: True,
    )
    return jobs, metrics


def value(metrics: PollerMetrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_lateness_is_observed_in_seconds() -> None:
    jobs, metrics = runner()
    past = datetime.now(UTC) - timedelta(seconds=30)
    future = datetime.now(UTC) + timedelta(seconds=30)
    for planned in (past, future):
        event = SimpleNamespace(code=EVENT_JOB_SUBMITTED, scheduled_run_times=[planned])
        jobs._on_scheduler_event(event)
    assert value(metrics, "poller_scheduler_lateness_seconds_count") == 2
    total = value(metrics, "poller_scheduler_lateness_seconds_sum")
    assert 30 <= total < 60  # 30 s late, and a run planned ahead counts as 0, not -30
    assert value(metrics, "poller_scheduler_lateness_seconds_bucket", le="2.5") == 1


def test_cached_children_count_per_label() -> None:
    jobs, metrics = runner()
    for _ in range(3):
        jobs._count_scrape("vllm", "ok")
    jobs._count_scrape("vllm", "timeout")
    jobs._count_scrape("sglang", "ok")
    jobs._on_scheduler_event(SimpleNamespace(code=EVENT_JOB_MISSED, job_id="e1"))
    jobs._on_scheduler_event(SimpleNamespace(code=EVENT_JOB_MAX_INSTANCES, job_id="e1"))
    jobs._on_scheduler_event(SimpleNamespace(code=EVENT_JOB_MAX_INSTANCES, job_id="e2"))
    assert value(metrics, "poller_scrapes_total", engine="vllm", result="ok") == 3
    assert value(metrics, "poller_scrapes_total", engine="vllm", result="timeout") == 1
    assert value(metrics, "poller_scrapes_total", engine="sglang", result="ok") == 1
    assert value(metrics, "poller_scrapes_missed_total", why="misfire") == 1
    assert value(metrics, "poller_scrapes_missed_total", why="still_running") == 2


def test_runs_apscheduler_skipped_are_one_line_per_say_not_one_per_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    jobs, _ = runner()
    with caplog.at_level(logging.INFO):
        for i in range(300):
            jobs._on_scheduler_event(
                SimpleNamespace(code=EVENT_JOB_MAX_INSTANCES, job_id=f"e{i % 100:02d}")
            )
        jobs._on_scheduler_event(SimpleNamespace(code=EVENT_JOB_MISSED, job_id="e07"))
        jobs.say()
        jobs.say()  # nothing new: nothing said
    said = [text_of(r) for r in caplog.records]
    assert said == [
        "scrape runs skipped, the previous run still going (Redis or the engine slow to "
        'answer): 300 runs of 100 endpoints endpoints="e00,e01,e02,e03,e04,(+95 more)"',
        "scrape runs missed, due over a grace time ago (a starved event loop): 1 run of "
        "1 endpoint endpoints=e07",
    ]


def test_apschedulers_own_line_per_skipped_run_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    quiet_apscheduler()  # what JobRunner.start() does
    with caplog.at_level(logging.INFO):
        for name in ("apscheduler.scheduler", "apscheduler.executors.default"):
            logger = logging.getLogger(name)
            logger.warning(
                'Execution of job "%s" skipped: maximum number of running instances reached (%d)',
                "e1",
                1,
            )
            logger.warning('Run time of job "%s" was missed by %s', "e1", "0:00:02")
            # as another filter (LiteLLM's redaction) may leave it: formatted in place
            logger.warning('Run time of job "e1 (trigger: interval)" was missed by 0:00:02')
            logger.warning("Error getting due jobs from job store %r: %s", "default", "x")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "Error getting due jobs from job store 'default'"
    ] * 2


def test_an_entry_pointed_at_another_engine_starts_its_window_over() -> None:
    # Another vLLM's counters are not the continuation of the old one's: a hit rate over
    # both would be the difference of two unrelated engines' totals.
    jobs, _ = runner()
    scrape = Settings(id="p1").scrape
    holdings = jobs.holdings
    record = holdings.hold("e1", 1, confirmed_at=0.0)

    def entry(**changes: object) -> JobSpec:
        data = {"url": "http://10.0.0.1:8000", "engine": "vllm", **changes}
        return job_spec("e1", 1, endpoint_from_dict("e1", data), None, scrape)

    jobs.add(record, entry(), datetime.now(UTC), None)
    window = record.window
    window.prev_hits, window.prev_queries, window.models = 0.0, 900_000.0, ("m",)
    jobs.replace(record, entry(labels={"zone": "a"}))  # the same engine: carried on
    assert record.window is window
    for changed in ({"url": "http://10.0.0.2:8000"}, {"metrics_path": "/metrics?model=m"}):
        jobs.replace(record, entry(**changed))
        assert record.window is not window
        assert (record.window.prev_hits, record.window.models) == (None, None)
        window = record.window
        window.prev_hits = 1.0
