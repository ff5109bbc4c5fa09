"""When the exchange calls Redis (poller/reader/exchange/exchange.py): at once when this replica's
counts changed, while a token bucket allows, and at least every ``FLOOR_S`` otherwise.

The bucket holds ``BURST`` tokens and gains ``RATE_PER_S`` a second, so at most
``BURST + RATE_PER_S`` = 20 calls go out in any second per replica, whatever the request
rate: a replica whose requests start and end a few times a second sends each change at
once; a busier one sends them in batches about 60 ms apart.
"""

from __future__ import annotations

import math

from poller.reader.exchange.wire import REFRESH_BEFORE_MS, TTL_MS

__all__ = ["BURST", "FLOOR_S", "RATE_PER_S", "Pacer"]

#: The pacer's token bucket: changes go out at once while ``BURST`` tokens last, then at
#: ``RATE_PER_S``; at most ``BURST + RATE_PER_S`` = 20 calls in any second, per replica,
#: whatever the request rate.
BURST = 4
RATE_PER_S = 16.0
#: A call at least this often (s), changed or not: the replica kept alive and its record
#: renewed before their expiry (``TTL_MS - REFRESH_BEFORE_MS``), the placements and the
#: totals that moved read.
FLOOR_S = (TTL_MS - REFRESH_BEFORE_MS) / 1000


class Pacer:
    """When the exchange may call Redis: a token bucket (``burst`` calls at once, then
    ``rate`` a second) that a change of this replica's counts draws on at once, and a
    call at least every ``floor_s`` otherwise; after a failure, not before ``hold``."""

    def __init__(
        self, rate: float = RATE_PER_S, burst: int = BURST, floor_s: float = FLOOR_S
    ) -> None:
        self.rate, self.burst, self.floor_s = rate, float(burst), floor_s
        self.tokens = float(burst)
        self._at = -math.inf  # when ``tokens`` was last brought up to date
        self.last_call = -math.inf
        self.not_before = -math.inf

    def _fill(self, now: float) -> None:
        if now > self._at:
            self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
            self._at = now

    def next_call(self, now: float, urgent: bool) -> float:
        """The time of the next call: ``now`` or later (``urgent``: a change to send)."""
        self._fill(now)
        wanted = now if urgent else self.last_call + self.floor_s
        ready = now if self.tokens >= 1.0 else now + (1.0 - self.tokens) / self.rate
        return max(wanted, ready, self.not_before)

    def called(self, now: float) -> None:
        self._fill(now)
        self.tokens -= 1.0
        self.last_call = now

    def hold(self, until: float) -> None:
        self.not_before = until
