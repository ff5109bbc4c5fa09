"""``poller run``'s process: one worker, its health server, until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from poller.config import Settings
from poller.reader.reader import StatsReader
from poller.service.discovery.runner import DiscoveryRunner
from poller.service.ttl import stats_ttl_ms
from poller.service.web.health import HealthServer
from poller.service.web.page import OperatorPage
from poller.service.worker import Worker
from poller.store.discovery import read_sources
from poller.util.logs import tag_poller
from poller.util.urls import redact_url

__all__ = ["serve"]

log = logging.getLogger(__name__)


async def serve(settings: Settings) -> int:
    """Run one poller until SIGTERM/SIGINT; returns the exit status."""
    tag_poller(settings.id)  # several pollers' logs often end up in one stream
    worker = Worker(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Drain: hand every lease over and take no new one, still serving the health port.
    loop.add_signal_handler(signal.SIGUSR1, worker.drain.request)
    worker.on_fatal = stop.set

    async def serving() -> list[str]:
        # A draining poller hands its discovery sources over too.
        members = await worker.store.live_members()
        return [m for m in members if m not in worker.coordinator.draining]

    # Discovery has its own lease and loop; it shares the worker's Redis client and metrics.
    discovery = DiscoveryRunner(settings, worker.store, worker.metrics, members=serving)
    health = None
    if settings.health.port:
        view_reader = StatsReader(worker.store.client, settings.redis.namespace)

        async def view() -> dict[str, Any]:
            view = (await view_reader.snapshot()).to_dict()
            view["sources"] = await read_sources(worker.store.client, worker.store.keys)
            return view

        async def jobs() -> dict[str, Any]:
            # What this poller runs, for checks of the lease <-> job invariant (soak).
            specs = worker.jobs.specs
            return {
                "poller": worker.id,
                "jobs": {e: spec.token for e, spec in specs.items()},
                "held": dict(worker.coordinator.held),
            }

        health = HealthServer(
            settings.health.host,
            settings.health.port,
            # Draining: alive and reachable, but not taking work (the body says so).
            ready=lambda: worker.ready and not worker.draining,
            unready_reason=worker.unready_reason,
            registry=worker.metrics.exposition,
            routes={"/v1/view": view, "/v1/jobs": jobs},
            raw_routes=_page_routes(worker, settings, view_reader),
        )
        try:
            await health.start()
        except OSError as exc:
            log.error(
                "cannot listen on the health port",
                extra={
                    "host": settings.health.host,
                    "port": settings.health.port,
                    "why": exc.strerror,
                },
            )
            await worker.store.close()
            return 1
    sc = settings.scrape
    log.info(
        "poller starting",
        extra={
            "redis": redact_url(settings.redis.url),
            "namespace": settings.redis.namespace,
            "interval_s": sc.interval_s,
            # Raised above stats_ttl_intervals where a takeover would outlast it.
            "stats_ttl_s": stats_ttl_ms(
                sc.interval_s, sc.timeout_s, settings.coordination, sc.stats_ttl_intervals
            )
            / 1000,
        },
    )
    await worker.start()
    await discovery.start()
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await discovery.stop()
        await worker.stop()
        if health is not None:
            await health.stop()
    return worker.exit_status  # a fatal error was logged by the worker when it happened


def _page_routes(worker: Worker, settings: Settings, reader: StatsReader) -> dict[str, Any]:
    """The operator's page (``GET /``) and its static files, on the health port; its view
    comes from ``reader``, the one ``/v1/view`` answers from."""
    page = OperatorPage(
        worker.store.client,
        settings.redis.namespace,
        settings.id,
        settings.coordination.member_ttl_ms,
        reader=reader,
    )
    return dict(page.routes())
