"""This poller's side of a drain.

A drain is requested in Redis (``P:members:drain``): by ``poller drain ID``, or by the
poller itself when it gets SIGUSR1. Every heartbeat reports which live members drain, and
rendezvous gives them nothing, so the drained poller releases its leases (the others
take them at once) and acquires none, while its health port keeps answering.
"""

from __future__ import annotations

from collections.abc import Callable

from poller.service.coordinator import Coordinator
from poller.store.members import request_drain
from poller.store.store import RedisStore

__all__ = ["Drain"]


class Drain:
    def __init__(
        self, store: RedisStore, coordinator: Coordinator, wake: Callable[[], None]
    ) -> None:
        self.store = store
        self.coordinator = coordinator
        self._wake = wake
        self.asked = False  # SIGUSR1 came: write the request at the next pass

    @property
    def active(self) -> bool:
        """A drain of this poller is requested (as of the last heartbeat)."""
        return self.coordinator.poller_id in self.coordinator.draining

    def request(self) -> None:
        """SIGUSR1: the request goes to Redis at the next pass, so every poller and
        ``poller status`` see it, and ``poller drain ID --undo`` ends it."""
        self.asked = True
        self._wake()

    async def write_request(self) -> bool:
        """True once the request is in Redis (we may not be a live member yet); a pass
        follows at once, whose heartbeat sees it."""
        store, poller_id = self.store, self.coordinator.poller_id
        outcome = await request_drain(store.client, store.keys, poller_id, "signal")
        if outcome == "not live":
            return False
        self.asked = False
        self._wake()
        return True
