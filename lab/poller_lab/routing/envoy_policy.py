"""Routing through Envoy and ``poller epp`` in the routing benchmark (opt-in).

``envoy-epp``: each replica sends its requests to the cell's Envoy (deploy/envoy/envoy.yaml
on the bench's ports), whose ext_proc cluster holds one ``poller epp`` per replica of the
cell, all active; the EPPs choose, Envoy sends, and the replica records the engine that
answered (the simulator's ``x-sim-endpoint``). run.py starts the EPPs and the Envoy for
each cell of this policy (``uses_envoy``); the engines get a port each, since Envoy
dials addresses. The choice's CPU is the EPP's, not the replica's: recorded as 0.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from poller_lab.routing.policies import Policy, PolicyContext, register

__all__ = ["EnvoyPolicy"]


class EnvoyPolicy:
    def __init__(self, ctx: PolicyContext) -> None:
        if ctx.gateway_url is None:
            raise ValueError("envoy-epp needs the cell's Envoy (gateway_url)")
        self.url = ctx.gateway_url + "/v1/chat/completions"
        self.http: aiohttp.ClientSession | None = None

    async def prepare(self) -> None:
        return None

    async def warm_up(self) -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        self.http = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    def choose(self) -> str | None:
        raise NotImplementedError("the replica calls send(): the EPP chooses, Envoy sends")

    def started(self, endpoint_id: str) -> None:
        return None

    def finished(self, endpoint_id: str, ok: bool = True) -> None:
        return None

    async def send(self, body: Mapping[str, Any]) -> tuple[str | None, int, float, int]:
        assert self.http is not None
        t0 = time.monotonic()
        try:
            async with self.http.post(self.url, json=dict(body)) as response:
                await response.read()
                status, chosen = response.status, response.headers.get("x-sim-endpoint")
        except (aiohttp.ClientError, TimeoutError):
            status, chosen = 0, None
        return chosen, status, time.monotonic() - t0, 0


def _factory(ctx: PolicyContext) -> Policy:
    return EnvoyPolicy(ctx)


register("envoy-epp", _factory, default=False, uses_envoy=True)
