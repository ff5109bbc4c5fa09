"""Routing policies of the routing benchmark: a name -> factory registry.

A policy runs inside one gateway replica. For each request the replica awaits
``prepare()`` (the oracle reads the true queues there), times ``choose()`` (the CPU per
pick), sends the request to the endpoint chosen, and calls ``started``/``finished``
around it. ``choose`` returning None means "nowhere": the replica then sends to a random
endpoint configured for the model and counts a fallback.

Other modules add policies with ``register(name, factory, uses_view=...)``; a factory gets
the ``PolicyContext`` of its replica. Built in:

- ``round-robin``, ``random``: over the endpoints configured for the model, blind.
- ``pick-deterministic``: the reference choice ``pick`` made before the ``Picker``: skip
  stale, asleep and saturated endpoints, prefer those serving the model (else any), then
  fewest waiting, lowest KV usage, fewest running, lowest id. Every replica reading the
  same view makes the same choice: the herd the picker exists to avoid.
- ``picker``: the replica's ``Router`` (``reader.router()``: the README's gateway), each
  request a ticket from its pick to its end; ``picker-unshared``: the same with
  ``RoutingOptions(share=False)`` (each replica on its own counts and the pages).
- ``oracle``: the engines' true queues read at each request (the simulator's
  ``/admin/queue``), least expected time to finish: the limit any router could reach.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from poller.reader import Router, RoutingOptions, Ticket, View

__all__ = ["POLICIES", "UNDER_TEST", "Policy", "PolicyContext", "PolicyDef", "register"]

#: The policy the real-process family and the peers' bench judge: the README's gateway
#: (``picker`` below). To judge another gateway (the ``Router`` when it lands), register
#: it under this name: every cell, table and test follows.
UNDER_TEST = "picker"


@dataclass
class PolicyContext:
    """What a replica gives its policy."""

    model: str
    #: The endpoints the gateway is configured with for ``model`` (ids).
    candidates: list[str]
    rng: random.Random
    #: The replica's Router (``StatsReader.router``); None unless ``uses_view``.
    router: Router | None = None
    #: The true queues now: ``{id: {running, waiting, capacity, speed_tps, serving}}``.
    true_queues: Callable[[], Awaitable[Mapping[str, Mapping[str, Any]]]] | None = None
    #: Mean max_tokens of the requests (the oracle's service-time estimate).
    mean_tokens: float = 20.0
    #: The policy's options: ``RoutingOptions`` fields for the Router's policies.
    options: dict[str, Any] = field(default_factory=dict)
    #: Endpoint id -> base URL, and the bench's Redis (for policies that send themselves).
    urls: Mapping[str, str] = field(default_factory=dict)
    redis_url: str | None = None
    #: The gateway a policy sends through (``uses_envoy``: the cell's Envoy, whose
    #: ext_proc cluster holds one ``poller epp`` per replica).
    gateway_url: str | None = None


class Policy(Protocol):
    async def prepare(self) -> None: ...

    def choose(self) -> str | None: ...

    def started(self, endpoint_id: str) -> None: ...

    def finished(self, endpoint_id: str, ok: bool = True) -> None: ...


@dataclass(frozen=True)
class PolicyDef:
    factory: Callable[[PolicyContext], Policy]
    #: The replica opens a Router (``StatsReader.router``) for it, with these options.
    uses_view: bool = False
    #: The replica gives it the simulator's true queues.
    uses_oracle: bool = False
    #: Run when no policy is named (opt-in ones need an extra, e.g. LiteLLM's).
    default: bool = True
    #: ``RoutingOptions`` fields of the Router the replica opens (with ``uses_view``).
    options: Mapping[str, Any] = field(default_factory=dict)
    #: The bench starts an Envoy and one ``poller epp`` per replica for the cell, and the
    #: replicas send through that Envoy (routing/envoy_policy.py).
    uses_envoy: bool = False


POLICIES: dict[str, PolicyDef] = {}


def register(
    name: str,
    factory: Callable[[PolicyContext], Policy],
    *,
    uses_view: bool = False,
    uses_oracle: bool = False,
    default: bool = True,
    options: Mapping[str, Any] | None = None,
    uses_envoy: bool = False,
) -> None:
    """Add a policy (a later registration under the same name replaces it)."""
    POLICIES[name] = PolicyDef(
        factory, uses_view, uses_oracle, default, dict(options or {}), uses_envoy
    )


class _Base:
    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    async def prepare(self) -> None:
        return None

    def started(self, endpoint_id: str) -> None:
        return None

    def finished(self, endpoint_id: str, ok: bool = True) -> None:
        return None


class RoundRobin(_Base):
    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        # Replicas start at different places, as independent gateways would.
        start = ctx.rng.randrange(len(ctx.candidates))
        self._cycle = itertools.islice(itertools.cycle(ctx.candidates), start, None)

    def choose(self) -> str | None:
        return next(self._cycle)


class Random(_Base):
    def choose(self) -> str | None:
        return self.ctx.rng.choice(self.ctx.candidates)


class Deterministic(_Base):
    def __init__(self, ctx: PolicyContext, max_waiting: int = 5, max_kv: float = 0.8) -> None:
        super().__init__(ctx)
        self.max_waiting, self.max_kv = max_waiting, max_kv

    def choose(self) -> str | None:
        assert self.ctx.router is not None
        view: View = self.ctx.router.view()
        usable = []
        for e in view.endpoints.values():
            s = e.stats
            if e.state != "fresh" or s is None or s.sleeping:
                continue
            kv = s.kv_cache_usage
            if s.waiting >= self.max_waiting or (kv is not None and kv >= self.max_kv):
                continue
            usable.append((e.id, s))
        model = self.ctx.model
        serving = [
            (i, s)
            for i, s in usable
            if model in s.models or model in s.lora_running or model in s.lora_waiting
        ]
        usable = serving or usable
        if not usable:
            return None
        best = min(usable, key=lambda es: (es[1].waiting, es[1].kv_cache_usage or 0.0,
                                          es[1].running, es[0]))  # fmt: skip
        return best[0]


class Oracle(_Base):
    """Least expected time to finish on the true queues: waiting ahead of us drains at
    ``capacity`` requests per service time, then our own service time."""

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._queues: Mapping[str, Mapping[str, Any]] = {}

    async def prepare(self) -> None:
        assert self.ctx.true_queues is not None
        self._queues = await self.ctx.true_queues()

    def choose(self) -> str | None:
        best: tuple[float, str] | None = None
        for endpoint_id in self.ctx.candidates:
            q = self._queues.get(endpoint_id)
            if q is None or not q["serving"]:
                continue
            service_s = self.ctx.mean_tokens / q["speed_tps"]
            ahead = q["running"] + q["waiting"] + 1 - q["capacity"]
            cost = max(0, ahead) * service_s / q["capacity"] + service_s
            if best is None or cost < best[0]:
                best = (cost, endpoint_id)
        return None if best is None else best[1]


class RouterPolicy(_Base):
    """The replica's Router: each request a ticket from its pick to its end."""

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        # Tickets in flight per endpoint, oldest first: a request's end is reported by
        # its endpoint, and ends the oldest (as an end reported without a start would).
        self._open: dict[str, deque[Ticket]] = {}
        self._picked: Ticket | None = None

    def choose(self) -> str | None:
        router = self.ctx.router
        assert router is not None
        self._picked = ticket = router.pick(self.ctx.model)
        return None if ticket is None else ticket.id

    def started(self, endpoint_id: str) -> None:
        router = self.ctx.router
        assert router is not None
        ticket, self._picked = self._picked, None
        if ticket is None or ticket.id != endpoint_id:  # a fallback the replica chose
            if ticket is not None:
                ticket.done()
            ticket = router.track(endpoint_id)
        self._open.setdefault(endpoint_id, deque()).append(ticket)

    def finished(self, endpoint_id: str, ok: bool = True) -> None:
        queue = self._open.get(endpoint_id)
        if queue:  # as a gateway reports an error answer: ok=False
            queue.popleft().done(ok=ok)


def router_options(definition: PolicyDef, given: Mapping[str, Any]) -> RoutingOptions:
    """The options of a policy's Router: its own, then the bench's (``RoutingOptions``
    fields)."""
    return RoutingOptions(**{**definition.options, **given})


register("round-robin", RoundRobin)
register("random", Random)
register("pick-deterministic", Deterministic, uses_view=True)
register("picker", RouterPolicy, uses_view=True)
register("picker-unshared", RouterPolicy, uses_view=True, options={"share": False})
register("oracle", Oracle, uses_oracle=True)
