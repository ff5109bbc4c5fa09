"""The other gateway replicas' requests in flight, summed per endpoint.

Redis keeps the gateways' total per endpoint (``P:gateways:load``, kept by the share
script from each replica's record: docs/schema.md), and numbers its changes. A replica
reads the totals that moved since its last read on each exchange call (``read``), and
hears the totals that moved as the script publishes them, a few milliseconds apart at
most (``hear``): ``<number> <Redis ms> <endpoint>:<total> ...``. The change number
orders the two: a total is replaced only by one of a higher number. The work per call
and per message is the endpoints that moved, whatever the number of replicas.

``now(e)``: the others' requests in flight at an endpoint (the total, less this
replica's own as it last wrote them). ``at(e, ms)``: the same as it stood at a moment of
the Redis clock (a page's scrape), from a short history.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["HISTORY_MS", "Others"]

#: How far back ``at`` can answer (Redis ms): a page older than this is long replaced.
HISTORY_MS = 10_000
#: A total beyond this is not one of ours (a foreign writer's).
COUNT_MAX = 1 << 31
#: The share script's change numbers start at the Redis clock in microseconds and stay
#: exact in its floats: one beyond this is a foreign writer's.
NUMBER_MAX = 1 << 53


class Others:
    """What the other replicas have in flight, per endpoint (module doc)."""

    def __init__(self) -> None:
        #: The change number of the last read (None: no read yet).
        self.number: int | None = None
        #: Other live replicas, as the last read said.
        self.live = 0
        # endpoint -> the gateways' total as last read or heard, and this replica's own
        # share of it (as written)
        self._totals: dict[str, int] = {}
        self._own: dict[str, int] = {}
        # endpoint -> the number of a total heard after the last read
        self._heard: dict[str, int] = {}
        self._now: dict[str, int] = {}
        # endpoint -> [(Redis ms, the others' in flight from then on)], oldest first
        self._history: dict[str, list[tuple[float, int]]] = {}

    def now(self, endpoint_id: str) -> int:
        return self._now.get(endpoint_id, 0)

    def at(self, endpoint_id: str, at_ms: float) -> int:
        """The others' requests in flight at ``at_ms`` (Redis ms): as known then, from
        the history (a moment before it starts: its first value). It is asked of the
        endpoint's current page, whose scrape only moves forward: what comes before
        the value at ``at_ms`` is dropped, so the history holds about one interval."""
        history = self._history.get(endpoint_id)
        if not history:
            return self._now.get(endpoint_id, 0)
        k = bisect.bisect_right(history, (at_ms, math.inf)) - 1
        if k > 0:
            del history[:k]
            k = 0
        return history[max(k, 0)][1]

    def read(
        self,
        number: int,
        live: int,
        fields: Sequence[Any],
        own: Mapping[str, int],
        at_ms: float,
        *,
        full: bool = False,
    ) -> set[str]:
        """A read of the totals (``[endpoint, total, ...]``) answered at change number
        ``number`` and Redis ms ``at_ms``, after this replica wrote ``own`` (its
        requests in flight now, per endpoint, as the totals hold them). ``full``: every
        total is in it (a first read, or Redis started a new run of numbers): one not in
        it is 0. Returns the endpoints whose figure moved."""
        self.live = max(0, int(live))
        moved: set[str] = set()
        heard = self._heard
        if full:
            moved |= self._totals.keys()
            self._totals, heard = {}, {}
        totals = self._totals
        for i in range(1, len(fields), 2):
            endpoint_id, total = str(fields[i - 1]), _count(fields[i])
            # A total heard with a higher number than this read's is the newer.
            if total is not None and heard.get(endpoint_id, -1) <= number:
                totals[endpoint_id] = total
                moved.add(endpoint_id)
        for endpoint_id in own.keys() | self._own.keys():
            if own.get(endpoint_id, 0) != self._own.get(endpoint_id, 0):
                moved.add(endpoint_id)
        self._own = dict(own)
        self._heard = {e: n for e, n in heard.items() if n > number}
        self.number = number
        self._figure(moved, at_ms)
        return moved

    def hear(self, messages: Iterable[str]) -> set[str]:
        """Totals as the channel pushed them; returns the endpoints whose figure moved.
        A total of a number no higher than the one held is skipped, as is a message that
        is not readable. Messages taken in together are figured once, at the last one's
        time."""
        moved: set[str] = set()
        heard, totals = self._heard, self._totals
        floor = -1 if self.number is None else self.number
        last_ms = None
        for text in messages:
            parsed = _message(text)
            if parsed is None or parsed[0] <= floor:
                continue
            number, last_ms, changes = parsed
            for endpoint_id, total in changes:
                if heard.get(endpoint_id, -1) < number:
                    heard[endpoint_id] = number
                    totals[endpoint_id] = total
                    moved.add(endpoint_id)
        if last_ms is not None:
            self._figure(moved, last_ms)
        return moved

    def _figure(self, moved: Iterable[str], at_ms: float) -> None:
        for endpoint_id in moved:
            value = max(0, self._totals.get(endpoint_id, 0) - self._own.get(endpoint_id, 0))
            if not self._totals.get(endpoint_id, 1):
                del self._totals[endpoint_id]
            if value:
                self._now[endpoint_id] = value
            else:
                self._now.pop(endpoint_id, None)
            history = self._history.get(endpoint_id)
            if history is None:
                history = self._history[endpoint_id] = []
            if not history or history[-1][1] != value:
                if history and at_ms < history[-1][0]:  # a clock step back: start again
                    history.clear()
                history.append((at_ms, value))
                while len(history) > 1 and history[1][0] <= at_ms - HISTORY_MS:
                    history.pop(0)
            if not value and len(history) == 1:
                del self._history[endpoint_id]  # nothing now, nothing to look back on


def _count(value: Any) -> int | None:
    try:
        count = int(value)
    except (TypeError, ValueError):
        return None
    return count if 0 <= count <= COUNT_MAX else None


def _message(text: str) -> tuple[int, float, list[tuple[str, int]]] | None:
    """``<number> <Redis ms> <endpoint>:<total> ...`` -> its parts; None: not readable
    (a pair that alone is not is skipped)."""
    parts = text.split(" ")
    if len(parts) < 3:
        return None
    try:
        number, at_ms = int(parts[0]), float(parts[1])
    except ValueError:
        return None
    if not 0 <= number <= NUMBER_MAX or not math.isfinite(at_ms):
        return None  # not of the script: a later number would hold the totals forever
    changes = []
    for part in parts[2:]:
        endpoint_id, _, total = part.rpartition(":")
        count = _count(total) if total.isdigit() else None
        if endpoint_id and count is not None:
            changes.append((endpoint_id, count))
    return number, at_ms, changes
