"""The simulator: one asyncio process serving many virtual engine endpoints over HTTP.

Endpoints live either on a shared port under ``/e/<id>`` (style ``path``) or on a port
of their own (style ``port``). Both use aiohttp's low-level ``web.Server`` (no router, no
middleware, no access log): the request path is a dict lookup, a lazy advance of the
endpoint's load model, and a template render cached per model step.

Only 127.0.0.1 is ever bound. ``stop()`` releases everything: hung and dripping
requests end, connections close, and no task or socket outlives the simulator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from aiohttp.web_request import BaseRequest

from poller.errors import ConfigError
from poller_lab.sim.admin import admin_app
from poller_lab.sim.endpoint import SimEndpoint, Snapshot
from poller_lab.sim.faults import Fault
from poller_lab.sim.prefix import block_ids, prompt_tokens
from poller_lab.sim.serve import Responder
from poller_lab.sim.serving import Hold, cached_tokens
from poller_lab.sim.spec import EndpointSpec

__all__ = ["HOST", "Simulator"]

#: The only address the simulator binds.
HOST = "127.0.0.1"
_log = logging.getLogger(__name__)
# Bound on aiohttp's own shutdown wait, for a connection that survived force_close.
_SHUTDOWN_S = 0.5
#: Fault modes under which completions are still served (the others fail them).
_SERVING = ("ok", "missing", "json", "slow", "drip", "oversized", "restart")
_Handler = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


class Simulator:
    """Serves simulated engines; ``async with Simulator(specs, seed=1) as sim: ...``.

    ``clock`` drives the load model and ``flap`` (monotonic seconds; tests pass a fake
    one to move simulated time without sleeping). Hit timestamps are ``time.time()``
    seconds, comparable with other processes' clocks. A new endpoint's load starts
    ``warmup_s`` simulated seconds in the past, so its first page is already busy.
    ``hold(seconds)`` is how long a served request keeps its slot (``asyncio.sleep``;
    tests pass a gate of their own, so no verdict depends on speed).
    """

    def __init__(
        self,
        specs: Iterable[EndpointSpec] = (),
        *,
        seed: int = 0,
        port: int = 0,
        admin: bool = True,
        admin_port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        hit_history: int = 256,
        warmup_s: float = 60.0,
        hold: Hold = asyncio.sleep,
    ) -> None:
        self._hold = hold
        self.seed = seed
        self._warmup_s = warmup_s
        self._clock = clock
        self._wall_offset = time.time() - clock()
        self._history = hit_history
        self._endpoints: dict[str, SimEndpoint] = {}
        self._port = port
        self._admin, self._admin_port = admin, admin_port
        self._shared: tuple[asyncio.Server, web.Server] | None = None
        self._admin_runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()
        self._started = False
        self._responder = Responder(clock, self._stopping)
        for spec in specs:
            self._new_endpoint(spec)

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> Simulator:
        """Open the ports (the same ones again after a ``stop``); all or nothing."""
        self._stopping.clear()
        try:
            server = self._web_server(self._handle_shared)
            listener = await asyncio.get_running_loop().create_server(server, HOST, self._port)
            self._shared = (listener, server)
            self._port = listener.sockets[0].getsockname()[1]
            self._started = True
            for ep in list(self._endpoints.values()):
                if ep.spec.style == "port":
                    await self._listen(ep)  # even a down endpoint gets its port number
                    if ep.fault.mode in ("down", "refuse"):
                        await self._unlisten(ep)
            if self._admin:
                self._admin_runner = web.AppRunner(admin_app(self), access_log=None)
                await self._admin_runner.setup()
                site = web.TCPSite(self._admin_runner, HOST, self._admin_port)
                await site.start()
                self._admin_port = self._admin_runner.addresses[0][1]
        except BaseException:
            await self.stop()
            raise
        _log.info("simulator serving %d endpoints on %s:%d", len(self._endpoints), HOST, self._port)
        return self

    async def stop(self) -> None:
        """Release every request, connection and port; safe to call twice."""
        self._stopping.set()  # hung, slow and dripping requests end now
        self._started = False
        for ep in self._endpoints.values():
            await self._unlisten(ep)
        if self._shared is not None:
            listener, server = self._shared
            self._shared = None
            await _close(listener, server)
        if self._admin_runner is not None:
            runner, self._admin_runner = self._admin_runner, None
            await runner.cleanup()

    async def __aenter__(self) -> Simulator:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _web_server(self, handler: _Handler) -> web.Server:
        # handler_cancellation: a client that gives up on a hung request frees its task.
        return web.Server(handler, handler_cancellation=True, access_log=None)

    async def _listen(self, ep: SimEndpoint) -> None:
        async def handle(request: BaseRequest) -> web.StreamResponse:
            return await self._responder.serve(ep, request, request.path)

        server = self._web_server(handle)
        loop = asyncio.get_running_loop()
        # reuse_address: the port comes back while old connections sit in TIME_WAIT.
        ep.listener = await loop.create_server(server, HOST, ep.port, reuse_address=True)
        ep.server = server
        ep.port = ep.listener.sockets[0].getsockname()[1]

    async def _unlisten(self, ep: SimEndpoint) -> None:
        if ep.listener is None or ep.server is None:
            return
        listener, server, ep.listener, ep.server = ep.listener, ep.server, None, None
        await _close(listener, server)

    # --- endpoints ---------------------------------------------------------------------

    def _new_endpoint(self, spec: EndpointSpec) -> SimEndpoint:
        if spec.id in self._endpoints:
            raise ConfigError(f"endpoint {spec.id!r} already exists")
        ep = SimEndpoint(
            spec,
            seed=self.seed,
            t0=self._clock() - self._warmup_s,
            history=self._history,
            wall_offset=self._wall_offset,
            clock=self._clock,
            hold=self._hold,
        )
        self._endpoints[spec.id] = ep
        return ep

    def _get(self, endpoint_id: str) -> SimEndpoint:
        ep = self._endpoints.get(endpoint_id)
        if ep is None:
            raise KeyError(f"no simulated endpoint {endpoint_id!r}")
        return ep

    async def add(self, spec: EndpointSpec) -> str:
        """Add an endpoint (also while running); returns its base URL."""
        ep = self._new_endpoint(spec)
        if self._started and spec.style == "port":
            try:
                await self._listen(ep)
            except OSError:
                del self._endpoints[spec.id]
                raise
        return self.base_url(spec.id)

    async def remove(self, endpoint_id: str) -> None:
        ep = self._get(endpoint_id)
        del self._endpoints[endpoint_id]
        await self._unlisten(ep)

    @property
    def ids(self) -> list[str]:
        return list(self._endpoints)

    @property
    def port(self) -> int:
        """The shared port of path-style endpoints (0 before ``start``)."""
        return self._port if self._shared else 0

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self._admin_port}"

    def spec(self, endpoint_id: str) -> EndpointSpec:
        return self._get(endpoint_id).spec

    def base_url(self, endpoint_id: str) -> str:
        """What a poller registry entry's ``url`` is; the engine's metrics path follows."""
        ep = self._get(endpoint_id)
        if ep.spec.style == "port":
            return f"http://{HOST}:{ep.port}"
        return f"http://{HOST}:{self._port}/e/{endpoint_id}"

    def metrics_url(self, endpoint_id: str, *, json: bool = False) -> str:
        engine = self._get(endpoint_id).engine
        path = engine.json_path if json and engine.json_path else engine.text_path
        return self.base_url(endpoint_id) + path

    def registry(self, api_key_env: str = "LLMGW_KEY_SIM") -> list[dict[str, str]]:
        """Poller registry entries ``{id, url, engine, api_key_env?}`` for every endpoint."""
        entries = []
        for ep in self._endpoints.values():
            entry = {"id": ep.spec.id, "url": self.base_url(ep.spec.id)}
            entry["engine"] = ep.engine.registry_engine
            if ep.spec.api_key:
                entry["api_key_env"] = api_key_env
            entries.append(entry)
        return entries

    # --- faults and hits ---------------------------------------------------------------

    async def set_fault(self, endpoint_id: str, mode: str, **params: Any) -> Fault:
        """Switch an endpoint's fault mode; returns the fault now in force."""
        ep = self._get(endpoint_id)
        fault = Fault.parse(mode, params)
        now = self._clock()
        if fault.mode == "restart":
            ep.load.restart(now)
            fault = Fault()
        if fault.mode == "flap":
            ep.fail = Fault.parse(fault.params["fail"], {})
        ep.fault, ep.fault_since = fault, now
        if ep.spec.style == "port" and self._started:
            if fault.mode in ("down", "refuse"):
                await self._unlisten(ep)
            elif ep.listener is None:
                await self._listen(ep)
        _log.info("endpoint %s: fault %s %s", endpoint_id, mode, dict(fault.params) or "")
        return fault

    def fault(self, endpoint_id: str) -> Fault:
        return self._get(endpoint_id).fault

    def hits(self, endpoint_id: str) -> int:
        """Metrics requests received (faulted ones included; refused connections are not)."""
        return self._get(endpoint_id).hits

    def hit_times(self, endpoint_id: str) -> list[float]:
        """``time.time()`` of the last ``hit_history`` metrics requests, oldest first."""
        return list(self._get(endpoint_id).hit_times)

    def reset_hits(self, endpoint_id: str | None = None) -> None:
        for ep in [self._get(endpoint_id)] if endpoint_id else self._endpoints.values():
            ep.hits = 0
            ep.hit_times.clear()

    def snapshot(self, endpoint_id: str) -> Snapshot:
        """The load model's state now: what a correct scrape would report."""
        return self._get(endpoint_id).snapshot(self._clock())

    def sleep(self, endpoint_id: str, level: int = 1) -> None:
        """vLLM sleep mode: requests get 503 and the page says asleep; 0 wakes it up."""
        if level not in (0, 1, 2):
            raise ConfigError(f"sleep level must be 0 (awake), 1 or 2, got {level!r}")
        self._get(endpoint_id).sleep_level = level
        _log.info("endpoint %s: sleep level %d", endpoint_id, level)

    def queues(self) -> dict[str, Any]:
        """Every endpoint's true queue now (no metrics lag): what an oracle router reads.

        ``{"now": clock s, "time": unix s, "endpoints": {id: {running, waiting, capacity,
        speed_tps, models, serving, peak_waiting}}}``; ``serving`` is false while asleep or faulted.
        """
        now = self._clock()
        out: dict[str, Any] = {}
        for endpoint_id, ep in self._endpoints.items():
            _, states, _ = ep.shown_states(now, lagged=False)
            out[endpoint_id] = {
                "running": sum(s.running for s in states),
                "waiting": sum(s.waiting for s in states),
                "capacity": ep.queue.capacity,
                "speed_tps": ep.spec.speed_tps,
                "models": list(ep.models),
                "serving": ep.sleep_level == 0 and ep.current_fault(now).mode in _SERVING,
                "peak_waiting": ep.queue.peak_waiting,
            }
        return {"now": now, "time": now + self._wall_offset, "endpoints": out}

    def prefix(self, prompt: str, model: str | None = None) -> dict[str, Any]:
        """What a prefix oracle reads for one prompt: per endpoint (serving ``model``, if
        given) the prompt's tokens it holds in its prefix cache now, and its true queue.

        ``{"now", "time", "prompt_tokens", "blocks", "endpoints": {id: {cached_tokens,
        cached_blocks, running, waiting, capacity, speed_tps, prefill_tps,
        mean_service_s, kv_blocks, serving, models}}}``.
        """
        now = self._clock()
        ids = block_ids(prompt)
        tokens = prompt_tokens(prompt)
        out: dict[str, Any] = {}
        for endpoint_id, ep in self._endpoints.items():
            if model is not None and model not in ep.models:
                continue
            _, states, _ = ep.shown_states(now, lagged=False)
            cache = ep.queue.cache
            out[endpoint_id] = {
                "cached_tokens": cached_tokens(cache, ids, tokens),
                "cached_blocks": len(cache),
                "running": sum(s.running for s in states),
                "waiting": sum(s.waiting for s in states),
                "capacity": ep.queue.capacity,
                "speed_tps": ep.spec.speed_tps,
                "prefill_tps": ep.spec.prefill_tps,
                "mean_service_s": round(ep.queue.mean_service_s, 4),
                "kv_blocks": cache.capacity,
                "models": list(ep.models),
                "serving": ep.sleep_level == 0 and ep.current_fault(now).mode in _SERVING,
            }
        return {
            "now": now,
            "time": now + self._wall_offset,
            "prompt_tokens": tokens,
            "blocks": len(ids),
            "endpoints": out,
        }

    def reset_prefix_cache(self, endpoint_id: str | None = None) -> list[str]:
        """Empty the prefix cache of one endpoint (None: all); its prefix-cache counters
        start again from zero. Returns the ids reset."""
        now = self._clock()
        eps = [self._get(endpoint_id)] if endpoint_id else list(self._endpoints.values())
        for ep in eps:
            ep.reset_prefix_cache(now)
        _log.info("prefix cache reset: %s", endpoint_id or "every endpoint")
        return [ep.spec.id for ep in eps]

    def reset_peaks(self) -> None:
        for ep in self._endpoints.values():
            ep.queue.peak_waiting = ep.queue.state.waiting

    def describe(self, endpoint_id: str) -> dict[str, Any]:
        """The admin API's view of one endpoint."""
        ep = self._get(endpoint_id)
        return {
            "id": endpoint_id,
            "engine": ep.spec.engine,
            "style": ep.spec.style,
            "base_url": self.base_url(endpoint_id),
            "metrics_url": self.metrics_url(endpoint_id),
            "auth": ep.spec.api_key is not None,
            "dp": ep.spec.dp,
            "fault": ep.fault.to_dict(),
            "hits": ep.hits,
            "models": list(ep.models),
            "capacity": ep.queue.capacity,
            "speed_tps": ep.spec.speed_tps,
            "metrics_lag_s": ep.spec.metrics_lag_s,
            "prefill_tps": ep.spec.prefill_tps,
            "kv_blocks": ep.queue.cache.capacity,
            "sleep_level": ep.sleep_level,
        }

    # --- serving -----------------------------------------------------------------------

    async def _handle_shared(self, request: BaseRequest) -> web.StreamResponse:
        path = request.path
        if path.startswith("/e/"):
            endpoint_id, _, rest = path[3:].partition("/")
            ep = self._endpoints.get(endpoint_id)
            if ep is not None and ep.spec.style == "path":
                return await self._responder.serve(ep, request, "/" + rest)
        return web.Response(status=404, text="no such simulated endpoint\n")


async def _close(listener: asyncio.Server, server: web.Server) -> None:
    """Stop listening and close every connection now, idle or busy: the engine is gone."""
    listener.close()
    for connection in server.connections:
        # Closing the transport cancels a running handler (handler_cancellation).
        connection.force_close()
    await server.shutdown(_SHUTDOWN_S)
    await listener.wait_closed()
