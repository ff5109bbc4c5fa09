"""Placements on their way through the shared stream ``P:gateways:placements``
(docs/schema.md): an entry's format, and the queue of block ids this replica has yet to
write.

An entry's body is ``<endpoint id> <ids> <endpoint id> <ids> ...``: the ids of blocks
placed on that endpoint, as base64 of their 8 big-endian bytes each. The queue holds at
most ``OUT_MAX`` ids (more are dropped, and counted); one exchange takes at most
``ENTRY_MAX`` of them, the endpoint queued first first. An id is written within
``hold_s`` of its queueing or not at all (the queue turns over in two halves: one not
written when its half turns over, Redis away meanwhile, is dropped, and counted), rather
than written late as new, which the other replicas would count for a whole age from its
late write; a block still in use is written again anyway.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator, Sequence

__all__ = [
    "ENTRY_MAX",
    "OUT_MAX",
    "Outbox",
    "entry_placements",
    "pack",
]

#: Block ids waiting to be written, at most (more are dropped, counted in ``dropped``).
OUT_MAX = 8192
#: Block ids one exchange writes at most (one stream entry).
ENTRY_MAX = 1024


class Outbox:
    """Block ids waiting to be written, per endpoint. Not locked: the placements table
    calls it under its own lock."""

    def __init__(self, hold_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``hold_s``: how long an id may wait to be written (the placements table's
        ``REWRITE_AGE`` of its age: a block in use is written again by then)."""
        # Two halves: ids queued since the last turn, and those queued in the half before
        # it, written first; at each turn (every ``hold_s`` / 2) what is left of the
        # older half has waited that long at least, and is dropped.
        self._new: dict[str, list[int]] = {}
        self._old: dict[str, list[int]] = {}
        self._n = 0
        self._half_s = hold_s / 2
        self._clock = clock
        self._turned = clock()
        self.dropped = 0  # block ids never written (the queue was full, or they waited)
        self.ids_written = 0
        self.bytes_written = 0

    def add(self, endpoint_id: str, ids: list[int], *, older: bool = False) -> None:
        """Queue ``ids`` placed on ``endpoint_id``, as room allows, with the newer half
        (``older``: the older one). On the pick path: the halves turn over on ``take``,
        which the exchange calls at least every 300 ms while it runs, Redis there or not."""
        room = max(0, OUT_MAX - self._n)
        if room < len(ids):
            self.dropped += len(ids) - room
            ids = ids[:room]
        if ids:
            (self._old if older else self._new).setdefault(endpoint_id, []).extend(ids)
            self._n += len(ids)

    def _turn(self) -> None:
        now = self._clock()
        if now - self._turned < self._half_s:
            return
        n = sum(map(len, self._old.values()))
        if now - self._turned >= 2 * self._half_s:  # no take for a whole hold: drop it all
            n += sum(map(len, self._new.values()))
            self._new = {}
        self._old, self._new = self._new, {}
        self._turned = now
        self._n -= n
        self.dropped += n

    def take(self) -> str:
        """The body of this exchange's entry (at most ``ENTRY_MAX`` ids, taken from the
        queue, the older half first), "" when nothing waits."""
        self._turn()
        parts: list[str] = []
        room = ENTRY_MAX
        for half in (self._old, self._new):
            for endpoint_id in list(half):
                if room <= 0:
                    break
                ids = half[endpoint_id]
                taken, rest = ids[:room], ids[room:]
                if rest:
                    half[endpoint_id] = rest
                else:
                    del half[endpoint_id]
                parts += (endpoint_id, pack(taken))
                room -= len(taken)
                self._n -= len(taken)
                self.ids_written += len(taken)
        body = " ".join(parts)
        self.bytes_written += len(body)
        return body

    def put_back(self, body: str) -> None:
        """The exchange carrying ``body`` failed: its ids go back to the queue (as room
        allows), for the next call, with the older half (they may have waited that
        long)."""
        self.bytes_written -= len(body)
        for endpoint_id, ids in entry_placements(body):
            self.ids_written -= len(ids)
            self.add(endpoint_id, ids, older=True)


def entry_placements(body: str) -> Iterator[tuple[str, list[int]]]:
    """An entry's ``(endpoint id, block ids)`` pairs; a part that is not base64 of whole
    8-byte ids is skipped."""
    words = body.split(" ") if body else []
    for j in range(1, len(words), 2):
        ids = unpack(words[j])
        if ids is not None:
            yield words[j - 1], ids


def pack(ids: Sequence[int]) -> str:
    """Ids as base64 of their 8 big-endian bytes each."""
    return base64.b64encode(b"".join(i.to_bytes(8, "big") for i in ids)).decode("ascii")


def unpack(text: str) -> list[int] | None:
    """``pack``'s ids back; None when ``text`` is not base64 of whole 8-byte ids."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    if len(raw) % 8:
        return None
    return [int.from_bytes(raw[i : i + 8], "big") for i in range(0, len(raw), 8)]
