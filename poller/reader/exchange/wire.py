"""The exchange's wire: how long what the gateway replicas share lasts and is trusted.

Each constant is a contract between replicas (the others read what one writes by them)
or between a replica and Redis; docs/schema.md gives the keys they apply to.
"""

from __future__ import annotations

__all__ = [
    "LOST_AFTER_MS",
    "PUBLISH_EVERY_MS",
    "READ_COUNT",
    "REFRESH_BEFORE_MS",
    "REFUSED_RETRY_S",
    "RETRY_S",
    "STREAM_MAXLEN",
    "TTL_MS",
]

#: How long a replica counts as alive after its last call (ms): one that dies leaves the
#: gateways' totals at the first call of another after this.
TTL_MS = 800
#: An unchanged record is rewritten when this much of its TTL is left (ms), so that its
#: field in ``P:gateways:inflight`` never shows as expired while the replica lives.
REFRESH_BEFORE_MS = 500
#: How long the exchange may go unanswered before the shared counts and placements are
#: no longer current (ms): this replica's own only from then on.
LOST_AFTER_MS = 1000
#: The share script publishes the gateways' totals at most once per window, every total
#: that moved since the last in one message; the window is this many ms with 64 live
#: replicas or more, less in proportion with fewer (1.25 ms with 8). Each replica hears
#: at most 200 messages a second (20 calls of each of 8 replicas, 1000 / 5 ms with 32,
#: 100 from 64 on), each of at most one total per endpoint, however many replicas write.
#: A change held by the window goes out with the next call after it.
PUBLISH_EVERY_MS = 10
#: The wait after a failed exchange call (seconds); the pacer spaces the others.
RETRY_S = 0.05
#: How often a refused exchange (no right to the key) is tried again (seconds).
REFUSED_RETRY_S = 5.0
#: Stream entries Redis keeps at most (approximate trim: up to a stream node, 100
#: entries, more); with ``ENTRY_MAX`` (poller/reader/prefix/outbox.py) ids of ~12.5
#: bytes each in Redis, the key stays under ~14 MB however many replicas write.
STREAM_MAXLEN = 1024
#: Entries one exchange call reads at most (a replica writes at most 20 a second, so 8
#: replicas at most 48 between two calls 300 ms apart, the slowest pace; a backlog is
#: caught up at 64 a call, so one call never absorbs more than ~64,000 ids).
READ_COUNT = 64
