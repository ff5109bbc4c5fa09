"""Answering one metrics request under the endpoint's fault mode.

Every path through here is cheap for ``ok`` (a cached page and one ``web.Response``);
the other modes exist to show a scraper each way an engine can fail on the wire.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_request import BaseRequest

from poller_lab.sim.endpoint import JSON, SimEndpoint
from poller_lab.sim.faults import Fault, garbage_body, padding_block
from poller_lab.sim.openai import (
    COMPLETION_PATHS,
    SLEEP_PATHS,
    BadRequest,
    error,
    models_reply,
    parse_request,
    reply,
    sleep_reply,
    version_reply,
)
from poller_lab.sim.serving import prompt_tokens

__all__ = ["Responder", "drop_connection"]

# llama.cpp's answer to a missing or wrong key (tools/server/server.cpp).
_UNAUTHORIZED = b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}'
_HEALTH_PATHS = ("/health", "/healthz")

Mode = Callable[[SimEndpoint, BaseRequest, Fault, bool, float], Awaitable[web.StreamResponse]]


class Responder:
    """Serves requests for any endpoint; ``stopping`` releases hung and slow ones."""

    def __init__(self, clock: Callable[[], float], stopping: asyncio.Event) -> None:
        self._clock = clock
        self._stopping = stopping
        self._padding = padding_block()
        self._modes: dict[str, Mode] = {
            "ok": self._page,
            "missing": self._page,
            "json": self._page,
            "down": self._drop,
            "refuse": self._drop,
            "slow": self._slow,
            "hang": self._hang,
            "drip": self._drip,
            "http500": self._status,
            "http401": self._status,
            "garbage": self._garbage,
            "oversized": self._oversized,
        }

    async def serve(self, ep: SimEndpoint, request: BaseRequest, path: str) -> web.StreamResponse:
        """Answer ``path`` (relative to the endpoint's base URL)."""
        engine = ep.engine
        if path == engine.text_path:
            as_json = False
        elif path == engine.json_path:
            as_json = True
        elif path in _HEALTH_PATHS:
            return web.Response(text="ok\n")
        elif path in COMPLETION_PATHS and request.method == "POST":
            return await self._complete(ep, request, path)
        elif path == "/v1/models":
            return web.json_response(models_reply(ep))
        elif path == "/version" and engine.owned_by == "vllm":
            return version_reply()
        elif path in SLEEP_PATHS and engine.name == "vllm":
            if (request.method == "GET") != (path == "/is_sleeping"):
                return web.Response(status=405, text="405 method not allowed\n")
            return sleep_reply(ep, path, dict(request.query))
        else:
            return web.Response(status=404, text="404 page not found\n")
        ep.hits += 1
        ep.hit_times.append(time.time())
        now = self._clock()
        fault = ep.current_fault(now)
        return await self._modes[fault.mode](ep, request, fault, as_json, now)

    async def _refusal(self, ep: SimEndpoint, request: BaseRequest) -> web.StreamResponse | None:
        """What a faulted or keyed endpoint answers a completion instead; None: serve it."""
        fault = ep.current_fault(self._clock())
        if fault.mode in ("down", "refuse", "hang"):
            if fault.mode == "hang":
                await self._stopping.wait()
            return drop_connection(request, reset=fault.mode == "refuse")
        if fault.mode in ("http500", "garbage"):
            return error(500, "the simulated engine is failing")
        if fault.mode == "http401" or not ep.authorized(request.headers.get("Authorization")):
            return error(401, "Invalid API Key")
        if fault.mode == "slow" and await self._pause(fault.params["delay_s"]):
            return drop_connection(request, reset=False)
        return None

    async def _complete(
        self, ep: SimEndpoint, request: BaseRequest, path: str
    ) -> web.StreamResponse:
        """One completion request, under the endpoint's fault and sleep state."""
        refusal = await self._refusal(ep, request)
        if refusal is not None:
            return refusal
        try:
            model, prompt, max_tokens, stream = parse_request(ep, path, await request.read())
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        if ep.sleep_level:
            return error(503, "The engine is sleeping (vLLM sleep mode); wake it up first.")
        ep.advance(self._clock())
        whole, first, last = reply(path, model, prompt_tokens(prompt), max_tokens)
        headers = {"x-sim-endpoint": ep.spec.id}
        if not stream:
            await ep.queue.serve(prompt, max_tokens)
            return web.json_response(whole, headers=headers)
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

        async def started() -> None:
            await response.prepare(request)
            for chunk in first:
                await response.write(chunk)

        try:
            await ep.queue.serve(prompt, max_tokens, on_start=started)
            for chunk in last:
                await response.write(chunk)
            await response.write_eof()
        except ConnectionError:
            pass  # the client hung up; its slot is already given back
        return response

    async def _page(
        self, ep: SimEndpoint, request: BaseRequest, fault: Fault, as_json: bool, now: float
    ) -> web.StreamResponse:
        if not ep.authorized(request.headers.get("Authorization")):
            return _unauthorized()
        body, content_type = ep.content(fault, as_json, now)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _drop(
        self, ep: SimEndpoint, request: BaseRequest, fault: Fault, as_json: bool, now: float
    ) -> web.StreamResponse:
        # Per-port endpoints never get here while down (their port is closed), except in
        # the failing half of a flap: lazily, the connection is dropped instead.
        return drop_connection(request, reset=fault.mode == "refuse")

    async def _slow(
        self, ep: SimEndpoint, request: BaseRequest, fault: Fault, as_json: bool, now: float
    ) -> web.StreamResponse:
        if await self._pause(fault.params["delay_s"]):
            return drop_connection(request, reset=False)
        return await self._page(ep, request, fault, as_json, self._clock())

    async def _hang(
        self, ep: SimEndpoint, request: BaseRequest, fault: Fault, as_json: bool, now: float
    ) -> web.StreamResponse:
        await self._stopping.wait()  # or cancelled when the client hangs up
        return drop_connection(request, reset=False)

    async def _status(
        self, ep: SimEndpoint, request: BaseRequest, fault: Fault, as_json: bool, now: float
    ) -> web.StreamResponse:
        if fault.mode == "http401":
            return _unauthorized()
        return web.Response(status=500, text="Internal Server Error\n")

    async def _garbage(
        self, ep: SimEndpoint, request: BaseRequest, fault: Fault, as_json: bool, now: float
    ) -> web.StreamResponse:
        body, content_type = garbage_body(ep.rng, fault.params["kind"], ep.hits)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _drip(
        self, ep: SimEndpoint, request: BaseRequest, fault: Fault, as_json: bool, now: float
    ) -> web.StreamResponse:
        if not ep.authorized(request.headers.get("Authorization")):
            return _unauthorized()
        body, content_type = ep.content(fault, as_json, now)
        response = web.StreamResponse(headers={"Content-Type": content_type})
        response.content_length = len(body)
        await response.prepare(request)
        step = fault.params["chunk_bytes"]
        try:
            for start in range(0, len(body), step):
                await response.write(body[start : start + step])
                if start + step < len(body) and await self._pause(fault.params["interval_s"]):
                    return drop_connection(request, reset=False)
        except ConnectionError:
            pass  # the client gave up; aiohttp sees the closed transport as well
        return response

    async def _oversized(
        self, ep: SimEndpoint, request: BaseRequest, fault: Fault, as_json: bool, now: float
    ) -> web.StreamResponse:
        if not ep.authorized(request.headers.get("Authorization")):
            return _unauthorized()
        page, content_type = ep.content(fault, as_json, now)
        block = self._padding
        target = int(fault.params["mb"] * 1024 * 1024)
        blocks = max(0, target - len(page)) // len(block) + 1  # strictly more than target
        response = web.StreamResponse(headers={"Content-Type": content_type})
        if fault.params["declare_length"]:
            response.content_length = len(page) + blocks * len(block)
        await response.prepare(request)
        try:
            await response.write(page)
            for _ in range(blocks):
                await response.write(block)  # the same bytes object: no copies made
        except ConnectionError:
            pass  # the scraper hit its body cap and hung up: the point of this fault
        return response

    async def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds``; True if the simulator began stopping meanwhile."""
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            return False
        return True


def _unauthorized() -> web.Response:
    return web.Response(status=401, body=_UNAUTHORIZED, headers={"Content-Type": JSON})


def drop_connection(request: BaseRequest, *, reset: bool) -> web.StreamResponse:
    """End the connection without a response: a FIN, or with ``reset`` an RST."""
    transport = request.transport
    if transport is not None:
        if reset:
            sock = transport.get_extra_info("socket")
            if sock is not None:  # linger 0 turns close() into a reset
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        request.protocol.force_close()
    # Never sent: aiohttp finds the transport closed and drops the response quietly.
    return web.Response(status=204)
