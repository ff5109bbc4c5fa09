"""The poller's own Prometheus metrics (served on the health port at /metrics).

Each Worker gets its own CollectorRegistry, so several workers in one process (tests,
benchmarks) never collide in the global registry. Besides the poller's own series it
carries ``poller_build_info`` and the process collectors (CPU, RSS, open FDs), and its
exposition (``PollerMetrics.exposition``) leaves out the ``_created`` series.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from poller._version import __version__

__all__ = ["PollerMetrics", "Surprises", "WithoutCreated"]

log = logging.getLogger(__name__)

_SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_LATENESS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PollerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        #: What /metrics serves: this registry without its ``_created`` series.
        self.exposition = WithoutCreated(r)
        # The series dashboards join on to tell versions apart during a rolling update.
        Info("poller_build", "The poller's version and Python.", registry=r).info(
            {"version": __version__, "python": platform.python_version()}
        )
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...
        # (read from /proc; nothing on systems without it) and python_info.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.scrapes = Counter(
            "poller_scrapes",
            "Scrapes by engine and result (ok or a failure reason).",
            ["engine", "result"],
            registry=r,
        )
        self.scrape_duration = Histogram(
            "poller_scrape_duration_seconds",
            "Fetch and parse time of one scrape.",
            buckets=_SCRAPE_BUCKETS,
            registry=r,
        )
        self.leases_held = Gauge(
            "poller_leases_held", "Endpoint leases this poller holds.", registry=r
        )
        self.lease_losses = Counter(
            "poller_lease_losses", "Leases lost (renewal or fenced write rejected).", registry=r
        )
        self.leases_gained = Counter("poller_leases_gained", "Leases acquired.", registry=r)
        self.reconcile_duration = Histogram(
            "poller_reconcile_duration_seconds", "Duration of one reconcile step.", registry=r
        )
        self.redis_errors = Counter(
            "poller_redis_errors",
            "Redis calls that failed (unreachable, timeout, error).",
            ["operation"],
            registry=r,
        )
        self.write_rejections = Counter(
            "poller_write_rejections",
            "Fenced writes Redis rejected (lease no longer ours).",
            registry=r,
        )
        self.lateness = Histogram(
            "poller_scheduler_lateness_seconds",
            "How late the scheduler started a scrape after its planned time.",
            buckets=_LATENESS_BUCKETS,
            registry=r,
        )
        self.missed = Counter(
            "poller_scrapes_missed",
            "Scrape runs that wrote nothing, by cause: misfire, still_running, "
            "redis_unavailable, write_failed, cancelled (dropped or stopping), replaced.",
            ["why"],
            registry=r,
        )
        self.unexpected = Counter(
            "poller_unexpected_errors",
            "Exceptions no code path expected (bugs, library surprises), by loop and type; "
            "the loop survives them.",
            ["where", "kind"],
            registry=r,
        )
        self.redis_up = Gauge(
            "poller_redis_up", "1 when the last Redis call succeeded.", registry=r
        )
        self.members = Gauge(
            "poller_live_members", "Live pollers seen at the last heartbeat.", registry=r
        )
        self.draining = Gauge(
            "poller_draining",
            "1 while a drain of this poller is requested (poller drain, SIGUSR1): it holds "
            "and takes no lease.",
            registry=r,
        )
        # DNS discovery (poller/service/discovery/runner.py): counted by the poller resolving.
        self.discovery_resolutions = Counter(
            "poller_discovery_resolutions",
            "DNS resolutions of a discovery source by this poller.",
            ["source"],
            registry=r,
        )
        self.discovery_failures = Counter(
            "poller_discovery_failures",
            "Failed discovery resolutions (timeout, servfail, nxdomain, empty, error, "
            "registry) by source and reason.",
            ["source", "reason"],
            registry=r,
        )
        self.discovery_targets = Gauge(
            "poller_discovery_targets",
            "Registry entries a discovery source owns, after its last resolution here.",
            ["source"],
            registry=r,
        )


class WithoutCreated(Collector):
    """A registry's metrics without the ``_created`` samples of counters, histograms and
    summaries: one more series per metric that dashboards of this poller never use.

    Scoped to this exposition: prometheus_client's ``disable_created_metrics()`` (and its
    ``PROMETHEUS_DISABLE_CREATED_SERIES`` variable) is process-wide, and would change the
    metrics of an application embedding a poller.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self.registry.collect():
            if metric.type in _WITH_CREATED:
                kept = [s for s in metric.samples if not s.name.endswith("_created")]
                if len(kept) != len(metric.samples):
                    copy = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                    copy.samples = kept
                    metric = copy
            yield metric


_WITH_CREATED = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


class Surprises:
    """Unexpected exceptions: logged at WARNING with the traceback once per (loop, type),
    counted every time, and never allowed to end the loop that met them."""

    def __init__(self, metrics: PollerMetrics) -> None:
        self.metrics = metrics
        self._seen: set[tuple[str, str]] = set()

    def report(self, where: str, exc: BaseException) -> None:
        kind = type(exc).__name__
        self.metrics.unexpected.labels(where, kind).inc()
        if (where, kind) in self._seen:
            log.debug("unexpected %s in %s: %s", kind, where, exc)
            return
        self._seen.add((where, kind))
        log.warning(
            "unexpected %s in %s (counted in poller_unexpected_errors_total; logged once): %s",
            kind,
            where,
            exc,
            exc_info=exc,
        )
