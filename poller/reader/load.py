"""What this replica itself sent: the load the shared view cannot show yet.

An engine's numbers in the view are as old as its last scrape (and engines' own
``/metrics`` trail their queues). The requests this replica started after that scrape
are missing from them; ``LocalLoad`` counts them so the picker can add them back.

    local = LocalLoad()
    target = picker.pick(cache, model=model, local=local)
    with local.track(target):
        await forward(request, target)
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["LocalLoad"]


class LocalLoad:
    """This replica's requests in flight, per endpoint, with the time each started.

    Times are ``clock()`` seconds (``time.monotonic`` by default; a test passes its own).
    The picker converts an endpoint's ``scraped_at_ms`` (Redis clock) into this clock
    with the view's clock offset and asks how many started after it.

    Thread safety: every method takes one lock (never held while calling out), so one
    ``LocalLoad`` may be shared by the threads of a threaded gateway and by the tasks of
    an event loop alike. Counts are exact; a pick that races a ``started`` may or may not
    see it, which only matters as much as a request that arrived a microsecond later.
    """

    __slots__ = ("_clock", "_lock", "_starts")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # endpoint id -> start times of the requests in flight, ascending (the clock is
        # monotonic, so appending keeps the order and bisect answers "since when").
        self._starts: dict[str, list[float]] = {}

    def started(self, endpoint_id: str) -> float:
        """A request to ``endpoint_id`` starts now; returns its start time, which
        ``finished`` accepts to end exactly this request."""
        now = self._clock()
        with self._lock:
            starts = self._starts.get(endpoint_id)
            if starts is None:
                self._starts[endpoint_id] = [now]
            elif starts[-1] <= now:
                starts.append(now)
            else:  # a clock that went back (a test's): keep the list sorted
                starts.insert(bisect_right(starts, now), now)
        return now

    def finished(self, endpoint_id: str, started_at: float | None = None) -> None:
        """A request to ``endpoint_id`` ended. Without ``started_at`` the oldest one in
        flight counts as ended: the newer ones, which the view is least likely to show,
        stay counted. An endpoint with nothing in flight is left alone (no error: a
        gateway's retry path may report an end twice)."""
        with self._lock:
            starts = self._starts.get(endpoint_id)
            if not starts:
                return
            if started_at is None:
                del starts[0]
            else:
                at = bisect_right(starts, started_at) - 1
                del starts[at if at >= 0 and starts[at] == started_at else 0]
            if not starts:
                del self._starts[endpoint_id]

    @contextmanager
    def track(self, endpoint_id: str) -> Iterator[None]:
        """Count one request to ``endpoint_id`` for the duration of the block."""
        started_at = self.started(endpoint_id)
        try:
            yield
        finally:
            self.finished(endpoint_id, started_at)

    def in_flight(self, endpoint_id: str) -> int:
        """This replica's requests to ``endpoint_id`` not finished yet."""
        starts = self._starts.get(endpoint_id)
        return 0 if starts is None else len(starts)

    def since(self, endpoint_id: str, since: float) -> int:
        """Requests in flight to ``endpoint_id`` that started after ``since`` (``clock``
        seconds): the ones a scrape at ``since`` cannot have counted."""
        with self._lock:
            starts = self._starts.get(endpoint_id)
            if not starts:
                return 0
            return len(starts) - bisect_right(starts, since)

    def now(self) -> float:
        return self._clock()

    def __repr__(self) -> str:
        with self._lock:
            total = sum(len(s) for s in self._starts.values())
        return f"LocalLoad({total} in flight to {len(self._starts)} endpoints)"
