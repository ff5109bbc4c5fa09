"""One simulated endpoint's state: load, served requests, sleep, fault, hits, its page.

The page shows the background load and the served requests together, as they were
``metrics_lag_s`` ago: the served queue keeps its own history (``ServeQueue.at``), the
background's states are copied whenever the model steps (only when there is a lag).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from aiohttp import web

from poller_lab.sim.engines import ENGINES, iteration_stats, template_for
from poller_lab.sim.faults import Fault
from poller_lab.sim.model import EndpointLoad, RankState
from poller_lab.sim.serving import Hold, ServeQueue, ServeState
from poller_lab.sim.spec import EndpointSpec
from poller_lab.sim.templates import render

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
    sleep_level: int = 0


class SimEndpoint:
    __slots__ = (
        "_body",
        "_body_key",
        "_history",
        "_kv_blocks",
        "models",
        "queue",
        "sleep_level",
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
        self,
        spec: EndpointSpec,
        *,
        seed: int,
        t0: float,
        history: int,
        wall_offset: float,
        clock: Callable[[], float],
        hold: Hold = asyncio.sleep,
    ) -> None:
        self.spec = spec
        self.engine = ENGINES[spec.engine]
        params = spec.load_params(seed)
        self.load = EndpointLoad(
            params, seed=f"{seed}:{spec.id}", t0=t0, ranks=spec.dp, lora=spec.lora
        )
        self._kv_blocks = params.kv_blocks
        #: What requests may name: the page's model and the LoRA adapters.
        self.models = (spec.served_model, *spec.lora)
        self.queue = ServeQueue(
            params.capacity * spec.dp,
            spec.speed_tps,
            clock,
            busy=lambda: sum(s.running for s in self.load.states),
            hold=hold,
            kv_blocks=params.kv_blocks * spec.dp,
            prefill_tps=spec.prefill_tps,
        )
        self.sleep_level = 0
        #: (simulated time, step, background states) while there is a metrics lag.
        self._history: deque[tuple[float, int, list[RankState]]] = deque(maxlen=4096)
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
        self._body_key: tuple[object, ...] | None = None
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

    def advance(self, now: float) -> None:
        """Run the background up to ``now``; a freed slot may start a queued request."""
        before = self.load.step
        step = self.load.advance_to(now)
        if self.spec.metrics_lag_s and (step != before or not self._history):
            self._history.append((now, step, [replace(s) for s in self.load.states]))
        if step != before:
            self.queue.poke()

    def _shown(self, now: float, lagged: bool) -> tuple[int, list[RankState], ServeState]:
        """The background step and states, and the served queue, the page shows now."""
        self.advance(now)
        lag = self.spec.metrics_lag_s if lagged else 0.0
        if not lag:
            return self.load.step, self.load.states, self.queue.state
        t = now - lag
        history = self._history
        while len(history) > 1 and history[1][0] <= t:
            history.popleft()
        _, step, states = history[0]
        return step, states, self.queue.at(t)

    def shown_states(
        self, now: float, *, lagged: bool = True
    ) -> tuple[int, list[RankState], ServeState]:
        """Per-rank states as the page shows them (``lagged=False``: the truth now):
        background plus served requests, all zero while asleep."""
        step, states, served = self._shown(now, lagged)
        ranks = len(states)
        out = []
        for rank, s in enumerate(states):

            def share(total: int, rank: int = rank) -> int:
                return total // ranks + (1 if rank < total % ranks else 0)

            asleep = self.sleep_level > 0
            running = 0 if asleep else s.running + share(served.running)
            waiting = 0 if asleep else s.waiting + share(served.waiting)
            kv = 0.0 if asleep else self._kv(s, running, share(served.kv_tokens), served)
            out.append(
                replace(
                    s,
                    running=running,
                    waiting=waiting,
                    kv=round(kv, 4),
                    admitted=s.admitted + share(served.success + served.running),
                    prompt_tokens=s.prompt_tokens + share(served.prompt_tokens),
                    prefix_queries=s.prefix_queries + share(served.prefix_queries),
                    prefix_hits=s.prefix_hits + share(served.prefix_hits),
                    gen_tokens=s.gen_tokens + share(served.gen_tokens),
                    success_stop=s.success_stop + share(served.success),
                    sleep_level=self.sleep_level,
                )
            )
        return step, out, served

    def _kv(self, s: RankState, running: int, kv_tokens: int, served: ServeState) -> float:
        """One rank's KV usage as the spec's ``kv_usage`` counts it, at most 1.

        ``tokens``: the background's usage plus the running requests' prompt and
        ``max_tokens`` tokens over the pool. ``occupancy``: the blocks the running
        requests hold over a pool that a full batch fills to ``kv_fill``; free cached
        blocks do not count, as vLLM's gauge (vllm/v1/core/block_pool.py ``get_usage``:
        one less the free queue, which holds the evictable cached blocks, over the
        pool). ``cached``: the same, but every block the prefix cache holds counts too,
        idle or not, so a warm engine shows about 1.0 whatever runs."""
        spec = self.spec
        if spec.kv_usage == "tokens":
            return min(1.0, s.kv + kv_tokens / s.max_tokens)
        used = spec.kv_fill * running / s.capacity
        if spec.kv_usage == "cached":
            used = max(used, served.cached_blocks / max(1, self.queue.cache.capacity))
        return min(1.0, used)

    def reset_prefix_cache(self, now: float) -> None:
        """Drop every cached block; the prefix-cache counters start again from zero (the
        background's too), as a restarted engine's would."""
        self.advance(now)
        self.queue.reset_prefix_cache()
        for s in self.load.states:
            s.prefix_queries = s.prefix_hits = 0
            s.batch_hit_rate = 0.0
        self._body_key = None

    def page(self, now: float, drop: frozenset[str] = frozenset()) -> bytes:
        """The page now; rendered at most once per model step, served state (and shape)."""
        step, states, served = self._shown(now, True)
        key = (step, self.load.restarts, drop, served, self.sleep_level)
        if self._body_key != key:
            _, states, _ = self.shown_states(now)
            spec = self.spec
            template = template_for(
                spec.engine, spec.served_model, spec.dp, bool(spec.lora), drop, self._kv_blocks
            )
            self._body = render(template, self.load, self.wall_offset, states)
            self._body_key = key
        return self._body

    def content(self, fault: Fault, as_json: bool, now: float) -> tuple[bytes, str]:
        """Body and content type for a healthy-looking answer under ``fault``."""
        if as_json or fault.mode == "json":
            _, states, _ = self.shown_states(now)
            return iteration_stats(self.load, self.wall_offset, states), JSON
        drop: frozenset[str] = frozenset()
        if fault.mode == "missing":
            drop = frozenset(fault.params["metrics"] or self.engine.required)
        return self.page(now, drop), self.engine.content_type

    def snapshot(self, now: float) -> Snapshot:
        """The truth now (no lag): background and served requests together."""
        load = self.load
        _, states, _ = self.shown_states(now, lagged=False)
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
            sleep_level=self.sleep_level,
        )
