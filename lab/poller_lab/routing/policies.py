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
- ``picker-nolocal``, ``picker``: ``poller.reader.Picker`` on the cache, without and with
  ``LocalLoad`` (this replica's requests since each endpoint's last scrape).
- ``oracle``: the engines' true queues read at each request (the simulator's
  ``/admin/queue``), least expected time to finish: the limit any router could reach.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from poller.reader import LocalLoad, Picker
from poller.reader.cache import ViewCache
from poller.reader.view import View

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
    #: The replica's view cache (``StatsReader.cached``); None unless ``uses_view``.
    cache: ViewCache | None = None
    #: The true queues now: ``{id: {running, waiting, capacity, speed_tps, serving}}``.
    true_queues: Callable[[], Awaitable[Mapping[str, Mapping[str, Any]]]] | None = None
    #: Mean max_tokens of the requests (the oracle's service-time estimate).
    mean_tokens: float = 20.0
    options: dict[str, Any] = field(default_factory=dict)
    #: Endpoint id -> base URL, and the bench's Redis (for policies that send themselves).
    urls: Mapping[str, str] = field(default_factory=dict)
    redis_url: str | None = None


class Policy(Protocol):
    async def prepare(self) -> None: ...

    def choose(self) -> str | None: ...

    def started(self, endpoint_id: str) -> None: ...

    def finished(self, endpoint_id: str, ok: bool = True) -> None: ...


@dataclass(frozen=True)
class PolicyDef:
    factory: Callable[[PolicyContext], Policy]
    #: The replica keeps a cached view (``StatsReader.cached``) for it.
    uses_view: bool = False
    #: The replica gives it the simulator's true queues.
    uses_oracle: bool = False
    #: Run when no policy is named (opt-in ones need an extra, e.g. LiteLLM's).
    default: bool = True


POLICIES: dict[str, PolicyDef] = {}


def register(
    name: str,
    factory: Callable[[PolicyContext], Policy],
    *,
    uses_view: bool = False,
    uses_oracle: bool = False,
    default: bool = True,
) -> None:
    """Add a policy (a later registration under the same name replaces it)."""
    POLICIES[name] = PolicyDef(factory, uses_view, uses_oracle, default)


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
        assert self.ctx.cache is not None
        view: View = self.ctx.cache.view()
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


def _picker(local: bool) -> Callable[[PolicyContext], Policy]:
    def factory(ctx: PolicyContext) -> Policy:
        return _PickerPolicy(ctx, local)

    return factory


class _PickerPolicy(_Base):
    def __init__(self, ctx: PolicyContext, local: bool) -> None:
        super().__init__(ctx)
        self.picker = Picker(rng=ctx.rng, **ctx.options)
        self.local = LocalLoad() if local else None

    def choose(self) -> str | None:
        assert self.ctx.cache is not None
        return self.picker.pick(self.ctx.cache, self.ctx.model, local=self.local)

    def started(self, endpoint_id: str) -> None:
        if self.local is not None:
            self.local.started(endpoint_id)

    def finished(self, endpoint_id: str, ok: bool = True) -> None:
        if self.local is not None:  # as a gateway reports an error answer: ok=False
            self.local.finished(endpoint_id, ok=ok)


register("round-robin", RoundRobin)
register("random", Random)
register("pick-deterministic", Deterministic, uses_view=True)
register("picker-nolocal", _picker(local=False), uses_view=True)
register("picker", _picker(local=True), uses_view=True)
register("oracle", Oracle, uses_oracle=True)
