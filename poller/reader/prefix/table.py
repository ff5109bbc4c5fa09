"""The bounded table of prompt blocks a prefix pick reads: block id -> endpoints.

A placement is (block id, endpoint, position): the position counts the blocks placed on
that endpoint so far (new ones only; a block placed again is moved up to the current
count, as an LRU moves it to the front). The blocks of one prompt all get the count
after it: its head is never older than its tail, so what is held of a prompt is a
prefix (engines evict a request's blocks tail first: vLLM frees them in reverse order).
A placement counts while the engine could still hold the block (docs/reader.md, "Prefix
affinity"):

- fewer than the engine's KV capacity in blocks (``kv_capacity_tokens`` / 128, the
  tokens of a block) were placed there since;
- it was placed or used within ``age_s``;
- the endpoint's prefix-cache counters have not gone back since (a restart, a cache
  reset): ``observe`` moves the endpoint's lowest valid position past every placement,
  O(1), whatever the table holds.

Every check is two comparisons (the lowest valid position, the count since), so a pick
costs one dict lookup per block of its prompt. The table holds at most ``max_blocks``
blocks in two generations (the newer is filled; when it holds half, it becomes the
older and the older is dropped), so memory is bounded and recently used blocks stay.
What this gateway replica records and what the others wrote (``Placements``,
poller/reader/prefix/placements.py) are placed alike.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from itertools import groupby

from poller.reader.prefix.blocks import BLOCK_BYTES, BYTES_PER_TOKEN

__all__ = [
    "CODE_BITS",
    "MAX_HOLDERS",
    "MAX_TABLE_BLOCKS",
    "TOKENS_PER_BLOCK",
    "BlockTable",
    "Found",
    "Value",
]

#: A placement's value: position << CODE_BITS | endpoint code, or several of them; never 0
#: (a position is at least 1), so a list of values is all None exactly when not any().
Value = int | tuple[int, ...]
#: ``lookup``'s answer: the values of the ids, the indexes found older, and the table's
#: version they were read at (a change since: read again before use).
Found = tuple[list[Value | None], set[int], int]

#: Bits of a placement's value that hold the endpoint's code; the position is above.
CODE_BITS = 20
_MASK = (1 << CODE_BITS) - 1
#: Blocks the table holds at most (both generations), 81 bytes each (measured).
MAX_TABLE_BLOCKS = 1 << 20
#: How long an unused placement counts (s); also how long Redis keeps placements.
AGE_S = 600.0
#: The age is tracked in steps of this many seconds per endpoint.
MARK_S = 10.0
#: Capacity assumed for an engine that publishes none, when the fleet's is unknown too.
DEFAULT_CAPACITY_TOKENS = 131072
#: Tokens per block of the picker's (poller/reader/prefix/blocks.py): an engine's capacity in
#: blocks is its ``kv_capacity_tokens`` over this.
TOKENS_PER_BLOCK = BLOCK_BYTES // BYTES_PER_TOKEN
#: Endpoints the table keeps track of (about 1 KB each); when as many were seen (a
#: fleet whose addresses churn), it starts over, as a restarted replica does.
MAX_ENDPOINTS = 1 << 16
#: Endpoints one block is remembered on at most.
MAX_HOLDERS = 4
#: A page older than the newest seen by more than this (the longest interval) shows
#: that one was dated ahead, not that it is a page behind.
BEHIND_MAX_MS = 3_600_000
#: A block used again where it is held is moved up (an LRU's move to the front) and
#: written again, for the other replicas, whose tables see only what is written, once
#: this share of the endpoint's capacity in blocks was placed there since it was last
#: placed or written; until then it keeps its position, the one the others know. Without
#: the rewrite the others would take a block in use for evicted; the price is a block
#: taken for evicted up to this share of the capacity early.
REWRITE_AFTER = 0.25
#: A block in use is also moved up and written again once its position is this share
#: of ``age_s`` old, so that it never ages out while in use.
REWRITE_AGE = 0.5


class BlockTable:
    """Block id -> the endpoints holding it, bounded and kept valid (module doc).

    - ``matches(ids, limit)``: ``[(endpoint id, blocks matched), ...]``, longest first,
      of the endpoints that hold a prefix of the prompt whose block ids are ``ids``.
    - ``_place(endpoint id, ids, capacity_tokens)``: the prompt went there (under the
      lock; ``Placements.record`` is the public side).
    - ``observe(endpoint id, queries, hits)``: the endpoint's prefix-cache counters as a
      page shows them; going back invalidates its placements.
    """

    def __init__(
        self,
        max_blocks: int = MAX_TABLE_BLOCKS,
        age_s: float = AGE_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 2:
            raise ValueError(f"max_blocks must be an integer >= 2, got {max_blocks!r}")
        if not age_s > 0:
            raise ValueError(f"age_s must be > 0 seconds, got {age_s!r}")
        self.max_blocks = max_blocks
        self.age_s = age_s
        self._clock = clock
        self._lock = threading.RLock()  # lookup may expire under a caller that holds it
        self._new: dict[int, int | tuple[int, ...]] = {}
        self._old: dict[int, int | tuple[int, ...]] = {}
        self._codes: dict[str, int] = {}
        self._ids: list[str] = []
        self._used: list[int] = []  # blocks placed per endpoint code
        self._low: list[int] = []  # lowest valid position per code (age, resets)
        self._cap: list[int] = []  # capacity in blocks per code
        self._marks: list[deque[tuple[float, int]]] = []  # (time, used) per code
        # counters last observed, and the scrape (ms) of the page that showed them
        self._seen: list[tuple[float, float, int] | None] = []
        self._next_expire = 0.0
        #: Counts the changes: a ``Found`` of an older version is read again before use
        #: (a placement made meanwhile kept, the codes of a table started over not used).
        self._version = 0
        # Counters (the benchmark prints them).
        self.placed = 0  # blocks this replica placed that were new where they went
        self.invalidated = 0  # endpoints whose placements a counter reset voided

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    # --- the pick path (no lock: dict reads) --------------------------------------------

    def lookup(self, ids: Sequence[int]) -> Found:
        """What the table holds for each of ``ids`` (None: nothing), and the positions of
        those found in the older generation: one pass that ``matches`` and ``record``
        both use, so a pick looks each block up once. Placements past their age stop
        counting first (``expire``)."""
        if self._clock() >= self._next_expire:
            self.expire()
        version = self._version  # read first: a change while reading makes it older
        values: list[Value | None] = list(map(self._new.get, ids))
        old = self._old
        aged: set[int] = set()
        if old:
            for i, value in enumerate(values):
                if value is None:
                    held = old.get(ids[i])
                    if held is not None:
                        values[i] = held
                        aged.add(i)
        return values, aged, version

    def matches(
        self,
        ids: Sequence[int],
        limit: int = MAX_HOLDERS,
        found: Found | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> list[tuple[str, int]]:
        """The endpoints holding a prefix of ``ids``, longest first, at most ``limit``
        (``found``: ``lookup(ids)`` already made; ``keep``: only endpoints it says yes
        to, so that holders a pick may not use leave room for those it may)."""
        if found is None or found[2] != self._version:
            found = self.lookup(ids)
        values = found[0]
        if not any(values):  # a new prompt: nothing holds it (a value is never 0)
            return []
        low, used, cap, names = self._low, self._used, self._cap, self._ids
        best: dict[int, int] = {}
        passed: set[int] = set()
        last: Value | None = None
        try:
            for k in range(len(values) - 1, -1, -1):
                value = values[k]
                if value is None or value == last:
                    continue  # a prompt's blocks placed together hold the same: seen
                last = value
                for v in (value,) if type(value) is int else value:  # type: ignore[union-attr]
                    code = v & _MASK
                    if code not in best and code not in passed:
                        pos = v >> CODE_BITS
                        if pos >= low[code] and used[code] - pos < cap[code]:
                            if keep is None or keep(names[code]):
                                best[code] = k + 1
                            else:
                                passed.add(code)
                if len(best) >= limit:
                    break
        except IndexError:  # the table started over since the lookup: nothing known
            return []
        return [(names[code], n) for code, n in best.items()]

    # --- changes ------------------------------------------------------------------------

    def _code(self, endpoint_id: str) -> int:
        code = self._codes.get(endpoint_id)
        if code is None:
            if len(self._ids) >= MAX_ENDPOINTS:  # as many seen: start over
                self._clear()
            code = len(self._ids)
            self._ids.append(endpoint_id)
            self._used.append(0)
            self._low.append(1)
            self._cap.append(DEFAULT_CAPACITY_TOKENS // TOKENS_PER_BLOCK)
            self._marks.append(deque())
            self._seen.append(None)
            self._codes[endpoint_id] = code  # last: a reader finding it finds it whole
        return code

    def capacity(self, endpoint_id: str, capacity_tokens: float | None) -> None:
        """The endpoint's KV capacity as its page shows it (None: unknown, left as is)."""
        if capacity_tokens is None or not capacity_tokens > 0:
            return
        blocks = max(1, int(capacity_tokens) // TOKENS_PER_BLOCK)
        code, caps = self._codes.get(endpoint_id), self._cap
        if code is not None and code < len(caps) and caps[code] == blocks:
            return
        with self._lock:
            self._cap[self._code(endpoint_id)] = blocks

    def _clear(self) -> None:
        """Everything forgotten (new objects: a pick reading the old ones meanwhile reads
        them whole; a lookup made before is read again, ``_version``)."""
        self._version += 1
        self._new, self._old = {}, {}
        self._codes = {}
        self._ids, self._used, self._low, self._cap = [], [], [], []
        self._marks, self._seen = [], []

    def _place(
        self,
        endpoint_id: str,
        ids: Sequence[int],
        capacity_tokens: float | None,
        found: Found | None = None,
        age_s: float = 0.0,
    ) -> tuple[list[int], list[int]]:
        """Place ``ids``, placed ``age_s`` ago (under the lock); returns (those that were
        new there, those held there that are due to be written again: ``REWRITE_AFTER``).
        At most half the table's blocks are placed at once (a longer prompt's head)."""
        now = self._clock()
        if now >= self._next_expire:
            self._expire(now)
        code = self._code(endpoint_id)
        if capacity_tokens is not None and capacity_tokens > 0:
            self._cap[code] = max(1, int(capacity_tokens) // TOKENS_PER_BLOCK)
        half = self.max_blocks // 2
        if len(ids) > half:
            ids, found = ids[:half], None
        if len(self._new) + len(ids) > half:
            self._old, self._new = self._new, {}  # the older generation is dropped
            found = None  # found in generations that moved
        if found is None or found[2] != self._version:  # changed since: read again
            found = self.lookup(ids)
        used, fresh, again = self._blocks(ids, code, found, now)
        self._version += 1
        self._used[code] = used
        marks = self._marks[code]
        at = now - age_s
        if not marks or at - marks[-1][0] >= MARK_S:
            marks.append((at, used))
        else:  # within the step (or before it): these blocks age with the newest mark
            marks[-1] = (marks[-1][0], used)
        self.placed += len(fresh)
        return fresh, again

    def _blocks(
        self, ids: Sequence[int], code: int, found: Found, now: float
    ) -> tuple[int, list[int], list[int]]:
        """Place ``ids`` on ``code``: (its count of blocks after, the ids new there, the
        ids held there due to be written again). Every block of the prompt placed anew
        gets the count after it (one int shared by all): a prompt's blocks are as recent
        as its last use, its head never older than its tail."""
        values, aged, _ = found
        if not any(values):  # new everywhere, the most common prompt (a value is never 0)
            used = self._used[code] + len(ids)
            self._new.update(dict.fromkeys(ids, used << CODE_BITS | code))
            return used, list(ids), []
        runs, fresh, again = self._judge(ids, values, code, now)
        # Blocks moved up get a position past every other (one more when none is new).
        used = self._used[code] + (len(fresh) or (1 if again else 0))
        mark = used << CODE_BITS | code
        new = self._new
        for start, end, value, stays in runs:
            result: Value
            if stays:  # its position is the one written last: the others know it so
                result = value  # type: ignore[assignment]
            elif value is None or type(value) is int and value & _MASK == code:
                result = mark
            else:
                result = self._joined(value, code, mark)
            if value != result:
                new.update(dict.fromkeys(ids[start:end], result))
            elif aged:  # found in the older generation: moved to the newer as it is
                for i in range(start, end):
                    if i in aged:
                        new[ids[i]] = result
        return used, fresh, again

    def _judge(
        self, ids: Sequence[int], values: list[Value | None], code: int, now: float
    ) -> tuple[list[tuple[int, int, Value | None, bool]], list[int], list[int]]:
        """Of ``ids`` on ``code``, judged once per run of one value (blocks placed
        together hold the same): (the runs as (start, end, value, stays), the ids new
        there, the ids held there due to be written again); a run that stays is held
        there and keeps its position."""
        used, cap, floor = self._used[code], self._cap[code], self._low[code]
        due = used - int(cap * REWRITE_AFTER)
        # ... or placed before a mark older than REWRITE_AGE of the age: a block in use
        # is moved up and written again before its age runs out, here and elsewhere.
        marks = self._marks[code]
        old = bisect_left(marks, (now - self.age_s * REWRITE_AGE,))
        if old:
            due = max(due, marks[old - 1][1])
        runs: list[tuple[int, int, Value | None, bool]] = []
        fresh: list[int] = []
        again: list[int] = []
        start = 0
        for value, run in groupby(values):
            end = start + len(list(run))
            held = stays = False
            if value is not None:
                for v in (value,) if type(value) is int else value:  # type: ignore[union-attr]
                    if v & _MASK == code:
                        pos = v >> CODE_BITS
                        held = pos >= floor and used - pos < cap
                        stays = held and pos > due
                        break
            if not held:
                fresh += ids[start:end]
            elif not stays:
                again += ids[start:end]
            runs.append((start, end, value, stays))
            start = end
        return runs, fresh, again

    def _joined(self, value: Value, code: int, mark: int) -> Value:
        """The holders of ``value`` that still hold it, other than ``code``, and ``mark``
        (``code`` now) last; at most ``MAX_HOLDERS``."""
        lows, useds, caps = self._low, self._used, self._cap
        kept = [
            v
            for v in ((value,) if type(value) is int else value)  # type: ignore[union-attr]
            if (c := v & _MASK) != code
            and (v >> CODE_BITS) >= lows[c]
            and useds[c] - (v >> CODE_BITS) < caps[c]
        ]
        kept.append(mark)
        return kept[0] if len(kept) == 1 else tuple(kept[-MAX_HOLDERS:])

    def expire(self) -> None:
        """Placements not used within ``age_s`` stop counting, whether or not anything
        was placed since (``lookup`` calls it; the work is done at most once per
        ``MARK_S``)."""
        now = self._clock()
        if now >= self._next_expire:
            with self._lock:
                if now >= self._next_expire:
                    self._expire(now)

    def _expire(self, now: float) -> None:
        """Placements not used within ``age_s`` stop counting (under the lock)."""
        self._next_expire = now + MARK_S
        limit = now - self.age_s
        for code, marks in enumerate(self._marks):
            while marks and marks[0][0] < limit:
                _, used = marks.popleft()
                if used + 1 > self._low[code]:
                    self._low[code] = used + 1

    def observe(
        self,
        endpoint_id: str,
        queries: float | None,
        hits: float | None,
        scraped_ms: int | None = None,
    ) -> bool:
        """The endpoint's prefix-cache counters (``prefix_cache_queries_total``,
        ``hits_total``) as its page scraped at ``scraped_ms`` shows them; either below
        what was seen before (the engine restarted or reset its cache): its placements
        are void (returns True). A page older than one seen already (a pick on an index
        a page behind the exchange's) says nothing; one over ``BEHIND_MAX_MS`` older
        becomes the reference, voiding nothing (the one seen was dated ahead: a clock)."""
        if queries is None or hits is None:
            return False
        code, seens = self._codes.get(endpoint_id), self._seen
        if code is not None and code < len(seens):  # else new, or the table started over
            seen = seens[code]
            if seen is not None and seen[0] == queries and seen[1] == hits:
                return False
        with self._lock:
            code = self._code(endpoint_id)
            seen = self._seen[code]
            if seen is not None and scraped_ms is not None and scraped_ms < seen[2]:
                if seen[2] - scraped_ms <= BEHIND_MAX_MS:
                    return False
                seen = None  # the page seen was dated ahead: start again from this one
            reset = seen is not None and (queries < seen[0] or hits < seen[1])
            if reset:
                self._low[code] = self._used[code] + 1
                self.invalidated += 1
            at = scraped_ms if scraped_ms is not None else (-1 if seen is None else seen[2])
            self._seen[code] = (queries, hits, at)
        return reset
