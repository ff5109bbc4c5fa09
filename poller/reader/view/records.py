"""One endpoint as readers see it: ``EndpointView``, and the ``Timing`` its state
follows.

States (docs/schema.md): **fresh** (stats younger than the bound, no newer failure),
**stale** (older), **failing** (a failure is current), **unknown** (nothing in Redis).
The bound is ``stale_after_intervals`` times the interval the poller wrote with the stats.
``decode.py`` builds these from the read scripts' replies, one decode for a snapshot,
the cache and ``get(id)`` alike.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from poller.errors import PollerError
from poller.schema.endpoint import Endpoint, endpoint_from_json
from poller.schema.stats import EndpointStats, Failure

__all__ = ["DEFAULT_BOUND_MS", "EndpointView", "State", "Timing"]

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


#: The freshness bound (ms) of stats that name no interval, at any setting.
DEFAULT_BOUND_MS = 3000


class Timing(NamedTuple):
    """What the state of an endpoint depends on, read once from its records' headers."""

    scraped_at_ms: int | None
    bound_ms: int
    failure_at_ms: int | None
    failing: bool  # a failure record exists

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


class _Fields:
    """An ``EndpointView``'s fields, assignable: a view is built as this and then moved
    to its own class, which refuses assignment. Building through ``__setattr__`` guards
    costs four times as much (docs/performance.md, "The view's records"), and a cache
    builds one per lookup."""

    __slots__ = ("_parsed", "age_ms", "id", "owner", "raw", "state", "timing", "token")

    id: str
    state: State
    age_ms: int | None
    owner: str | None
    token: int | None
    raw: tuple[str, dict[str, str] | str, dict[str, str] | str]
    timing: Timing | None
    _parsed: list[Any]


def _build(
    endpoint_id: str,
    state: State,
    age_ms: int | None,
    owner: str | None,
    token: int | None,
    raw: tuple[str, dict[str, str] | str, dict[str, str] | str],
    timing: Timing | None,
    parsed: list[Any],
) -> EndpointView:
    view = _Fields.__new__(_Fields)
    view.id, view.state, view.age_ms, view.owner, view.token = (
        endpoint_id,
        state,
        age_ms,
        owner,
        token,
    )
    view.raw, view.timing, view._parsed = raw, timing, parsed
    view.__class__ = EndpointView  # the same slots: from here on it refuses assignment
    return view  # type: ignore[return-value]


class EndpointView(_Fields):
    """One endpoint as readers see it; immutable. ``stats``, ``failure`` and ``entry``
    are parsed on first use, and the parse is shared by every later view of the same
    records (``at``).

    Fields: ``id`` (the registry hash field); ``state`` (fresh, stale, failing or
    unknown, as of the moment the view shows); ``age_ms`` (age of the stats against the
    Redis clock, None without stats); ``owner`` and ``token`` (the poller that wrote the
    newer of the endpoint's two records, and its fencing token: docs/reader.md);
    ``raw`` (registry JSON, stats hash or record body, failure hash or record body);
    ``timing`` (what the state depends on; None for a view built by hand).
    """

    __slots__ = ()
    __match_args__ = ("id", "state", "age_ms")

    def __new__(
        cls,
        endpoint_id: str,
        *,
        state: State,
        age_ms: int | None,
        owner: str | None,
        token: int | None,
        raw: tuple[str, dict[str, str] | str, dict[str, str] | str],
        timing: Timing | None = None,
    ) -> EndpointView:
        # stats, failure, entry; False = not parsed yet. Shared with the views of ``at``.
        return _build(endpoint_id, state, age_ms, owner, token, raw, timing, [False, False, False])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"EndpointView is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"EndpointView is immutable: cannot delete {name!r}")

    def at(self, now_ms: int, healthy: bool = True) -> EndpointView:
        """This endpoint as of ``now_ms``; shares the parsed records with ``self``."""
        timing = self.timing
        if timing is None:
            state, age = self.state, self.age_ms
        else:
            state, age = timing.state_at(now_ms)
        if not healthy and state == "fresh":
            state = "stale"  # we cannot know: say so
        return _build(self.id, state, age, self.owner, self.token, self.raw, timing, self._parsed)

    def _parse(self, index: int) -> Any:
        done = self._parsed
        parsed = done[index]
        if parsed is False:
            raw = self.raw
            try:
                if index == 0:
                    parsed = EndpointStats.from_hash(_fields(raw[1])) if raw[1] else None
                elif index == 1:
                    parsed = Failure.from_hash(_fields(raw[2])) if raw[2] else None
                else:
                    parsed = endpoint_from_json(self.id, raw[0]) if raw[0] else None
            except (ValueError, TypeError, KeyError, RecursionError, PollerError) as exc:
                # Malformed data from a foreign writer reads as absent, and says so once.
                _malformed(_RECORDS[index], self.id, exc)
                parsed = None
            done[index] = parsed
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

    def _key(self) -> tuple[Any, ...]:
        return (self.id, self.state, self.age_ms, self.owner, self.token, self.raw, self.timing)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EndpointView):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # its records are dicts

    def __repr__(self) -> str:
        return f"EndpointView({self.id!r}, state={self.state!r}, age_ms={self.age_ms})"

    def __reduce__(self) -> tuple[Any, ...]:
        # copy and pickle: rebuilt whole (the parse is not carried)
        return (_rebuild, self._key())


def _rebuild(
    endpoint_id: str,
    state: State,
    age_ms: int | None,
    owner: str | None,
    token: int | None,
    raw: tuple[str, dict[str, str] | str, dict[str, str] | str],
    timing: Timing | None,
) -> EndpointView:
    return _build(endpoint_id, state, age_ms, owner, token, raw, timing, [False, False, False])
