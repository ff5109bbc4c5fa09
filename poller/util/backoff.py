"""One retry backoff for every loop that talks to Redis (worker, events, readers).

Capped exponential backoff with "equal" jitter: each wait is drawn uniformly between half
and all of the capped exponential step, so retries spread out but never come back sooner
than half the step (full jitter would allow 0). The cap is a third of the member TTL: a
poller that backs off longer than its membership lives drops out of the fleet during a
Redis blip of a couple of seconds, and every poller would do so at once.
"""

from __future__ import annotations

import random

__all__ = ["DEFAULT_CAP_S", "backoff_s", "member_ttl_cap_s"]

#: A third of the default member TTL (2 s): what readers use when they know no TTL.
DEFAULT_CAP_S = 2.0 / 3


def backoff_s(failures: int, *, base_s: float = 0.1, cap_s: float = DEFAULT_CAP_S) -> float:
    """Seconds to wait after ``failures`` consecutive failures (>= 1), jittered in
    [half, all] of ``min(cap_s, base_s * 2**failures)`` so a fleet does not stampede."""
    ceiling: float = min(cap_s, base_s * 2.0 ** min(max(failures, 0), 16))
    return ceiling * random.uniform(0.5, 1.0)


def member_ttl_cap_s(member_ttl_ms: int) -> float:
    """The cap for a poller's loops: a third of its member TTL."""
    return member_ttl_ms / 3000
