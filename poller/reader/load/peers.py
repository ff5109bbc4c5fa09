"""The other gateway replicas' counts, as this replica last knew each of them.

Each replica's newest write of ``P:gateways:inflight`` (docs/schema.md) is kept,
whichever way it came: pushed on ``P:gateways:updates`` as it happened (``hear``), or
read back by the share script's call (``take``). A pushed write older than one a read
brought is dropped; a read sent before a write was heard does not undo it; a deletion
(the replica has nothing in flight) is kept until its expiry, so a read of before it
cannot bring the field back; a field past its expiry on the Redis clock is dropped with
no message (a replica that died). The counts are kept by endpoint too, so an endpoint's
figures are worked out from its own entries, and a write that changed one endpoint of a
long field moves that endpoint only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

__all__ = ["Counts", "Peers"]

#: A replica's counts at one endpoint: (in flight now, in flight at the endpoint's page's
#: scrape, that page's scraped_at_ms).
Counts = tuple[int, int, int]


class Peers:
    """The other replicas' newest writes (``own``: this replica's id, left out)."""

    def __init__(self, own: str) -> None:
        self.own = own
        # Replica id -> its newest write known (a deletion kept until its expiry).
        self.fields: dict[str, _Field] = {}
        #: Endpoint id -> replica id -> that replica's counts there.
        self.by_endpoint: dict[str, dict[str, Counts]] = {}
        #: Replicas whose field holds counts.
        self.live = 0
        self._first_expiry_ms = math.inf  # no field held expires before this

    def hear(self, messages: Iterable[str], now_ms: float, heard_at: float) -> set[str]:
        """Pushed writes (``<expiry ms> <record or -> <replica id>``) heard at
        ``heard_at``, then the fields past their expiry at ``now_ms`` dropped; returns
        the endpoints whose counts changed."""
        fields = self.fields
        moved: set[str] = set()
        for text in messages:
            parsed = _message(text)
            if parsed is None or parsed[0] == self.own:
                continue
            replica, expiry_ms, body, counts = parsed
            held = fields.get(replica)
            if held is not None and held.expiry_ms > expiry_ms:
                continue  # older than the write a read brought (the two crossed)
            if held is not None and held.body == body:
                fields[replica] = held._replace(expiry_ms=expiry_ms, heard_at=heard_at)
                continue  # the same counts, renewed
            self._put(replica, _Field(body, counts, expiry_ms, heard_at), moved)
        if self._first_expiry_ms < now_ms:
            for replica, held in list(fields.items()):
                if held.expiry_ms < now_ms:
                    self._put(replica, None, moved)
            self._first_expiry_ms = self.next_expiry_ms()
        return moved

    def take(self, fields: Sequence[Any], asked_at: float) -> set[str]:
        """The fields a read sent at ``asked_at`` returned (``[id, value, ...]``), merged
        into those held, parsing only writes newer than the held ones: a replica missing
        from them is gone unless a write of it was heard since. Returns the endpoints
        whose counts changed."""
        held_now = self.fields
        moved: set[str] = set()
        seen: set[str] = set()
        for i in range(1, len(fields), 2):
            replica, (expiry, _, body) = str(fields[i - 1]), str(fields[i]).partition(" ")
            held = held_now.get(replica)
            expiry_ms = _int(expiry)
            if held is not None and held.heard_at > asked_at and held.expiry_ms >= expiry_ms:
                seen.add(replica)  # heard since the read was sent: this write or newer
                continue
            if held is not None and held.body == body:
                held_now[replica] = held._replace(expiry_ms=expiry_ms)  # the same, renewed
                seen.add(replica)
                continue
            counts = _parse(body)
            if counts is None:
                continue
            self._put(replica, _Field(body, counts, expiry_ms, -math.inf), moved)
            seen.add(replica)
        for replica, held in list(held_now.items()):
            if replica not in seen and held.heard_at <= asked_at:
                self._put(replica, None, moved)  # gone (heard since: it may be newer)
        self._first_expiry_ms = self.next_expiry_ms()
        return moved

    def _put(self, replica: str, field: _Field | None, moved: set[str]) -> None:
        """Hold ``field`` as ``replica``'s newest write (None: it left); the endpoints
        whose counts that changes go into ``moved``."""
        old = self.fields.pop(replica, None) if field is None else self.fields.get(replica)
        if field is not None:
            self.fields[replica] = field
            if field.expiry_ms < self._first_expiry_ms:
                self._first_expiry_ms = field.expiry_ms
        before = old.counts if old is not None else {}
        after = field.counts if field is not None else {}
        index = self.by_endpoint
        for endpoint_id, counts in after.items():
            if before.get(endpoint_id) != counts:
                index.setdefault(endpoint_id, {})[replica] = counts
                moved.add(endpoint_id)
        for endpoint_id in before:
            if endpoint_id not in after:
                holders = index.get(endpoint_id)
                if holders is not None:
                    holders.pop(replica, None)
                    if not holders:
                        del index[endpoint_id]
                moved.add(endpoint_id)
        self.live += bool(after) - bool(before)

    def next_expiry_ms(self) -> float:
        """The Redis-clock ms at which the first held field expires (inf: none held)."""
        return min((field.expiry_ms for field in self.fields.values()), default=math.inf)

    def in_flight(self, endpoint_id: str) -> int:
        """The other replicas' requests in flight to ``endpoint_id``, as last known."""
        holders = self.by_endpoint.get(endpoint_id)
        return 0 if not holders else sum(now for now, _, _ in list(holders.values()))


class _Field(NamedTuple):
    """One replica's newest write: its record, parsed (empty for a deletion), its
    expiry (Redis ms), and when a message brought it (monotonic s; -inf: a read did)."""

    body: str
    counts: dict[str, Counts]
    expiry_ms: float
    heard_at: float


#: Counts beyond this (requests) or a negative one: the entry is not one of ours.
COUNT_MAX = 1 << 31
#: A scraped_at_ms beyond this (Redis ms, year 2286): not one of ours either.
MS_MAX = 1 << 53


def _int(text: str) -> float:
    """An expiry (Redis ms); -inf: not one (not an integer, or past ``MS_MAX``)."""
    try:
        value = int(text)
    except ValueError:  # not digits, or more of them than Python converts
        return -math.inf
    return float(value) if abs(value) <= MS_MAX else -math.inf


def _message(
    text: str,
) -> tuple[str, float, str, dict[str, Counts]] | None:
    """``<expiry ms> <record or -> <replica id>`` -> (replica id, expiry, record,
    its counts); None: not readable. The record is read as JSON up to its end, so a
    writer's spaces inside it do no harm; the id is the rest, spaces included."""
    expiry, _, rest = text.partition(" ")
    expiry_ms = _int(expiry)
    if expiry_ms == -math.inf:
        return None
    if rest.startswith("- "):
        return (rest[2:], expiry_ms, "-", {}) if len(rest) > 2 else None
    try:
        raw, end = _DECODER.raw_decode(rest)
    except (ValueError, RecursionError):  # RecursionError: nested past the stack
        return None
    counts = _counts(raw)
    replica = rest[end + 1 :]
    if counts is None or not replica or rest[end : end + 1] != " ":
        return None
    return replica, expiry_ms, rest[:end], counts


def _parse(body: str) -> dict[str, Counts] | None:
    """A replica's counts (``{endpoint: [now, at, scraped ms]}``), None: not readable."""
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested past the stack
        return None
    return _counts(raw)


def _counts(raw: object) -> dict[str, Counts] | None:
    """The counts of a decoded record; entries that are not three integers in range
    (counts 0 to ``COUNT_MAX``, a scraped_at_ms 0 to ``MS_MAX``) skipped."""
    if not isinstance(raw, dict):
        return None
    counts: dict[str, Counts] = {}
    for endpoint_id, triple in raw.items():
        if type(triple) is list and len(triple) == 3:
            now, at, scraped_ms = triple
            if type(now) is not int or type(at) is not int or type(scraped_ms) is not int:
                try:
                    now, at, scraped_ms = (int(x) for x in triple)
                except (TypeError, ValueError, OverflowError):  # OverflowError: 1e999
                    continue
            if 0 <= now <= COUNT_MAX and 0 <= at <= COUNT_MAX and 0 <= scraped_ms <= MS_MAX:
                counts[str(endpoint_id)] = (now, at, scraped_ms)
    return counts


_DECODER = json.JSONDecoder()
