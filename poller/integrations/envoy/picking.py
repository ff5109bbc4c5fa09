"""One pick for Envoy: the Router's choice as the addresses Envoy dials, or the refusal
the client gets (``Picking.choose``).

A refusal maps the Router's ``Refusal`` to the protocol's answers: nothing routable,
nothing serving the model, nothing fresh: 503; every endpoint saturated with
``when_saturated="none"``: 429 with ``Retry-After`` (the protocol's shed). The subset
hint narrows the candidates; naming nothing registered is a 503 too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from poller.integrations.envoy import messages
from poller.integrations.envoy.destinations import Destinations
from poller.integrations.envoy.metrics import EppMetrics
from poller.reader import Router, Ticket

__all__ = ["Choice", "Picking"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Choice:
    """A routed request: its ticket and the header's value (the primary, then the
    fallbacks when asked for, ``ip:port,ip:port``)."""

    ticket: Ticket
    destination: str


class Picking:
    """What every stream of one EPP shares: the Router, the addresses, the settings."""

    def __init__(
        self,
        router: Router,
        destinations: Destinations,
        metrics: EppMetrics,
        *,
        fallbacks: int = 0,
        retry_after_s: int = 1,
        max_body_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.router = router
        self.destinations = destinations
        self.metrics = metrics
        self.fallbacks = fallbacks
        self.retry_after_s = retry_after_s
        self.max_body_bytes = max_body_bytes

    def choose(
        self, model: str | None, prompt: str | None, subset: list[str] | None
    ) -> Choice | Any:
        """A ``Choice``, or the ``ImmediateResponse`` message that refuses the request."""
        started = time.perf_counter()
        where = self.destinations
        where.refresh()
        candidates = None
        if subset is not None:
            candidates = where.ids_in(subset)
            if not candidates:
                shown = ", ".join(subset)[:200] or "nothing"
                return self.refuse(503, "no_endpoint", f"the subset hint names no endpoint "
                                   f"registered here ({shown})")  # fmt: skip
        elif not where.complete:
            candidates = where.routable
        ticket = self.router.pick(
            model, prompt=prompt, candidates=candidates, fallbacks=self.fallbacks
        )
        address = None if ticket is None else where.address(ticket.id)
        if ticket is None or address is None:
            if ticket is not None:  # its address went away since the candidates were read
                ticket.cancel()
            return self._refusal(model, candidates)
        addresses = [address]
        for other in ticket.fallbacks:
            found = where.address(other)
            if found is not None:
                addresses.append(found)
        self.metrics.requests.labels("routed").inc()
        self.metrics.pick.observe(time.perf_counter() - started)
        return Choice(ticket, ",".join(addresses))

    def _refusal(self, model: str | None, candidates: list[str] | None) -> Any:
        reason, detail = self.router.explain(model, candidates=candidates)
        if reason == "saturated":
            return self.refuse(429, reason, detail, retry_after_s=self.retry_after_s)
        if not reason:  # the view changed between the pick and the question
            reason, detail = "not_fresh", "no endpoint could take the request just now"
        return self.refuse(503, reason, detail)

    def refuse(
        self, status: int, reason: str, detail: str, *, retry_after_s: int | None = None
    ) -> Any:
        self.metrics.requests.labels(reason).inc()
        log.debug("refused with %s: %s", status, detail)
        return messages.immediate(status, reason, detail, retry_after_s)
