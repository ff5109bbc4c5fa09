"""One simulated endpoint's state: load, fault, hits, listener, and its cached page."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from typing import NamedTuple

from aiohttp import web

from poller.lab.sim.engines import ENGINES, iteration_stats, template_for
from poller.lab.sim.faults import Fault
from poller.lab.sim.model import EndpointLoad
from poller.lab.sim.spec import EndpointSpec
from poller.lab.sim.templates import render

__all__ = ["JSON", "SimEndpoint", "Snapshot"]

JSON = "application/json"


class Snapshot(NamedTuple):
    """The simulated truth of one endpoint, summed over ranks (KV usage: the max)."""

    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_hits: int
    prefix_cache_queries: int
    prompt_tokens: int
    request_success: int
    lora_running: tuple[str, ...]
    lora_waiting: tuple[str, ...]
    restarts: int
    step: int


class SimEndpoint:
    __slots__ = (
        "_body",
        "_body_key",
        "engine",
        "fail",
        "fault",
        "fault_since",
        "hit_times",
        "hits",
        "listener",
        "load",
        "port",
        "rng",
        "server",
        "spec",
        "wall_offset",
    )

    def __init__(
        self, spec: EndpointSpec, *, seed: int, t0: float, history: int, wall_offset: float
    ) -> None:
        self.spec = spec
        self.engine = ENGINES[spec.engine]
        self.load = EndpointLoad(
            spec.load_params(seed), seed=f"{seed}:{spec.id}", t0=t0, ranks=spec.dp, lora=spec.lora
        )
        #: Simulated (clock) seconds + wall_offset = Unix time, for timestamps on pages.
        self.wall_offset = wall_offset
        self.fault = Fault()
        self.fail = Fault()  # the failing half of a flap
        self.fault_since = 0.0
        self.hits = 0
        self.hit_times: deque[float] = deque(maxlen=history)
        self.rng = random.Random(f"{seed}:{spec.id}:faults")
        self.port = spec.port
        self.listener: asyncio.Server | None = None
        self.server: web.Server | None = None
        self._body_key: tuple[int, int, frozenset[str]] | None = None
        self._body = b""

    def current_fault(self, now: float) -> Fault:
        """The fault in force now: a flap resolves to ``ok`` or its failing half."""
        fault = self.fault
        if fault.mode != "flap":
            return fault
        phase = int((now - self.fault_since) // fault.params["period_s"]) % 2
        return self.fail if phase else Fault()

    def authorized(self, authorization: str | None) -> bool:
        key = self.spec.api_key
        return key is None or authorization == f"Bearer {key}"

    def page(self, now: float, drop: frozenset[str] = frozenset()) -> bytes:
        """The page now; rendered at most once per model step (and page shape)."""
        step = self.load.advance_to(now)
        key = (step, self.load.restarts, drop)
        if self._body_key != key:
            spec = self.spec
            model = spec.model if spec.model is not None else self.engine.model
            template = template_for(spec.engine, model, spec.dp, bool(spec.lora), drop)
            self._body, self._body_key = render(template, self.load, self.wall_offset), key
        return self._body

    def content(self, fault: Fault, as_json: bool, now: float) -> tuple[bytes, str]:
        """Body and content type for a healthy-looking answer under ``fault``."""
        if as_json or fault.mode == "json":
            self.load.advance_to(now)
            return iteration_stats(self.load, self.wall_offset), JSON
        drop: frozenset[str] = frozenset()
        if fault.mode == "missing":
            drop = frozenset(fault.params["metrics"] or self.engine.required)
        return self.page(now, drop), self.engine.content_type

    def snapshot(self, now: float) -> Snapshot:
        load = self.load
        load.advance_to(now)
        states = load.states
        latest = max(load.lora_seen.items(), key=lambda kv: kv[1])[0] if load.lora_seen else None

        def adapters(names: str) -> tuple[str, ...]:
            return tuple(a for a in names.split(",") if a)

        return Snapshot(
            running=sum(s.running for s in states),
            waiting=sum(s.waiting for s in states),
            kv_cache_usage=max(s.kv for s in states),
            prefix_cache_hits=sum(s.prefix_hits for s in states),
            prefix_cache_queries=sum(s.prefix_queries for s in states),
            prompt_tokens=sum(s.prompt_tokens for s in states),
            request_success=sum(s.success for s in states),
            lora_running=adapters(latest[0]) if latest else (),
            lora_waiting=adapters(latest[1]) if latest else (),
            restarts=load.restarts,
            step=load.step,
        )
