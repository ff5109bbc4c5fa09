"""The gRPC side of ``poller epp``: the ext_proc service, gRPC health, metrics, TLS.

``EppServer`` holds one Router (docs/reader.md, "The Router"): every ext_proc stream is
one request (``stream.Stream``), and every replica is active, since the replicas share
their in-flight counts and prefix placements through Redis. Readiness is SERVING once
the view is current (``router.ready``), on every replica: no leader election.

grpc.aio in the Router's own event loop: a pick is a few microseconds of CPU and safe on
the loop, and one loop leaves no lock between the streams and the view's updates.
Compression is off (the messages are small, and zlib costs more CPU than the bytes
save on loopback or a pod network).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poller.integrations.envoy.destinations import Destinations
from poller.integrations.envoy.metrics import EppMetrics
from poller.integrations.envoy.picking import Picking
from poller.integrations.envoy.stream import Stream
from poller.reader import Router

__all__ = ["EXT_PROC_SERVICE", "EppOptions", "EppServer"]

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: The health services the protocol names; "" is gRPC's "the server as a whole".
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
#: How often readiness is re-read from the Router (what a watching client sees change).
_READY_EVERY_S = 0.2
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class EppOptions:
    """How ``EppServer`` serves (the ``[epp]`` settings of poller/config/epp.py)."""

    host: str = "0.0.0.0"
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    fallbacks: int = 0
    retry_after_s: int = 1
    max_body_bytes: int = 4 * 1024 * 1024
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    resolve_interval_s: float = 30.0


class _ExtProc(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, picking: Picking) -> None:
        self.picking = picking

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        stream = Stream(self.picking)
        try:
            async for request in requests:
                for answer in stream.handle(request):
                    yield answer
        except asyncio.CancelledError:
            raise  # Envoy reset the stream: the request is over, counted below
        except Exception:
            self.picking.metrics.stream_errors.labels("internal").inc()
            log.exception("ext_proc stream failed")
            raise
        finally:
            stream.close()


class _Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """gRPC health: ``liveness`` always SERVING while the process answers; readiness and
    the ext_proc service SERVING while the Router may route."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def status(self, service: str) -> Any:
        if service == "liveness":
            return _SERVING
        return _SERVING if self.router.ready else _NOT_SERVING

    async def Check(self, request: Any, context: Any) -> Any:
        if request.service not in HEALTH_SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self.status(request.service))

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        last = None
        while True:
            now = (
                self.status(request.service)
                if request.service in HEALTH_SERVICES
                else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            )
            if now != last:
                last = now
                yield health_pb2.HealthCheckResponse(status=now)
            await asyncio.sleep(_READY_EVERY_S)


def _credentials(options: EppOptions) -> Any:
    if options.tls_cert_file is None or options.tls_key_file is None:
        return None
    cert = Path(options.tls_cert_file).read_bytes()
    key = Path(options.tls_key_file).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


class EppServer:
    """The ext_proc and health servers of one EPP replica on ``router``."""

    def __init__(self, router: Router, options: EppOptions, metrics: EppMetrics) -> None:
        self.router = router
        self.options = options
        self.metrics = metrics
        self.destinations = Destinations(router, resolve_interval_s=options.resolve_interval_s)
        self.picking = Picking(
            router,
            self.destinations,
            metrics,
            fallbacks=options.fallbacks,
            retry_after_s=options.retry_after_s,
            max_body_bytes=options.max_body_bytes,
        )
        metrics.watch(router)
        self._servers: list[Any] = []
        self._resolving: asyncio.Task[None] | None = None
        #: The ports bound (``grpc_port`` 0 in tests: the one the system chose).
        self.grpc_port = 0
        self.health_port = 0

    async def start(self) -> None:
        """Bind and serve; ``OSError`` when a port cannot be bound."""
        options = self.options
        credentials = _credentials(options)
        grpc_options = [
            ("grpc.so_reuseport", 0),  # a second EPP on the same port must fail, not share
            # Envoy's health checker and its streams keep connections open for long.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ]
        main = grpc.aio.server(options=grpc_options, compression=grpc.Compression.NoCompression)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(_ExtProc(self.picking), main)
        health = _Health(self.router)
        health_pb2_grpc.add_HealthServicer_to_server(health, main)
        self.grpc_port = _bind(main, options.host, options.grpc_port, credentials)
        servers = [main]
        if options.grpc_health_port:
            side = grpc.aio.server(options=grpc_options)
            health_pb2_grpc.add_HealthServicer_to_server(health, side)
            self.health_port = _bind(side, options.host, options.grpc_health_port, credentials)
            servers.append(side)
        for server in servers:
            await server.start()
        self._servers = servers
        self._resolving = asyncio.create_task(self.destinations.run(), name="epp-resolve")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking streams; those open get ``grace_s`` to end, then are cancelled
        (each ends its ticket as it goes)."""
        if self._resolving is not None:
            self._resolving.cancel()
            await asyncio.gather(self._resolving, return_exceptions=True)
        await asyncio.gather(*(s.stop(grace_s) for s in self._servers))
        self._servers = []


def _bind(server: Any, host: str, port: int, credentials: Any) -> int:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc says "Failed to bind" this way
        raise OSError(f"cannot listen on {address}: {exc}") from None
    if not bound:
        raise OSError(f"cannot listen on {address}")
    return int(bound)
