"""How a gateway of the prefix benchmark chooses an engine for one chat request.

- ``round-robin``: over the engines configured for the model, blind.
- ``picker``: the gateway's ``Router`` (``reader.router()``), no prompt (load only).
- ``prefix-own``: the Router given the request's prompt (``poller.reader.prompt_of`` of
  its messages), its placements this gateway's own
  (``RoutingOptions(share_placements=False)``).
- ``prefix-shared``: the same with the placements every gateway shares through Redis.
- ``envoy-epp``: none in the gateway: it sends the request to one Envoy, which asks one
  of the ``poller epp`` replicas (one per gateway, sharing placements through Redis as
  ``prefix-shared`` gateways do) and sends it where that replica says (gateway.py).
- ``oracle``: per request, the simulator's ``POST /admin/prefix`` (every engine's true
  queue and the prompt's cached tokens there), then the least expected time to first
  token: the wait for a slot (requests ahead beyond the free slots, drained at
  ``capacity`` per mean service time) plus the prefill of the tokens not cached.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

__all__ = ["Chooser", "make_chooser", "oracle_choice"]


def oracle_choice(answer: Mapping[str, Any], max_tokens: int) -> str | None:
    """The least expected time to first token on the simulator's ``/admin/prefix`` answer."""
    tokens = answer["prompt_tokens"]
    best: tuple[float, str] | None = None
    for endpoint_id, e in sorted(answer["endpoints"].items()):
        if not e["serving"]:
            continue
        decode_s = max_tokens / e["speed_tps"]
        service_s = e["mean_service_s"] or decode_s
        ahead = e["running"] + e["waiting"] + 1 - e["capacity"]
        wait_s = max(0, ahead) * service_s / e["capacity"]
        prefill_tps = e["prefill_tps"]
        prefill_s = (tokens - e["cached_tokens"]) / prefill_tps if prefill_tps else 0.0
        cost = wait_s + prefill_s
        if best is None or cost < best[0]:
            best = (cost, endpoint_id)
    return None if best is None else best[1]


class Chooser:
    """One gateway's policy: ``choose`` per request, ``started``/``finished`` around it."""

    def __init__(
        self,
        policy: str,
        model: str,
        candidates: Sequence[str],
        rng: random.Random,
        *,
        router: Any = None,
        oracle: Callable[[dict[str, Any]], Awaitable[Mapping[str, Any]]] | None = None,
    ) -> None:
        from poller.reader import prompt_of

        self.policy, self.model, self.candidates = policy, model, list(candidates)
        self.router, self.oracle = router, oracle
        self.prompt_of = prompt_of
        self._picked: Any = None  # the Router's ticket of the last choice
        start = rng.randrange(len(self.candidates))
        self._cycle = itertools.islice(itertools.cycle(self.candidates), start, None)
        self.rng = rng

    async def choose(self, body: Mapping[str, Any]) -> tuple[str | None, int]:
        """(endpoint or None: nowhere, CPU ns the pick took on this thread)."""
        import time

        chosen: str | None
        if self.policy == "oracle":
            assert self.oracle is not None
            answer = await self.oracle({"messages": body["messages"], "model": self.model})
            t0 = time.thread_time_ns()
            chosen = oracle_choice(answer, int(body.get("max_tokens") or 16))
            return chosen, time.thread_time_ns() - t0
        t0 = time.thread_time_ns()
        if self.policy == "round-robin":
            chosen = next(self._cycle)
        else:
            prompt = None if self.policy == "picker" else self.prompt_of(body["messages"])
            self._picked = ticket = self.router.pick(self.model, prompt=prompt)
            chosen = None if ticket is None else ticket.id
        return chosen, time.thread_time_ns() - t0

    def started(self, endpoint_id: str) -> Any:
        """What ``finished`` ends: the pick's ticket (None without a Router)."""
        ticket, self._picked = self._picked, None
        if ticket is not None and ticket.id != endpoint_id:
            ticket.done()
            ticket = self.router.track(endpoint_id)
        return ticket

    def finished(self, endpoint_id: str, ticket: Any, ok: bool) -> None:
        if ticket is not None:
            ticket.done(ok=ok)


def make_chooser(
    policy: str,
    model: str,
    candidates: Sequence[str],
    seed: int,
    router: Any = None,
    oracle: Callable[[dict[str, Any]], Awaitable[Mapping[str, Any]]] | None = None,
) -> Chooser:
    return Chooser(policy, model, candidates, random.Random(seed), router=router, oracle=oracle)
