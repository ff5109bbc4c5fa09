"""The share script (poller/schema/scripts/share.lua) played in memory, for the
virtual-time family: the same keys' state, replies and published messages, on the
family's clock instead of Redis's. tests/lab/test_share_script.py holds it to the Lua
script on the same calls against a real redis-server.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["ShareScript"]

_ENDPOINT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,199}")


def _counts(record: str | None) -> dict[str, int]:
    """A record's requests in flight now, per endpoint (the script's ``counts``)."""
    if not record:
        return {}
    try:
        parsed = json.loads(record)
    except ValueError:
        return {}
    out: dict[str, int] = {}
    if isinstance(parsed, dict):
        for endpoint, triple in parsed.items():
            if _ENDPOINT.fullmatch(endpoint) and isinstance(triple, list) and triple:
                n = triple[0]
                if isinstance(n, int | float) and 0 < n < 1 << 31:
                    out[endpoint] = int(n)
    return out


class ShareScript:
    """The gateways' keys (records, totals, change numbers, alive replicas, the last
    publish) and ``call``: one run of the script, without the placements stream."""

    def __init__(self) -> None:
        self.records: dict[str, str] = {}  # the in-flight hash: id -> "<expiry> <record>"
        self.shares: dict[str, str] = {}  # the load hash's "@<id>" fields
        self.totals: dict[str, int] = {}  # the load hash's endpoint fields
        self.changed: dict[str, int] = {}  # the changed zset
        self.alive: dict[str, float] = {}  # the alive zset
        self.start: int | None = None  # the load hash's "#"
        self.published: tuple[int, float] | None = None  # the load hash's "^"
        self._number, self._moved = 0, False  # the call's change number; a total moved

    def call(self, now_us: int, args: list[Any]) -> tuple[list[Any], str | None]:
        """The script's reply to ``args`` (the exchange's, as ``Exchange.prepare``
        builds them) at ``now_us`` (microseconds, Redis's ``TIME``), and the message
        it publishes (None: none)."""
        replica, ttl, record, publish, last, every_ms = args[:6]
        now_ms = float(now_us // 1000)
        if self.start is None:
            self.start = now_us
        before = max([self.start, *self.changed.values()])
        self._number, self._moved = before + 1, False
        again = self._write(replica, record, now_ms, int(ttl))
        for _, rid in sorted((at, rid) for rid, at in self.alive.items() if at < now_ms)[:16]:
            self._move(rid, None)
            self.records.pop(rid, None)
            del self.alive[rid]
        number = self._number if self._moved else before
        held, message = 0, None
        published, published_ms = self.published or (self.start, -1e15)
        if number > published and str(publish) == "1":
            if now_ms - published_ms >= float(every_ms) * min(1.0, len(self.alive) / 64):
                pairs = " ".join(f"{e}:{self.totals.get(e, 0)}" for e in self._since(published))
                message = f"{number} {now_ms:.0f} {pairs}"
                self.published = (number, now_ms)
            elif self._moved:
                held = 1
        read = None if last in ("", None) else int(last)
        full = read is None or read < self.start or read > number
        sec, us = divmod(now_us, 1_000_000)
        others = len(self.alive) - (0 if record == "." else 1)
        reply: list[Any] = [sec, us, others, number, again, int(full), held]
        for endpoint in list(self.totals) if full else self._since(read or 0):
            reply += [endpoint, str(self.totals.get(endpoint, 0))]
        return reply, message

    def _write(self, replica: str, record: str, now_ms: float, ttl: int) -> int:
        """The caller's record and alive entry; 1 when it must write its record whole."""
        again = 0
        if record in ("-", "."):
            self.records.pop(replica, None)
            self._move(replica, None)
        elif record:
            self.records[replica] = f"{now_ms + ttl:.0f} {record}"
            self._move(replica, record)
        elif replica not in self.shares:
            again = 1
        if record == ".":
            self.alive.pop(replica, None)
        else:
            self.alive[replica] = now_ms + ttl
        return again

    def _move(self, replica: str, record: str | None) -> None:
        """The totals from a replica's share to its new record's counts."""
        was = _counts(self.shares.get(replica))
        after = _counts(record)
        if record is None:
            self.shares.pop(replica, None)
        else:
            self.shares[replica] = record
        for endpoint in {*was, *after}:
            difference = after.get(endpoint, 0) - was.get(endpoint, 0)
            if difference:
                total = self.totals.get(endpoint, 0) + difference
                if total <= 0:
                    self.totals.pop(endpoint, None)
                else:
                    self.totals[endpoint] = total
                self.changed[endpoint] = self._number
                self._moved = True

    def _since(self, number: int) -> list[str]:
        """The endpoints changed after ``number``, in the zset's order."""
        return [e for n, e in sorted((n, e) for e, n in self.changed.items()) if n > number]
