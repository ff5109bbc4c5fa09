"""``poller epp``'s process: one Router, the gRPC servers, the metrics port, until
SIGTERM/SIGINT (``run_epp``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from prometheus_client import start_http_server

from poller.integrations.envoy.metrics import EppMetrics
from poller.integrations.envoy.server import EppOptions, EppServer
from poller.reader import RedisSettings, Router, RoutingOptions, SchemaMismatch, StatsReader

__all__ = ["run_epp"]

log = logging.getLogger(__name__)


async def run_epp(
    redis: RedisSettings,
    routing: RoutingOptions,
    options: EppOptions,
    *,
    metrics_port: int = 9090,
    replica_id: str | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until ``stop`` is set (default: SIGTERM or SIGINT); the exit status.

    On stop the ports close to new streams first, so Envoy's health check and retries
    move to the other replicas, and the streams open get a grace period: each ends
    its ticket, and the shared counts drop this replica's field at once (the Router
    closes with the reader)."""
    handled: list[signal.Signals] = []
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    metrics = EppMetrics()
    reader = StatsReader.from_settings(redis)
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                router = await stack.enter_async_context(
                    reader.router(routing, replica_id=replica_id)
                )
            except SchemaMismatch as exc:
                # Another schema version: nothing this EPP could ever route on.
                log.error("cannot route on namespace %s: %s", redis.namespace, exc)
                return 1
            return await _serve(router, options, metrics, metrics_port, redis.namespace, stop)
    finally:
        await reader.aclose()
        for sig in handled:
            asyncio.get_running_loop().remove_signal_handler(sig)


async def _serve(
    router: Router,
    options: EppOptions,
    metrics: EppMetrics,
    metrics_port: int,
    namespace: str,
    stop: asyncio.Event,
) -> int:
    server = EppServer(router, options, metrics)
    http: Any = None
    try:
        await server.start()
        if metrics_port:
            http, _ = start_http_server(metrics_port, options.host, metrics.registry)
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        await server.stop(0)
        return 1
    log.info(
        "epp serving",
        extra={
            "grpc_port": server.grpc_port,
            "grpc_health_port": server.health_port or None,
            "metrics_port": metrics_port or None,
            "replica": router.replica_id,
            "namespace": namespace,
            "ready": router.ready,
        },
    )
    try:
        await stop.wait()
    finally:
        log.info("epp stopping")
        await server.stop()
        if http is not None:
            http.shutdown()
            http.server_close()
    return 0
