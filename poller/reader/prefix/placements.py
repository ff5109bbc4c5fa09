"""This gateway fleet's prefix placements: the block table, shared by every replica.

``Placements`` is the table of poller/reader/prefix/table.py (block id -> the endpoints that
could hold it) that the picker records its prefix picks in and reads them back from.

Sharing (``sharing`` True, set by the cached reader's exchange): the blocks this replica
placed that the table did not hold there already, and those it held there that were last
placed or written ``REWRITE_AFTER`` of the engine's capacity ago, are queued
(``outbox``, poller/reader/prefix/outbox.py) and written to ``P:gateways:placements`` on the
exchange's next call (at once when this replica's counts change, at least every
300 ms); the other replicas' are read back on the same call (``take_entries``). Redis
lost: the table goes on with this replica's own placements.

Forks (``head``): where this replica's prompts leave the blocks placed before. A block
two prompts went on from differently ends a head many prompts share (a system prompt);
replicas that do not share placements agree on a conversation's engine past it
(poller/reader/routing/affinity.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from poller.reader.prefix.outbox import Outbox, entry_placements
from poller.reader.prefix.table import (
    AGE_S,
    MAX_TABLE_BLOCKS,
    REWRITE_AGE,
    BlockTable,
    Found,
    Value,
)
from poller.util.text import digits

__all__ = ["FORKS_MAX", "Found", "Placements"]

#: Forks (and first continuations) remembered at most; when as many, they start over.
FORKS_MAX = 1 << 16


class Placements(BlockTable):
    """The block table (poller/reader/prefix/table.py) with what the exchange needs to
    share it.

    - ``matches(ids, limit)``: ``[(endpoint id, blocks matched), ...]``, longest first,
      of the endpoints that hold a prefix of the prompt whose block ids are ``ids``.
    - ``record(endpoint id, ids, capacity_tokens)``: the prompt went there.
    - ``observe(endpoint id, queries, hits)``: the endpoint's prefix-cache counters as a
      page shows them; going back invalidates its placements.
    - ``take_outbox()``, ``put_back(body)``, ``take_entries(reply)``: the exchange's side.
    """

    def __init__(
        self,
        max_blocks: int = MAX_TABLE_BLOCKS,
        age_s: float = AGE_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_blocks, age_s, clock=clock)
        #: Written to Redis by the exchange (set by the exchange that carries them).
        self.sharing = False
        # this replica's placements yet to write, for at most when it rewrites a block
        self.outbox = Outbox(age_s * REWRITE_AGE, clock=clock)
        #: Monotonic seconds of the last exchange that carried placements; None: never.
        self.exchanged_at: float | None = None
        self.last_id = ""  # the stream entry read last
        # What the others wrote that was read (the benchmark prints them).
        self.ids_read = 0
        self.bytes_read = 0
        # Where this replica's prompts left what was placed before: block id -> the block
        # that followed it first, and the blocks that two prompts continued differently
        # (the end of a head many prompts share: a system prompt). ``head`` reads them.
        self._next: dict[int, int] = {}
        self._forks: set[int] = set()

    def answered_within(self, seconds: float) -> bool:
        """The other replicas' placements are current: shared, and the exchange carrying
        them answered within ``seconds`` (the exchange's bound, ``LOST_AFTER_MS``: the
        same calls carry the shared counts); False: this replica's own only."""
        at = self.exchanged_at
        return self.sharing and at is not None and self._clock() - at <= seconds

    def record(
        self,
        endpoint_id: str,
        ids: Sequence[int],
        capacity_tokens: float | None = None,
        found: Found | None = None,
    ) -> None:
        """The prompt of block ids ``ids`` was sent to ``endpoint_id`` (an engine of
        ``capacity_tokens`` KV tokens; None: as last known, else the default);
        ``found``: ``lookup(ids)`` made for the pick."""
        with self._lock:
            if found is None or found[2] != self._version:
                found = self.lookup(ids)
            self._fork(ids, found[0])
            fresh, again = self._place(endpoint_id, ids, capacity_tokens, found)
            if self.sharing and (fresh or again):
                self.outbox.add(endpoint_id, fresh + again)

    def _fork(self, ids: Sequence[int], values: list[Value | None]) -> None:
        """Note where the prompt ``ids`` leaves the blocks placed before (``values``: what
        the table holds of each): the block before is a fork when another prompt went on
        from it differently."""
        if not values or values[0] is None or None not in values:
            return  # new from its first block, or placed before whole
        k = values.index(None)
        before, after = ids[k - 1], ids[k]
        first = self._next.get(before)
        if first is None:
            if len(self._next) >= FORKS_MAX:
                self._next.clear()
            self._next[before] = after
        elif first != after:
            if len(self._forks) >= FORKS_MAX:
                self._forks.clear()
            self._forks.add(before)

    def head(self, ids: Sequence[int], n: int) -> int:
        """How many blocks of ``ids``, at most ``n``, make a head that prompts went on
        from differently (ending at a fork: ``_fork``); 0: none known."""
        forks = self._forks
        for k in range(min(n, len(ids)), 0, -1):
            if ids[k - 1] in forks:
                return k
        return 0

    # --- the exchange (poller/reader/exchange/) ---------------------------------------

    def take_outbox(self) -> str:
        """The placements to write on this exchange (taken from the queue, at most
        ``ENTRY_MAX`` ids): ``<endpoint id> <base64 ids> ...``, "" when none."""
        with self._lock:
            return self.outbox.take()

    def put_back(self, body: str) -> None:
        """The exchange carrying ``body`` failed: its ids go back to the queue (as room
        allows), for the next call."""
        with self._lock:
            self.outbox.put_back(body)

    # Counters of what was written (the benchmark prints them).
    @property
    def dropped(self) -> int:
        """Block ids never written (the queue was full)."""
        return self.outbox.dropped

    @property
    def ids_written(self) -> int:
        return self.outbox.ids_written

    @property
    def bytes_written(self) -> int:
        return self.outbox.bytes_written

    def take_entries(self, reply: Sequence[Any], now_ms: float | None = None) -> None:
        """The exchange's placement reply: ``[last entry id, entry id, body, ...]``, the
        other replicas' entries since the last one read. With ``now_ms`` (the Redis
        clock), an entry ages from its id's time: one older than ``age_s`` is left out,
        the others count for what is left of it (a new replica's first read, a backlog)."""
        if not reply:
            return
        self.last_id = str(reply[0])
        for i in range(2, len(reply), 2):
            body = str(reply[i])
            self.bytes_read += len(body)
            age_s = 0.0
            if now_ms is not None:
                written = str(reply[i - 1]).partition("-")[0]
                if digits(written):
                    age_s = max(0.0, (now_ms - int(written)) / 1000)
                    if age_s >= self.age_s:
                        continue
            for endpoint_id, ids in entry_placements(body):
                self.ids_read += len(ids)
                with self._lock:
                    self._place(endpoint_id, ids, None, age_s=age_s)
        self.exchanged_at = self._clock()

    def __repr__(self) -> str:
        return f"Placements({len(self)} blocks, {len(self._ids)} endpoints)"
