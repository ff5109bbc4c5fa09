"""Every request a strategy routes is counted in its ``LocalLoad`` from the pick until it
ends, exactly once, however it ends.

A ticket opens at the pick. It closes at the first of:

- LiteLLM's success or failure callback for that attempt (matched by the request's
  ``litellm_trace_id`` and the deployment's id; a retry to the same deployment queues
  behind the first); a failure is counted as one (``LocalLoad.finished(ok=False)``:
  an engine that answers errors at once must not look idle);
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
from collections import deque
from dataclasses import dataclass, field

from poller.reader.load import LocalLoad

__all__ = ["Ticket", "Tickets"]

log = logging.getLogger("poller.integrations.litellm")

Key = tuple[str, str]  # (litellm_trace_id, deployment id)


@dataclass(slots=True, eq=False)
class Ticket:
    endpoint_id: str
    key: Key
    stream: bool
    started_at: float
    open: bool = field(default=True)
    task: asyncio.Task[object] | None = None  # the task that picked it


class Tickets:
    """The open tickets of one strategy. One lock (never held while calling out) keeps
    them right when sync Router calls run in threads beside the event loop."""

    def __init__(self, local: LocalLoad, max_open_s: float = 600.0) -> None:
        self.local = local
        self.max_open_s = max_open_s
        self._by_key: dict[Key, deque[Ticket]] = {}
        self._by_task: dict[asyncio.Task[object], list[Ticket]] = {}
        self._order: deque[Ticket] = deque()  # by start time, for max_open_s
        self.abandoned_total = 0
        self._lock = threading.Lock()

    def open(self, endpoint_id: str, key: Key, *, stream: bool) -> Ticket:
        self._expire()
        try:
            task: asyncio.Task[object] | None = asyncio.current_task()
        except RuntimeError:  # no event loop: a sync Router call
            task = None
        ticket = Ticket(endpoint_id, key, stream, self.local.started(endpoint_id), task=task)
        first = False
        with self._lock:
            self._by_key.setdefault(key, deque()).append(ticket)
            self._order.append(ticket)
            if task is not None:
                held = self._by_task.get(task)
                first = held is None
                if held is None:
                    self._by_task[task] = [ticket]
                else:
                    if held and not held[-1].open:  # closed, kept only as the last pick
                        held.pop()
                    held.append(ticket)
        if first:
            assert task is not None
            task.add_done_callback(self._task_done)
        return ticket

    def close(self, ticket: Ticket, *, ok: bool = True) -> None:
        with self._lock:
            if not ticket.open:
                return
            ticket.open = False
            self._unqueue(ticket)
            held = self._by_task.get(ticket.task) if ticket.task is not None else None
            if held and held[-1] is not ticket:  # the last pick stays: _task_done reads it
                held.remove(ticket)  # (a task routing request after request keeps none)
            ticket.task = None  # a closed ticket waiting in _order keeps no task alive
        self.local.finished(ticket.endpoint_id, ticket.started_at, ok=ok)

    def _unqueue(self, ticket: Ticket) -> None:
        queue = self._by_key.get(ticket.key)
        if queue is not None:
            try:
                queue.remove(ticket)
            except ValueError:
                pass
            if not queue:
                del self._by_key[ticket.key]

    def close_key(self, key: Key, *, ok: bool = True) -> bool:
        """A callback reported the end of an attempt (``ok=False``: a failure): close
        its oldest open ticket."""
        with self._lock:
            queue = self._by_key.get(key)
            if not queue:
                return False
            ticket = queue[0]
        self.close(ticket, ok=ok)
        return True

    def in_flight(self) -> int:
        return sum(len(q) for q in self._by_key.values())

    def _task_done(self, task: asyncio.Task[object]) -> None:
        with self._lock:
            held = self._by_task.pop(task, [])
        # The last pick of a task that ended normally may be a stream it returned: the
        # stream's own callback ends it. Everything else the task picked has ended.
        handed_on = held[-1] if held and held[-1].stream and not task.cancelled() else None
        for ticket in held:
            if ticket is not handed_on:
                self.close(ticket)

    def _expire(self) -> None:
        order = self._order
        limit = self.local.now() - self.max_open_s
        expired = []
        with self._lock:
            while order and (not order[0].open or order[0].started_at < limit):
                ticket = order.popleft()
                if ticket.open:
                    expired.append(ticket)
        for ticket in expired:
            if ticket.open:
                self.abandoned_total += 1
                log.info(
                    "a request to %s had no end reported after %.0f s: counted as ended",
                    ticket.endpoint_id,
                    self.max_open_s,
                )
                self.close(ticket)
