"""The EPP's Prometheus metrics (``poller epp --metrics-port``, docs/epp.md).

A registry of its own (several EPPs in one test process never collide). The in-flight
gauge is read from the Router when scraped, so counting costs the request path nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from poller.reader import Router

__all__ = ["EppMetrics", "OUTCOMES"]

#: A request's outcome: routed, or the reason it was refused (the error body's ``code``).
OUTCOMES = (
    "routed",
    "not_ready",
    "no_endpoint",
    "not_fresh",
    "saturated",
    "bad_request",
    "too_large",
)
_PICK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025)


class EppMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.requests = Counter(
            "epp_requests",
            "Requests Envoy asked about, by outcome: routed or the refusal's reason.",
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every series from the start, at 0
        self.pick = Histogram(
            "epp_pick_duration_seconds",
            "Time to choose an endpoint (the Router's pick, its addresses, the answer).",
            buckets=_PICK_BUCKETS,
            registry=r,
        )
        self.served_elsewhere = Counter(
            "epp_served_elsewhere",
            "Requests served by another endpoint than the first named (Envoy retried).",
            registry=r,
        )
        self.response_chunks = Counter(
            "epp_response_chunks",
            "Response body chunks seen (streamed body modes only).",
            registry=r,
        )
        self.stream_errors = Counter(
            "epp_stream_errors",
            "ext_proc streams that ended in an error, by kind.",
            ["kind"],
            registry=r,
        )

    def watch(self, router: Router) -> None:
        """Export ``router``'s in-flight counts and state when scraped."""
        self.registry.register(_RouterCollector(router))


class _RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterable[Metric]:
        router = self.router
        in_flight = GaugeMetricFamily(
            "epp_in_flight",
            "Requests in flight per endpoint, as this replica counts them.",
            labels=["endpoint"],
        )
        peers = GaugeMetricFamily(
            "epp_peer_in_flight",
            "Requests in flight per endpoint from the other replicas, as last heard.",
            labels=["endpoint"],
        )
        local, fleet = router.local, router.fleet
        for endpoint_id in router.cache.ids():
            in_flight.add_metric([endpoint_id], local.in_flight(endpoint_id))
            if fleet is not None:
                peers.add_metric([endpoint_id], fleet.peer_in_flight(endpoint_id))
        yield in_flight
        yield peers
        yield GaugeMetricFamily(
            "epp_ready", "1 while readiness is SERVING (the view current).", value=router.ready
        )
        yield GaugeMetricFamily(
            "epp_load_shared",
            "1 while the other replicas' in-flight counts are current.",
            value=router.load_shared,
        )
