"""The shared view as readers see it: snapshot script, states, and a reference picker.

Pure functions over the replies of two read-only Lua scripts (a whole snapshot, or one
endpoint), shared by the asyncio and the threaded reader in ``reader.py``.

States (docs/schema.md): **fresh** (stats younger than the bound, no newer failure),
**stale** (older), **failing** (a failure is current), **unknown** (nothing in Redis).
The bound is ``stale_after_intervals`` times the interval the poller wrote with the stats.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from poller.errors import PollerError
from poller.schema.endpoint import Endpoint, endpoint_from_json
from poller.schema.keys import SCHEMA_VERSION
from poller.schema.stats import EndpointStats, Failure

__all__ = [
    "EndpointView",
    "State",
    "View",
]

State = Literal["fresh", "stale", "failing", "unknown"]


_RECORDS = ("stats", "failure", "registry entry")
_reported: set[tuple[str, str]] = set()
log = logging.getLogger(__name__)


def _malformed(record: str, endpoint_id: str, exc: Exception) -> None:
    """A WARNING once per (record, error type) in this process; DEBUG after that."""
    kind = (record, type(exc).__name__)
    level = logging.DEBUG if kind in _reported else logging.WARNING
    _reported.add(kind)
    log.log(level, "malformed %s of endpoint %s read as absent: %s", record, endpoint_id, exc)


def _fields(raw: Mapping[str, str] | str) -> dict[str, str]:
    """A hash as read, or the JSON body of a view record."""
    if isinstance(raw, str):
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("record body is not an object")
        return {str(k): str(v) for k, v in data.items()}
    return dict(raw)


def _pairs(flat: Sequence[Any]) -> dict[str, str]:
    # Replies are already str (the client decodes them): no per-element conversion.
    it = iter(flat)
    return dict(zip(it, it, strict=True))


def _now_ms(seconds: Any, micros: Any) -> int:
    return int(seconds) * 1000 + int(micros) // 1000


class Timing(NamedTuple):
    """What the state of an endpoint depends on, parsed once from its two hashes."""

    scraped_at_ms: int | None
    bound_ms: int
    failure_at_ms: int | None
    failing: bool  # a failure hash exists

    def state_at(self, now_ms: int) -> tuple[State, int | None]:
        """(state, age of the stats in ms) at ``now_ms`` of the Redis clock."""
        age = None if self.scraped_at_ms is None else max(0, now_ms - self.scraped_at_ms)
        if self.failing and (
            self.scraped_at_ms is None
            or self.failure_at_ms is None
            or self.failure_at_ms >= self.scraped_at_ms
        ):
            return "failing", age
        if age is None:
            return "unknown", None
        return ("fresh" if age <= self.bound_ms else "stale"), age


def timing(
    stats_raw: Mapping[str, str],
    failure_raw: Mapping[str, str],
    stale_after_intervals: float = 2.0,
    stale_after_ms: int | None = None,
) -> Timing:
    scraped = stats_raw.get("scraped_at_ms", "")
    at = failure_raw.get("at_ms", "")
    bound = stale_after_ms
    if bound is None:
        interval = stats_raw.get("interval_ms", "")
        bound = int(int(interval) * stale_after_intervals) if interval.isdigit() else 3000
    return Timing(
        int(scraped) if scraped.isdigit() else None,
        bound,
        int(at) if at.isdigit() else None,
        bool(failure_raw),
    )


class EndpointView:
    """One endpoint as readers see it. ``stats``, ``failure`` and ``entry`` are parsed on
    first use, and the parse is shared by every later view of the same data (the cache
    hands out a fresh view per lookup, with the age of that moment)."""

    __slots__ = ("_parsed", "age_ms", "id", "owner", "raw", "state", "timing", "token")

    def __init__(
        self,
        endpoint_id: str,
        *,
        state: State,
        age_ms: int | None,
        owner: str | None,
        token: int | None,
        raw: tuple[str, dict[str, str] | str, dict[str, str] | str],
        timing: Timing | None = None,
    ) -> None:
        self.id = endpoint_id
        self.state = state
        #: Age of the stats against the Redis clock (None without stats).
        self.age_ms = age_ms
        self.owner = owner
        self.token = token
        #: (registry JSON, stats hash or record body, failure hash or record body)
        self.raw = raw
        self.timing = timing
        # stats, failure, entry; False = not parsed yet. Shared with copies.
        self._parsed: list[Any] = [False, False, False]

    def at(self, now_ms: int, healthy: bool = True) -> EndpointView:
        """This endpoint as of ``now_ms``; shares the parsed hashes with ``self``."""
        view = EndpointView.__new__(EndpointView)
        view.id, view.owner, view.token, view.raw = self.id, self.owner, self.token, self.raw
        view.timing, view._parsed = self.timing, self._parsed
        if self.timing is None:
            view.state, view.age_ms = self.state, self.age_ms
        else:
            view.state, view.age_ms = self.timing.state_at(now_ms)
        if not healthy and view.state == "fresh":
            view.state = "stale"  # we cannot know: say so
        return view

    def _parse(self, index: int) -> Any:
        parsed = self._parsed[index]
        if parsed is False:
            try:
                if index == 0:
                    parsed = EndpointStats.from_hash(_fields(self.raw[1])) if self.raw[1] else None
                elif index == 1:
                    parsed = Failure.from_hash(_fields(self.raw[2])) if self.raw[2] else None
                else:
                    parsed = endpoint_from_json(self.id, self.raw[0]) if self.raw[0] else None
            except (ValueError, TypeError, KeyError, RecursionError, PollerError) as exc:
                # Malformed data from a foreign writer reads as absent, and says so once.
                _malformed(_RECORDS[index], self.id, exc)
                parsed = None
            self._parsed[index] = parsed
        return parsed

    @property
    def stats(self) -> EndpointStats | None:
        """Last good stats, or None (never scraped, expired, or malformed)."""
        stats: EndpointStats | None = self._parse(0)
        return stats

    @property
    def failure(self) -> Failure | None:
        failure: Failure | None = self._parse(1)
        return failure

    @property
    def entry(self) -> Endpoint | None:
        """The registry entry (None when a foreign writer stored an invalid one)."""
        entry: Endpoint | None = self._parse(2)
        return entry

    @property
    def engine(self) -> str | None:
        stats = self.stats
        if stats is not None:
            return stats.engine
        entry = self.entry
        return entry.engine if entry is not None else None

    def to_dict(self) -> dict[str, Any]:
        stats, failure = self.stats, self.failure
        return {
            "id": self.id,
            "state": self.state,
            "engine": self.engine,
            "age_ms": self.age_ms,
            "owner": self.owner,
            "token": self.token,
            "stats": None if stats is None else stats.to_dict(),
            "failure": None if failure is None else failure.to_dict(),
        }

    def __repr__(self) -> str:
        return f"EndpointView({self.id!r}, state={self.state!r}, age_ms={self.age_ms})"


def _owner(lease: str) -> tuple[str | None, int | None]:
    if not lease:
        return None, None
    owner, _, token = lease.partition(" ")
    return owner, int(token) if token.isdigit() else None


@dataclass(slots=True)
class View:
    """A snapshot: every registered endpoint at one moment of the Redis clock."""

    now_ms: int
    rev: int
    endpoints: Mapping[str, EndpointView]
    #: Live pollers (heartbeat not expired at ``now_ms``).
    pollers: list[str] = field(default_factory=list)
    #: Redis clock minus local ``time.monotonic()`` in ms when the view was read (None:
    #: unknown, e.g. a view built by hand); lets the picker place local events on it.
    offset_ms: float | None = None
    #: False when the reader had lost Redis: the numbers are the last ones it had.
    healthy: bool = True
    #: Redis clock of the reader's last contact with Redis (None: ``now_ms``).
    confirmed_ms: int | None = None
    #: The ``ViewCache`` that made this view, if one did: a picker given the view picks
    #: on the cache's index (kept current) instead of indexing the view anew.
    source: Any = field(default=None, repr=False, compare=False)

    def __getitem__(self, endpoint_id: str) -> EndpointView:
        return self.endpoints[endpoint_id]

    def get(self, endpoint_id: str) -> EndpointView | None:
        return self.endpoints.get(endpoint_id)

    def counts(self) -> dict[str, int]:
        out = {"fresh": 0, "stale": 0, "failing": 0, "unknown": 0}
        for e in self.endpoints.values():
            out[e.state] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": int(SCHEMA_VERSION),
            "now_ms": self.now_ms,
            "rev": self.rev,
            "pollers": self.pollers,
            "counts": self.counts(),
            "endpoints": [self.endpoints[e].to_dict() for e in sorted(self.endpoints)],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
