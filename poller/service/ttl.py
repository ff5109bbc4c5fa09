"""How long stats and failure records live: long enough that a takeover never shows
``unknown``.

When a poller dies, its endpoints' records are written again only once its lease has
lapsed, a survivor has noticed, acquired the lease and scraped. Readers see ``stale``
meanwhile, as long as the dead owner's last record outlives that gap; once it expires
they see ``unknown`` (nothing in Redis), which a gateway treats as "no data at all". So
the TTL is derived from the interval and the coordination settings rather than being a
bare multiple of the interval (3 intervals is 3 s at a 1 s interval, shorter than a
takeover there).
"""

from __future__ import annotations

from poller.config import CoordinationSettings

__all__ = ["TAKEOVER_MARGIN_MS", "stats_ttl_ms", "takeover_ms"]

#: Scheduling delays of a loaded machine, Redis round trips, the first run's spread.
TAKEOVER_MARGIN_MS = 500


def takeover_ms(interval_s: float, timeout_s: float, coordination: CoordinationSettings) -> int:
    """The longest a record may wait for its next write when its owner dies (SIGKILL):

    - the owner's last write is up to an interval plus a scrape old when it dies;
    - its lease lapses a lease TTL after its last renewal, its membership a member TTL
      after its last heartbeat (whichever is later decides);
    - a survivor notices at its next heartbeat and runs one coordination pass (counted
      as a whole reconcile interval; orphaned leases are retried within it);
    - the survivor's first scrape takes up to the timeout;
    - plus ``TAKEOVER_MARGIN_MS``.
    """
    c = coordination
    interval_ms = interval_s * 1000
    timeout_ms = timeout_s * 1000
    last_write_age_ms = interval_ms + timeout_ms
    lapse_ms = max(c.lease_ttl_ms, c.member_ttl_ms)
    notice_ms = c.heartbeat_interval_ms + c.reconcile_interval_ms
    return round(last_write_age_ms + lapse_ms + notice_ms + timeout_ms + TAKEOVER_MARGIN_MS)


def stats_ttl_ms(
    interval_s: float,
    timeout_s: float,
    coordination: CoordinationSettings,
    ttl_intervals: float,
) -> int:
    """``ttl_intervals`` intervals (``scrape.stats_ttl_intervals``), raised to
    ``takeover_ms`` where that is longer (short intervals)."""
    return max(
        round(interval_s * ttl_intervals * 1000), takeover_ms(interval_s, timeout_s, coordination)
    )
