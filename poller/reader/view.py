"""The shared view as readers see it: snapshot script, states, and a reference picker.

Pure functions over the replies of two read-only Lua scripts (a whole snapshot, or one
endpoint), shared by the asyncio and the threaded reader in ``reader.py``.

States (DESIGN.md): **fresh** (stats younger than the bound, no newer failure),
**stale** (older), **failing** (a failure is current), **unknown** (nothing in Redis).
The bound is ``stale_after_intervals`` times the interval the poller wrote with the stats.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from poller.redis.keys import Keys
from poller.registry import Endpoint, endpoint_from_json
from poller.stats import EndpointStats, Failure

__all__ = [
    "EndpointView",
    "State",
    "View",
    "ViewCache",
    "build_view",
    "judge",
]

State = Literal["fresh", "stale", "failing", "unknown"]


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


def judge(
    stats_raw: Mapping[str, str],
    failure_raw: Mapping[str, str],
    now_ms: int,
    stale_after_intervals: float = 2.0,
    stale_after_ms: int | None = None,
) -> tuple[State, int | None]:
    """(state, age of the stats in ms) from the two hashes and the Redis clock."""
    return timing(stats_raw, failure_raw, stale_after_intervals, stale_after_ms).state_at(now_ms)


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
            except Exception:  # malformed data from a foreign writer reads as absent
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
    endpoints: dict[str, EndpointView]
    #: Live pollers (heartbeat not expired at ``now_ms``).
    pollers: list[str] = field(default_factory=list)

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
            "schema": 1,
            "now_ms": self.now_ms,
            "rev": self.rev,
            "pollers": self.pollers,
            "counts": self.counts(),
            "endpoints": [self.endpoints[e].to_dict() for e in sorted(self.endpoints)],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def make_entry(
    endpoint_id: str,
    entry_json: str,
    stats_raw: dict[str, str],
    failure_raw: dict[str, str],
    lease: str,
    now_ms: int,
    stale_after_intervals: float,
    stale_after_ms: int | None,
) -> EndpointView:
    t = timing(stats_raw, failure_raw, stale_after_intervals, stale_after_ms)
    state, age = t.state_at(now_ms)
    owner, token = _owner(lease)
    return EndpointView(
        endpoint_id,
        state=state,
        age_ms=age,
        owner=owner,
        token=token,
        raw=(entry_json, stats_raw, failure_raw),
        timing=t,
    )


def _record(record: str | None, now_ms: int, fields: int) -> tuple[list[str], str] | None:
    """Split a view record ``header|json`` into header fields and body; None if it is
    absent, expired (the header's expiry has passed) or malformed."""
    if not record:
        return None
    head, sep, body = record.partition("|")
    parts = head.split(" ")
    if not sep or len(parts) != fields or not all(p.isdigit() for p in parts[: fields - 2]):
        return None
    expires = int(parts[fields - 3])
    return (parts, body) if expires > now_ms else None


def build_view(
    reply: Sequence[Any], stale_after_intervals: float = 2.0, stale_after_ms: int | None = None
) -> View:
    """The snapshot script's reply -> View (pure; shared by the async and sync readers).

    Stats records are ``<scraped_at_ms> <interval_ms> <expires_at_ms> <poller> <token>|``
    and failure records ``<at_ms> <expires_at_ms> <poller> <token>|`` followed by the
    hash's fields as JSON; only the header is read here, the JSON on first use.
    """
    now_ms = _now_ms(reply[0], reply[1])
    members = reply[4]
    pollers = sorted(
        str(members[i]) for i in range(0, len(members), 2) if float(members[i + 1]) >= now_ms
    )
    view_stats, view_failures = _pairs(reply[5]), _pairs(reply[6])
    endpoints: dict[str, EndpointView] = {}
    for endpoint_id, entry_json in _pairs(reply[3]).items():
        stats = _record(view_stats.get(endpoint_id), now_ms, 5)
        failure = _record(view_failures.get(endpoint_id), now_ms, 4)
        scraped = failure_at = None
        owner, token, writer_at = None, None, -1
        bound = stale_after_ms
        if stats is not None:
            scraped, writer_at = int(stats[0][0]), int(stats[0][0])
            owner, token = stats[0][3], int(stats[0][4]) if stats[0][4].isdigit() else None
            if bound is None:
                bound = int(int(stats[0][1]) * stale_after_intervals)
        if failure is not None:
            failure_at = int(failure[0][0])
            if failure_at >= writer_at:
                owner, token = (
                    failure[0][2],
                    int(failure[0][3]) if failure[0][3].isdigit() else None,
                )
        t = Timing(scraped, 3000 if bound is None else bound, failure_at, failure is not None)
        state, age = t.state_at(now_ms)
        endpoints[endpoint_id] = EndpointView(
            endpoint_id,
            state=state,
            age_ms=age,
            owner=owner,
            token=token,
            raw=(entry_json, stats[1] if stats else {}, failure[1] if failure else {}),
            timing=t,
        )
    return View(now_ms, int(reply[2]), endpoints, pollers)


def one_from_reply(
    endpoint_id: str,
    reply: Sequence[Any],
    stale_after_intervals: float = 2.0,
    stale_after_ms: int | None = None,
) -> tuple[int, EndpointView | None]:
    """GET_ONE's reply -> (Redis now ms, the endpoint, or None if not registered)."""
    now_ms = _now_ms(reply[0], reply[1])
    if not reply[2]:
        return now_ms, None
    return now_ms, make_entry(
        endpoint_id,
        str(reply[2]),
        _pairs(reply[3]),
        _pairs(reply[4]),
        str(reply[5]),
        now_ms,
        stale_after_intervals,
        stale_after_ms,
    )


def snapshot_call(keys: Keys) -> tuple[list[str], list[str]]:
    return [
        keys.endpoints,
        keys.members,
        keys.endpoints_rev,
        keys.view_stats,
        keys.view_failures,
    ], []


def get_one_call(keys: Keys, endpoint_id: str) -> tuple[list[str], list[str]]:
    return [
        keys.endpoints,
        keys.stats(endpoint_id),
        keys.failure(endpoint_id),
        keys.lease(endpoint_id),
    ], [endpoint_id]


class ViewCache:
    """A local copy of the view that follows events; every read is a dict lookup.

    Ages stay right between events: the cache keeps the offset between the local
    monotonic clock and the Redis clock, taken at every reply from Redis. While Redis is
    unreachable (``healthy`` False) it keeps serving the last view, ages growing, and
    reports nothing as fresh.
    """

    def __init__(self, stale_after_intervals: float = 2.0, stale_after_ms: int | None = None):
        self.stale_after_intervals = stale_after_intervals
        self.stale_after_ms = stale_after_ms
        self._views: dict[str, EndpointView] = {}
        self._offset_ms = 0.0
        self.rev = -1
        self.pollers: list[str] = []
        self.healthy = False
        self.loaded = False
        self.updated_at = 0.0  # monotonic seconds of the last reply applied

    def _clock(self, redis_now_ms: int) -> None:
        self._offset_ms = redis_now_ms - time.monotonic() * 1000
        self.updated_at = time.monotonic()

    def now_ms(self) -> int:
        """The Redis clock, estimated locally."""
        return int(time.monotonic() * 1000 + self._offset_ms)

    def load(self, view: View) -> None:
        self._views = dict(view.endpoints)
        self.rev = view.rev
        self.pollers = view.pollers
        self._clock(view.now_ms)
        self.loaded = True

    def apply(self, endpoint_id: str, now_ms: int, entry: EndpointView | None) -> None:
        if entry is None:
            self._views.pop(endpoint_id, None)
        else:
            self._views[endpoint_id] = entry
        self._clock(now_ms)

    def get(self, endpoint_id: str) -> EndpointView | None:
        base = self._views.get(endpoint_id)
        return None if base is None else base.at(self.now_ms(), self.healthy)

    def ids(self) -> list[str]:
        return list(self._views)

    def view(self) -> View:
        now = self.now_ms()
        healthy = self.healthy
        endpoints = {e: v.at(now, healthy) for e, v in list(self._views.items())}
        return View(now, self.rev, endpoints, list(self.pollers))
