"""The poller's own /metrics: build info, process metrics, no ``_created`` series."""

from __future__ import annotations

import asyncio
import platform
import sys
import urllib.request

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from poller._version import __version__
from poller.service.metrics import PollerMetrics, WithoutCreated
from poller.service.web.health import HealthServer


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        body: bytes = response.read()
        return body.decode()


async def scrape(metrics: PollerMetrics) -> str:
    health = HealthServer("127.0.0.1", 0, ready=lambda: True, registry=metrics.exposition)
    port = await health.start()
    try:
        return await asyncio.to_thread(get, port, "/metrics")
    finally:
        await health.stop()


async def test_metrics_page_has_build_info_process_metrics_and_no_created_series() -> None:
    metrics = PollerMetrics()
    metrics.scrapes.labels("vllm", "ok").inc(3)
    metrics.scrape_duration.observe(0.01)
    text = await scrape(metrics)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    build = (("python", platform.python_version()), ("version", __version__))
    assert samples[("poller_build_info", build)] == 1.0
    assert samples[("poller_scrapes_total", (("engine", "vllm"), ("result", "ok")))] == 3.0
    assert samples[("poller_scrape_duration_seconds_count", ())] == 1.0
    names = {name for name, _ in samples}
    assert not [n for n in names if n.endswith("_created")], text
    if sys.platform == "linux":  # the process collector reads /proc
        assert samples[("process_resident_memory_bytes", ())] > 0
        assert samples[("process_open_fds", ())] > 0
        assert ("process_cpu_seconds_total", ()) in samples
    assert ("python_info", ()) not in samples  # python_info carries labels
    assert any(name == "python_info" for name in names)


def test_created_series_are_left_out_of_this_exposition_only() -> None:
    """The filter is scoped: the registry itself, and any other, still has them."""
    registry = CollectorRegistry()
    Counter("jobs", "Jobs.", registry=registry).inc()
    assert registry.get_sample_value("jobs_created") is not None
    filtered = {s.name for m in WithoutCreated(registry).collect() for s in m.samples}
    assert filtered == {"jobs_total"}
    assert registry.get_sample_value("jobs_created") is not None
    other = CollectorRegistry()
    Counter("other", "Other.", registry=other).inc()
    assert other.get_sample_value("other_created") is not None
