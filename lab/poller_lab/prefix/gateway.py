"""One gateway of the prefix benchmark (a process of its own): a small OpenAI proxy.

    python -m poller_lab.prefix.gateway CONFIG.json

It listens on a free loopback port and writes the port to the file ``ready``. For each
``POST /v1/chat/completions`` it chooses an engine with its policy (policies.py), sends
the request there, streams the engine's answer back chunk by chunk, and names the engine
in the ``x-gateway-endpoint`` header (``-`` and a 503 when there was nowhere to send it).
With ``envoy-epp`` it chooses nothing: it sends every request to the Envoy at
``envoy_url``, whose EPP replicas choose, and names the engine that answered (the
simulator's ``x-sim-endpoint``), or ``-`` when Envoy answered itself (an EPP's refusal).
``GET /stats`` answers its counters since the last ``GET /stats?reset=1``: requests,
fallbacks, CPU per pick, and the Redis traffic of its placements when the reader has them
(``router.placements``). SIGTERM ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from poller_lab.prefix.policies import Chooser, make_chooser
from poller_lab.prefix.trace import Trace
from poller_lab.prefix.trace import folder as trace_folder

__all__ = ["main", "sharing_counters"]

#: An engine answer still unfinished after this long is given up (the client sees 504).
REQUEST_TIMEOUT_S = 120.0
#: The header the gateway names the engine in; the simulator's, naming itself.
ENDPOINT_HEADER = "x-gateway-endpoint"
SIM_ENDPOINT_HEADER = "x-sim-endpoint"


def sharing_counters(router: Any) -> dict[str, float]:
    """The Redis traffic of this gateway's sharing: the share script's calls (they carry
    the placements too) and the placements' bytes and ids; {} without sharing."""
    exchange = None if router is None else router.exchange
    if exchange is None:
        return {}
    p = router.placements
    return {
        "commands": exchange.calls,
        "bytes_written": p.bytes_written,
        "bytes_read": p.bytes_read,
        "ids_written": p.ids_written,
        "ids_read": p.ids_read,
        "placed": p.placed,
        "dropped": p.dropped,
        "invalidated": p.invalidated,
    }


class _Gateway:
    def __init__(self, cfg: Mapping[str, Any], http: aiohttp.ClientSession) -> None:
        self.cfg, self.http = cfg, http
        self.urls: dict[str, str] = cfg["urls"]
        self.chooser: Chooser | None = None
        self.router: Any = None
        self.trace: Any = None
        out = trace_folder()
        if out is not None and cfg["policy"] in ("prefix-own", "prefix-shared"):
            self.trace = Trace(out, Path(cfg["ready"]).parent.name)
        self._reset()

    def _reset(self) -> None:
        self.requests = 0
        self.fallbacks = 0
        self.errors = 0
        self.cpu_ns: list[int] = []

    async def oracle(self, body: dict[str, Any]) -> Mapping[str, Any]:
        async with self.http.post(self.cfg["admin_url"] + "/admin/prefix", json=body) as r:
            r.raise_for_status()
            answer: Mapping[str, Any] = await r.json()
        return answer

    async def chat(self, request: web.Request) -> web.StreamResponse:
        assert self.chooser is not None
        body = await request.json()
        if self.cfg["policy"] == "envoy-epp":
            return await self._through_envoy(request, body)
        trace = self.trace
        if trace is not None:
            trace.truth = await self.oracle(
                {"messages": body["messages"], "model": self.cfg["model"]}
            )
        chosen, cpu_ns = await self.chooser.choose(body)
        traced = None if trace is None else trace.take(chosen)
        first: list[float] = []  # seconds from the forward to the engine's first chunk
        self.requests += 1
        self.cpu_ns.append(cpu_ns)
        if chosen is None or chosen not in self.urls:
            if traced is not None:
                trace.write(traced, None)
            self.fallbacks += 1
            return web.json_response(
                {"error": {"message": "no endpoint may take it", "code": 503}},
                status=503,
                headers={ENDPOINT_HEADER: "-"},
            )
        started_at = self.chooser.started(chosen)
        ok = False
        try:
            url = self.urls[chosen] + "/v1/chat/completions"
            response = await self._forward(request, url, chosen, body, first)
            ok = response.status == 200
            return response
        finally:
            self.chooser.finished(chosen, started_at, ok)
            if traced is not None:
                trace.write(traced, first[0] if first else None)
            if not ok:
                self.errors += 1

    async def _through_envoy(
        self, request: web.Request, body: Mapping[str, Any]
    ) -> web.StreamResponse:
        """``envoy-epp``: no choice here (its CPU is the EPP's, not recorded); an answer
        that names no engine is one Envoy gave itself: the EPP's refusal (a fallback)."""
        self.requests += 1
        url = self.cfg["envoy_url"] + "/v1/chat/completions"
        response = await self._forward(request, url, None, body, [])
        if response.headers.get(ENDPOINT_HEADER, "-") == "-":
            self.fallbacks += 1
        if response.status != 200:
            self.errors += 1
        return response

    async def _forward(
        self,
        request: web.Request,
        url: str,
        chosen: str | None,
        body: Mapping[str, Any],
        first: list[float],
    ) -> web.StreamResponse:
        """The answer of ``url``, streamed through; ``first`` gets the seconds until its
        first chunk. ``chosen`` None: the engine that answered names itself."""
        headers = {ENDPOINT_HEADER: chosen or "-"}
        t0 = time.monotonic()
        try:
            async with self.http.post(url, json=body) as upstream:
                if chosen is None:
                    headers[ENDPOINT_HEADER] = upstream.headers.get(SIM_ENDPOINT_HEADER, "-")
                out = web.StreamResponse(status=upstream.status, headers=headers)
                out.content_type = upstream.content_type
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    if chunk and not first:
                        first.append(time.monotonic() - t0)
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            return web.json_response(
                {"error": {"message": f"engine failed: {exc!r}", "code": 502}},
                status=502,
                headers=headers,
            )

    async def stats(self, request: web.Request) -> web.Response:
        answer = {
            "requests": self.requests,
            "fallbacks": self.fallbacks,
            "errors": self.errors,
            "cpu_ns": self.cpu_ns,
            "placements": sharing_counters(self.router),
        }
        if request.query.get("reset") == "1":
            self._reset()
        return web.json_response(answer)


@contextlib.asynccontextmanager
async def _view(cfg: Mapping[str, Any]) -> AsyncIterator[Any]:
    """The gateway's Router (None for the policies that read no view)."""
    if cfg["policy"] in ("round-robin", "oracle", "envoy-epp"):
        yield None
        return
    import random

    from poller.reader import RoutingOptions, StatsReader

    options = RoutingOptions()
    if cfg["policy"] in ("prefix-own", "prefix-shared"):
        options = RoutingOptions(share_placements=cfg["policy"] == "prefix-shared")
    reader = StatsReader.from_url(cfg["redis_url"], cfg["namespace"])
    try:
        async with reader.router(options, rng=random.Random(cfg["seed"])) as router:
            yield router
    finally:
        await reader.aclose()


async def serve(cfg: Mapping[str, Any], stop: asyncio.Event) -> None:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        gateway = _Gateway(cfg, http)
        async with _view(cfg) as router:
            gateway.router = router
            gateway.chooser = make_chooser(
                cfg["policy"],
                cfg["model"],
                cfg["candidates"],
                cfg["seed"],
                router=router,
                oracle=gateway.oracle,
            )
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_post("/v1/chat/completions", gateway.chat)
            app.router.add_get("/stats", gateway.stats)
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            try:
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                port = runner.addresses[0][1]
                ready = Path(cfg["ready"])
                tmp = ready.with_suffix(".tmp")
                tmp.write_text(str(port), encoding="utf-8")
                tmp.rename(ready)  # atomic: the bench never reads half a number
                await stop.wait()
            finally:
                await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m poller_lab.prefix.gateway CONFIG.json\n")
        return 2
    cfg = json.loads(Path(args[0]).read_text(encoding="utf-8"))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
