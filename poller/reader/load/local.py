"""What this replica itself sent: the load the shared view cannot show yet.

An engine's numbers in the view are as old as its last scrape (and engines' own
``/metrics`` trail their queues). The requests this replica started after that scrape
are missing from them; ``LocalLoad`` counts them so the picker can add them back. It
also times them: how long requests to an endpoint took lately tells what no page says,
an engine slower than its size, or a queue grown since the scrape (``slowness``).

A ``Router`` keeps one (``router.local``) and counts each ticket in it from the pick to
the ticket's end; ``track`` counts a block by hand.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["LocalLoad"]

#: Weight of one request's time in the moving averages (about the last 10 requests).
LATENCY_ALPHA = 0.1
#: An endpoint's slowness fades back to neutral over this many seconds without a sample,
#: so one bad spell does not keep it out for good.
LATENCY_FADE_S = 10.0
#: Bounds of ``slowness``: one endpoint's times must not decide everything.
SLOWNESS_MIN, SLOWNESS_MAX = 0.25, 8.0
#: A failed request counts as this many times the usual request time.
FAILED_TIMES = 4.0
#: An endpoint whose requests all failed lately counts as this many times as loaded on
#: the fleet's shared counts (``failing``): as many as the slowest ``slowness``.
FAILING_MAX = 8.0
#: Weight of one request's outcome in the moving share of failures: three failures in a
#: row make an endpoint more than half failing.
FAILED_ALPHA = 0.25
#: Finished requests are remembered this long (s), so the load at a page's scrape time
#: can be told (``in_flight_at``); at most ``DONE_MAX`` per endpoint.
DONE_S, DONE_MAX = 10.0, 4096
#: What is known of an endpoint with nothing in flight is forgotten once it has faded
#: this long (its slowness and failures are then within 0.3 % of neutral), so endpoints
#: that come and go (a rollout's new addresses) cost no memory for good; looked over
#: every ``DONE_S``.
FORGET_S = 6 * LATENCY_FADE_S


def clamp(value: float, low: float, high: float) -> float:
    """``min(high, max(low, value))``, as the builtins give it (NaN included), without
    their calls: a pick clamps once per pick and once per endpoint it scores, and the
    two builtins cost ten times this comparison."""
    value = value if value > low else low
    return value if value < high else high


class LocalLoad:
    """This replica's requests in flight, per endpoint, with the time each started.

    Times are ``clock()`` seconds (``time.monotonic`` by default; a test passes its own).
    The picker converts an endpoint's ``scraped_at_ms`` (Redis clock) into this clock
    with the view's clock offset and asks how many started after it.

    Thread safety: the methods that change it (``started``, ``finished``, ``track``)
    take one lock (never held while calling out), so one ``LocalLoad`` may be shared by
    the threads of a threaded gateway and by the tasks of an event loop alike; counts
    are exact. The reads a pick makes (``since``, ``in_flight``, ``total``,
    ``slowness``, ``now``) take no lock: each is one read of a dict entry or a list,
    atomic under the GIL, so a pick never waits for a request's bookkeeping. A pick that
    races a ``started`` may or may not see it, which only matters as much as a request
    that arrived a microsecond later.
    """

    __slots__ = (
        "__weakref__",
        "_all_s",
        "_changed",
        "_clock",
        "_done",
        "_failed",
        "_lock",
        "_next_sweep",
        "_starts",
        "_took",
        "_total",
        "_waker",
    )

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # endpoint id -> start times of the requests in flight, ascending (the clock is
        # monotonic, so appending keeps the order and bisect answers "since when").
        self._starts: dict[str, list[float]] = {}
        self._total = 0
        # endpoint id -> (moving average of its requests' time, s; when last updated)
        self._took: dict[str, tuple[float, float]] = {}
        self._all_s = 0.0  # the same over every endpoint (0: no request ended yet)
        # endpoint id -> (moving share of its requests that failed, when last updated);
        # only endpoints that failed at least once
        self._failed: dict[str, tuple[float, float]] = {}
        # endpoint id -> (start, end) of requests finished lately, in the order they ended
        self._done: dict[str, deque[tuple[float, float]]] = {}
        # Endpoints with a request started or ended since ``take_changed`` last ran.
        self._changed: set[str] = set()
        self._next_sweep = clock() + DONE_S
        # Called (no arguments, outside the lock) at the first change since the last
        # ``take_changed``: the shared counts' exchange wakes to publish it (``wake_on``).
        self._waker: Callable[[], None] | None = None

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
            self._total += 1
            first = not self._changed
            self._changed.add(endpoint_id)
        if first and self._waker is not None:
            self._waker()  # the exchange publishes the change (at most once per call)
        return now

    def finished(
        self,
        endpoint_id: str,
        started_at: float | None = None,
        *,
        ok: bool = True,
        sent: bool = True,
    ) -> None:
        """A request to ``endpoint_id`` ended. Without ``started_at`` the oldest one in
        flight counts as ended: the newer ones, which the view is least likely to show,
        stay counted. An end reported twice (a gateway's retry path may) is no error and
        ends nothing more: an endpoint with nothing in flight is left alone, and a
        ``started_at`` of a request already ended (within ``DONE_S``) is ignored (a
        request is told by its start time: where the clock gave two requests on one
        endpoint the same reading, a coarse clock, an end reported twice ends both); an
        unknown ``started_at`` ends the oldest, as without one. ``ok=False`` (an error answer,
        a broken connection) counts the request as taking ``FAILED_TIMES`` the usual
        time: an endpoint that fails fast must not look fast until the view shows it
        failing. ``sent=False``: the request never went out; it stops counting and its
        time says nothing of the endpoint (neither speed nor failure)."""
        now = self._clock()
        with self._lock:
            starts = self._starts.get(endpoint_id)
            if not starts:
                return
            if started_at is None:
                began = starts.pop(0)
            else:
                at = bisect_right(starts, started_at) - 1
                if at < 0 or starts[at] != started_at:
                    ended = self._done.get(endpoint_id)
                    if ended is not None and any(b == started_at for b, _ in ended):
                        return  # this request's end, reported again
                    at = 0
                began = starts.pop(at)
            self._total -= 1
            first = not self._changed
            self._changed.add(endpoint_id)
            if not starts:
                del self._starts[endpoint_id]
            done = self._done.get(endpoint_id)
            if done is None:
                done = self._done[endpoint_id] = deque(maxlen=DONE_MAX)
            done.append((began, now))
            while done and done[0][1] < now - DONE_S:
                done.popleft()
            if sent:  # a request never sent says nothing of the endpoint
                self._learn(endpoint_id, max(0.0, now - began), now, ok)
            if now >= self._next_sweep:
                self._sweep(now)
        if first and self._waker is not None:
            self._waker()

    def _learn(self, endpoint_id: str, took_s: float, now: float, ok: bool) -> None:
        """What a request that ended says: the usual time, the endpoint's time and its
        failure share (under the lock)."""
        every = self._all_s
        if ok:  # the usual time is of answers: a failure's penalty must not feed it
            self._all_s = took_s if every == 0.0 else every + LATENCY_ALPHA * (took_s - every)
        else:
            took_s = max(took_s, every) * FAILED_TIMES
        self._took_s(endpoint_id, took_s, now)
        failed = self._failed.get(endpoint_id)
        if failed is not None or not ok:
            share = 0.0 if failed is None else failed[0]
            self._failed[endpoint_id] = (share + FAILED_ALPHA * ((not ok) - share), now)

    def _sweep(self, now: float) -> None:
        """Forget the endpoints with nothing in flight whose record is past ``DONE_S``
        and whose times and failures have faded for ``FORGET_S`` (under the lock)."""
        self._next_sweep = now + DONE_S
        busy = self._starts
        for endpoint_id, done in list(self._done.items()):
            if endpoint_id not in busy and (not done or done[-1][1] < now - DONE_S):
                del self._done[endpoint_id]
        for table in (self._took, self._failed):
            for endpoint_id, (_, at) in list(table.items()):
                if endpoint_id not in busy and at < now - FORGET_S:
                    del table[endpoint_id]
        if self._waker is None:  # no exchange takes the changes: keep the live ones only
            self._changed &= busy.keys() | self._done.keys()

    def _took_s(self, endpoint_id: str, took_s: float, now: float) -> None:
        held = self._took.get(endpoint_id)
        mean = took_s if held is None else held[0] + LATENCY_ALPHA * (took_s - held[0])
        self._took[endpoint_id] = (mean, now)

    @property
    def request_s(self) -> float:
        """How long this replica's requests took lately (a moving average over every
        endpoint, queueing included, of the requests answered ``ok``), seconds; 0 before
        one was."""
        return self._all_s

    def slowness(self, endpoint_id: str, now: float | None = None) -> float:
        """How long this replica's requests to ``endpoint_id`` took lately over how long
        its requests took anywhere (moving averages; queueing included): 1 when unknown,
        fading back to 1 over ``LATENCY_FADE_S`` without news. It tells what no
        engine's page does: a slow engine, or a queue that grew since the scrape."""
        held, every = self._took.get(endpoint_id), self._all_s
        if held is None or every <= 0.0:
            return 1.0
        mean, at = held
        now = self._clock() if now is None else now
        quiet_s = now - at
        fade = math.exp(-quiet_s / LATENCY_FADE_S) if quiet_s > 0.0 else 1.0
        ratio = 1.0 + (mean / every - 1.0) * fade
        return clamp(ratio, SLOWNESS_MIN, SLOWNESS_MAX)

    def failing(self, endpoint_id: str, now: float | None = None) -> float:
        """The share of this replica's requests to ``endpoint_id`` that failed lately
        (a moving average, 0 to 1), fading to 0 over ``LATENCY_FADE_S`` without news:
        an engine that answers errors fast is not idle."""
        held = self._failed.get(endpoint_id)
        if held is None:
            return 0.0
        share, at = held
        now = self._clock() if now is None else now
        quiet_s = now - at
        return share * math.exp(-quiet_s / LATENCY_FADE_S) if quiet_s > 0.0 else share

    @contextmanager
    def track(self, endpoint_id: str) -> Iterator[None]:
        """Count one request to ``endpoint_id`` for the duration of the block (an
        exception out of it counts as a failed request, a cancellation does not)."""
        started_at = self.started(endpoint_id)
        failed = False
        try:
            yield
        except Exception:  # not a cancellation: a client that left is no engine's fault
            failed = True
            raise
        finally:
            self.finished(endpoint_id, started_at, ok=not failed)

    def in_flight(self, endpoint_id: str) -> int:
        """This replica's requests to ``endpoint_id`` not finished yet."""
        starts = self._starts.get(endpoint_id)
        return 0 if starts is None else len(starts)

    def total(self) -> int:
        """This replica's requests in flight to all endpoints."""
        return self._total

    def since(self, endpoint_id: str, since: float) -> int:
        """Requests in flight to ``endpoint_id`` that started after ``since`` (``clock``
        seconds): the ones a scrape at ``since`` cannot have counted. No lock: a read of
        a list that another thread changes meanwhile is off by that one request at most."""
        starts = self._starts.get(endpoint_id)
        if not starts:
            return 0
        return len(starts) - bisect_right(starts, since)

    def in_flight_at(self, endpoint_id: str, at: float) -> int:
        """Requests to ``endpoint_id`` that were in flight at ``at`` (``clock`` seconds,
        up to ``DONE_S`` ago): what a page scraped then counted of this replica's."""
        starts = self._starts.get(endpoint_id)
        count = 0 if not starts else bisect_right(starts, at)
        done = self._done.get(endpoint_id)
        if done:
            # From the newest end back to the first that ended by ``at``: the work is the
            # requests that ended since, not the whole record (indexing near a deque's
            # ends is O(1)).
            try:
                for j in range(len(done) - 1, -1, -1):
                    began, ended = done[j]
                    if ended <= at:
                        break
                    if began <= at:
                        count += 1
            except IndexError:  # another thread trimmed it meanwhile: what was read counts
                pass
        return count

    def wake_on(self, waker: Callable[[], None] | None) -> Callable[[], None] | None:
        """Call ``waker`` at the first change after each ``take_changed`` (None: no
        longer); returns the one it replaces. The fleet's shared counts set it."""
        held, self._waker = self._waker, waker
        return held

    def take_changed(self) -> set[str]:
        """Endpoints a request to which started or ended since the last call (the
        shared counts' exchange works on those only)."""
        with self._lock:
            changed, self._changed = self._changed, set()
        return changed

    def has_changed(self) -> bool:
        """A request started or ended since ``take_changed`` last ran."""
        return bool(self._changed)

    def busy_ids(self) -> list[str]:
        """Endpoints with requests in flight or finished within ``DONE_S``."""
        now = self._clock()
        ids = list(self._starts)
        for endpoint_id, done in list(self._done.items()):
            if done and done[-1][1] >= now - DONE_S:
                if endpoint_id not in self._starts:
                    ids.append(endpoint_id)
        return ids

    def now(self) -> float:
        return self._clock()

    def __repr__(self) -> str:
        with self._lock:
            total = sum(len(s) for s in self._starts.values())
        return f"LocalLoad({total} in flight to {len(self._starts)} endpoints)"
