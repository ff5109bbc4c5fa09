"""The shared view as readers see it: ``View`` (a snapshot) and ``EndpointView``.

Both are immutable. ``replies.py`` decodes the read scripts' replies into them, one
decode for a snapshot, the cache and ``get(id)`` alike.

States (docs/schema.md): **fresh** (stats younger than the bound, no newer failure),
**stale** (older), **failing** (a failure is current), **unknown** (nothing in Redis).
The bound is ``stale_after_intervals`` times the interval the poller wrote with the stats.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from poller.errors import PollerError
from poller.schema.endpoint import Endpoint, endpoint_from_json
from poller.schema.keys import SCHEMA_VERSION, Keys
from poller.schema.stats import EndpointStats, Failure

if TYPE_CHECKING:
    from poller.reader.cache import ViewCache

__all__ = [
    "DEFAULT_BOUND_MS",
    "EndpointView",
    "State",
    "Timing",
    "View",
    "log_schema_missing",
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


def log_schema_missing(namespace: str) -> None:
    """The one WARNING a cached reader logs when its namespace has no schema key (again
    only after the key appeared and went)."""
    log.warning(
        "namespace %s has no schema key (%s): nothing ever wrote it: wrong namespace? "
        "The view stays empty and the cache unhealthy until a poller writes there",
        namespace,
        Keys(namespace).schema,
    )


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


_ID, _STATE, _AGE, _OWNER, _TOKEN, _RAW, _TIMING, _PARSED = range(8)


class EndpointView(tuple):  # type: ignore[type-arg]
    """One endpoint as readers see it; immutable (a tuple underneath, for speed: the
    cache hands out one per lookup). ``stats``, ``failure`` and ``entry`` are parsed on
    first use, and the parse is shared by every later view of the same records (``at``).
    """

    __slots__ = ()

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
        parsed: list[Any] = [False, False, False]
        return tuple.__new__(cls, (endpoint_id, state, age_ms, owner, token, raw, timing, parsed))

    #: The endpoint id (the registry hash field).
    id: str = property(itemgetter(_ID))  # type: ignore[assignment]
    #: fresh, stale, failing or unknown, as of the moment the view shows.
    state: State = property(itemgetter(_STATE))  # type: ignore[assignment]
    #: Age of the stats against the Redis clock (None without stats).
    age_ms: int | None = property(itemgetter(_AGE))  # type: ignore[assignment]
    #: The poller that wrote the newer of the endpoint's two records (docs/reader.md).
    owner: str | None = property(itemgetter(_OWNER))  # type: ignore[assignment]
    #: That poller's fencing token for the endpoint.
    token: int | None = property(itemgetter(_TOKEN))  # type: ignore[assignment]
    #: (registry JSON, stats hash or record body, failure hash or record body)
    raw: tuple[str, dict[str, str] | str, dict[str, str] | str] = property(itemgetter(_RAW))  # type: ignore[assignment]
    #: What the state depends on (None for a view built by hand without one).
    timing: Timing | None = property(itemgetter(_TIMING))  # type: ignore[assignment]

    def at(self, now_ms: int, healthy: bool = True) -> EndpointView:
        """This endpoint as of ``now_ms``; shares the parsed records with ``self``."""
        timing = self[_TIMING]
        if timing is None:
            state, age = self[_STATE], self[_AGE]
        else:
            state, age = timing.state_at(now_ms)
        if not healthy and state == "fresh":
            state = "stale"  # we cannot know: say so
        return tuple.__new__(
            EndpointView,
            (self[_ID], state, age, self[_OWNER], self[_TOKEN], self[_RAW], timing, self[_PARSED]),
        )

    def _parse(self, index: int) -> Any:
        done = self[_PARSED]
        parsed = done[index]
        if parsed is False:
            raw = self[_RAW]
            try:
                if index == 0:
                    parsed = EndpointStats.from_hash(_fields(raw[1])) if raw[1] else None
                elif index == 1:
                    parsed = Failure.from_hash(_fields(raw[2])) if raw[2] else None
                else:
                    parsed = endpoint_from_json(self[_ID], raw[0]) if raw[0] else None
            except (ValueError, TypeError, KeyError, RecursionError, PollerError) as exc:
                # Malformed data from a foreign writer reads as absent, and says so once.
                _malformed(_RECORDS[index], self[_ID], exc)
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

    def __repr__(self) -> str:
        return f"EndpointView({self.id!r}, state={self.state!r}, age_ms={self.age_ms})"

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # copy and pickle: rebuild through __new__ with its keywords
        keywords: dict[str, Any] = {"state": self.state, "age_ms": self.age_ms}
        keywords |= {"owner": self.owner, "token": self.token}
        keywords |= {"raw": self.raw, "timing": self.timing}
        return (self.id,), keywords


@dataclass(frozen=True, slots=True)
class View:
    """A snapshot: every registered endpoint at one moment of the Redis clock. Frozen:
    a reader builds it whole, and a view shared by tasks or threads never changes."""

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
    #: True when the namespace has no schema key (``{namespace}:schema``): nothing ever
    #: wrote there (no poller, no ``poller endpoints`` change), which mostly means a wrong
    #: namespace. The view is empty then, and a cache built on it is not ``healthy``.
    schema_missing: bool = False
    #: The ``ViewCache`` that made this view, if one did: a picker given the view picks
    #: on the cache's index (kept current) instead of indexing the view anew.
    cache: ViewCache | None = field(default=None, repr=False, compare=False)

    @property
    def source(self) -> ViewCache | None:
        """Deprecated: ``cache``."""
        warnings.warn("View.source is deprecated: use View.cache", DeprecationWarning, stacklevel=2)
        return self.cache

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
