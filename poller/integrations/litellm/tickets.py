"""Every request a strategy routes is counted by its Router from the pick until it ends,
exactly once, however it ends.

Each attempt holds the Router's ticket (``router.pick``, or ``router.track`` for a
deployment LiteLLM chose itself). It ends at the first of:

- LiteLLM's success or failure callback for that attempt (matched by the request's
  ``litellm_trace_id`` and the deployment's id; a retry to the same deployment queues
  behind the first); a failure is counted as one (``ticket.done(ok=False)``: an engine
  that answers errors at once must not look idle);
- the end of the asyncio task that picked it, unless the ticket is a stream the task
  handed on (its callback closes it, when the stream ends): this covers a cancelled
  request, and an attempt that failed before LiteLLM logged anything (a pre-call check);
- ``max_open_s`` after it opened (an abandoned stream no callback reports), counted in
  ``abandoned_total``.

Closing twice is a no-op, so the callbacks that overlap these never count an end twice.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from poller.reader.ticket import Ticket

__all__ = ["Attempt", "Tickets"]

log = logging.getLogger("poller.integrations.litellm")

Key = tuple[str, str]  # (litellm_trace_id, deployment id)


@dataclass(slots=True, eq=False)
class Attempt:
    """One attempt LiteLLM makes: its deployment's Router ticket and how to find it."""

    ticket: Ticket
    key: Key
    stream: bool
    opened_at: float
    open: bool = field(default=True)
    task: asyncio.Task[object] | None = None  # the task that picked it

    @property
    def endpoint_id(self) -> str:
        return self.ticket.id


class Tickets:
    """The open attempts of one strategy. One lock (never held while calling out) keeps
    them right when sync Router calls run in threads beside the event loop."""

    def __init__(
        self, max_open_s: float = 600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_open_s = max_open_s
        self.clock = clock
        self._by_key: dict[Key, deque[Attempt]] = {}
        self._by_task: dict[asyncio.Task[object], list[Attempt]] = {}
        self._order: deque[Attempt] = deque()  # by start time, for max_open_s
        self.abandoned_total = 0
        self._lock = threading.Lock()

    def open(self, counted: Ticket, key: Key, *, stream: bool) -> Attempt:
        """Hold ``counted`` (already counting) until its attempt ends."""
        self._expire()
        try:
            task: asyncio.Task[object] | None = asyncio.current_task()
        except RuntimeError:  # no event loop: a sync Router call
            task = None
        attempt = Attempt(counted, key, stream, self.clock(), task=task)
        first = False
        with self._lock:
            self._by_key.setdefault(key, deque()).append(attempt)
            self._order.append(attempt)
            if task is not None:
                held = self._by_task.get(task)
                first = held is None
                if held is None:
                    self._by_task[task] = [attempt]
                else:
                    if held and not held[-1].open:  # closed, kept only as the last pick
                        held.pop()
                    held.append(attempt)
        if first:
            assert task is not None
            task.add_done_callback(self._task_done)
        return attempt

    def close(self, attempt: Attempt, *, ok: bool = True) -> None:
        with self._lock:
            if not attempt.open:
                return
            attempt.open = False
            self._unqueue(attempt)
            held = self._by_task.get(attempt.task) if attempt.task is not None else None
            if held and held[-1] is not attempt:  # the last pick stays: _task_done reads it
                held.remove(attempt)  # (a task routing request after request keeps none)
            attempt.task = None  # a closed attempt waiting in _order keeps no task alive
        attempt.ticket.done(ok=ok)

    def _unqueue(self, attempt: Attempt) -> None:
        queue = self._by_key.get(attempt.key)
        if queue is not None:
            try:
                queue.remove(attempt)
            except ValueError:
                pass
            if not queue:
                del self._by_key[attempt.key]

    def close_key(self, key: Key, *, ok: bool = True) -> bool:
        """A callback reported the end of an attempt (``ok=False``: a failure): close
        its oldest open attempt."""
        with self._lock:
            queue = self._by_key.get(key)
            if not queue:
                return False
            attempt = queue[0]
        self.close(attempt, ok=ok)
        return True

    def in_flight(self) -> int:
        return sum(len(q) for q in self._by_key.values())

    def _task_done(self, task: asyncio.Task[object]) -> None:
        with self._lock:
            held = self._by_task.pop(task, [])
        # The last pick of a task that ended normally may be a stream it returned: the
        # stream's own callback ends it. Everything else the task picked has ended.
        handed_on = held[-1] if held and held[-1].stream and not task.cancelled() else None
        for attempt in held:
            if attempt is not handed_on:
                self.close(attempt)

    def _expire(self) -> None:
        order = self._order
        limit = self.clock() - self.max_open_s
        expired = []
        with self._lock:
            while order and (not order[0].open or order[0].opened_at < limit):
                attempt = order.popleft()
                if attempt.open:
                    expired.append(attempt)
        for attempt in expired:
            if attempt.open:
                self.abandoned_total += 1
                log.info(
                    "a request to %s had no end reported after %.0f s: counted as ended",
                    attempt.endpoint_id,
                    self.max_open_s,
                )
                self.close(attempt)
