"""The replies of the read scripts as views: one decode for every way of reading.

``snapshot.lua`` reads every endpoint, ``get_records.lua`` one; both return an endpoint
as its registry entry and its two compact view records (docs/schema.md), and
``view_from_records`` is the one decode of those, used by a snapshot (``LazyEndpoints``),
by the cache and by ``get(id)`` alike. A snapshot builds three dicts of strings; each
endpoint is decoded only when asked for, so a caller that reads ten endpoints of a
thousand pays for ten.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from poller.errors import SchemaMismatch
from poller.reader.view.records import DEFAULT_BOUND_MS, EndpointView, Timing
from poller.reader.view.snapshot import View
from poller.redis.clock import server_ms
from poller.schema.keys import SCHEMA_VERSION, Keys
from poller.schema.records import FAILURE_HEADER, STATS_HEADER, split
from poller.util.text import digits

__all__ = [
    "Held",
    "LazyEndpoints",
    "build_view",
    "check_schema",
    "held_after",
    "one_from_records",
    "records_call",
    "snapshot_call",
    "view_from_records",
]


def check_schema(found: Any) -> None:
    """Raise ``SchemaMismatch`` when Redis holds another schema version than this
    reader's. An absent key passes: no poller has written there yet."""
    found = "" if found is None else str(found)
    if found and found != SCHEMA_VERSION:
        raise SchemaMismatch(
            f"Redis holds schema {found}, this reader reads {SCHEMA_VERSION}: upgrade "
            "llmgw-poller on the gateway (or read another namespace)",
            found=found,
            expected=SCHEMA_VERSION,
        )


def _pairs(flat: Sequence[Any]) -> dict[str, str]:
    # Replies are already str (the client decodes them): no per-element conversion.
    it = iter(flat)
    return dict(zip(it, it, strict=True))


def view_from_records(
    endpoint_id: str,
    entry_json: str,
    stats_record: str | None,
    failure_record: str | None,
    now_ms: int,
    stale_after_intervals: float = 2.0,
    stale_after_ms: int | None = None,
) -> EndpointView:
    """One endpoint from its registry entry and its two view records at ``now_ms``.

    The owner shown is the writer of the newer record (docs/schema.md); only the headers
    are read here, the JSON on first use.
    """
    stats = split(stats_record, now_ms, STATS_HEADER)
    failure = split(failure_record, now_ms, FAILURE_HEADER)
    scraped = failure_at = None
    owner, token, writer_at = None, None, -1
    bound = stale_after_ms
    if stats is not None:
        head = stats[0]
        scraped = writer_at = int(head[0])
        owner, token = head[3], int(head[4]) if digits(head[4]) else None
        if bound is None:
            bound = int(int(head[1]) * stale_after_intervals)
    if failure is not None:
        head = failure[0]
        failure_at = int(head[0])
        if failure_at >= writer_at:
            owner, token = head[2], int(head[3]) if digits(head[3]) else None
    t = Timing(
        scraped, DEFAULT_BOUND_MS if bound is None else bound, failure_at, failure is not None
    )
    state, age = t.state_at(now_ms)
    return EndpointView(
        endpoint_id,
        state=state,
        age_ms=age,
        owner=owner,
        token=token,
        raw=(entry_json, stats[1] if stats else {}, failure[1] if failure else {}),
        timing=t,
    )


class LazyEndpoints(Mapping[str, EndpointView]):
    """The endpoints of a snapshot, each built on first access.

    A snapshot of 1,000 endpoints is three dicts of strings; a caller that looks at ten
    endpoints pays for ten. Iteration follows the registry.
    """

    __slots__ = ("_built", "entries", "failures", "now_ms", "stale", "stats")

    def __init__(
        self,
        entries: dict[str, str],
        stats: dict[str, str],
        failures: dict[str, str],
        now_ms: int,
        stale: tuple[float, int | None] = (2.0, None),
    ) -> None:
        self.entries, self.stats, self.failures = entries, stats, failures
        self.now_ms, self.stale = now_ms, stale
        self._built: dict[str, EndpointView] = {}

    def __getitem__(self, endpoint_id: str) -> EndpointView:
        view = self._built.get(endpoint_id)
        if view is None:
            view = view_from_records(
                endpoint_id,
                self.entries[endpoint_id],
                self.stats.get(endpoint_id),
                self.failures.get(endpoint_id),
                self.now_ms,
                *self.stale,
            )
            self._built[endpoint_id] = view
        return view

    def decoded(self) -> dict[str, EndpointView]:
        """The endpoints decoded so far (a copy): a cache loading this snapshot keeps
        them rather than decoding the same records again."""
        return dict(self._built)

    def __contains__(self, endpoint_id: object) -> bool:
        return endpoint_id in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"LazyEndpoints({len(self.entries)} endpoints)"


#: The registry a reader read last, as ``(epoch, rev, entries)``: the next snapshot skips
#: re-reading it while Redis still has that epoch and revision (snapshot.lua).
Held = tuple[str, str, dict[str, str]]


def build_view(
    reply: Sequence[Any],
    stale_after_intervals: float = 2.0,
    stale_after_ms: int | None = None,
    held: Held | None = None,
    *,
    read_at_ms: float | None = None,
) -> View:
    """The snapshot script's reply -> View (pure; shared by the async and sync readers).

    Builds three dicts of strings and nothing per endpoint: see ``LazyEndpoints``. Where
    the script left the registry out (0), the entries are ``held``'s: the call that
    passed ``held`` to ``snapshot_call`` must pass the same one here. ``read_at_ms``:
    the local ``time.monotonic()`` in ms when the reply arrived, which sets the view's
    ``offset_ms`` (None: unknown).
    """
    if len(reply) > 8:
        check_schema(reply[8])
    now_ms = server_ms(reply)
    members = reply[4]
    pollers = sorted(
        str(members[i]) for i in range(0, len(members), 2) if float(members[i + 1]) >= now_ms
    )
    if reply[3] == 0:
        if held is None:
            raise ValueError("the snapshot left the registry out, but none was held")
        entries = held[2]
    else:
        entries = _pairs(reply[3])
    endpoints = LazyEndpoints(
        entries,
        _pairs(reply[5]),
        _pairs(reply[6]),
        now_ms,
        (stale_after_intervals, stale_after_ms),
    )
    offset_ms = None if read_at_ms is None else now_ms - read_at_ms
    return View(now_ms, int(reply[2]), endpoints, pollers, offset_ms=offset_ms)


def held_after(reply: Sequence[Any], view: View) -> Held | None:
    """What a reader holds after ``view``: its registry, or None without an epoch."""
    epoch = str(reply[7]) if len(reply) > 7 else ""
    endpoints = view.endpoints
    if not epoch or not isinstance(endpoints, LazyEndpoints):
        return None
    return epoch, str(reply[2]), endpoints.entries


def snapshot_call(keys: Keys, held: Held | None = None) -> tuple[list[str], list[str]]:
    """The snapshot script's keys and arguments; with ``held``, the registry is left out
    of the reply if it is still the one held."""
    return [
        keys.endpoints,
        keys.members,
        keys.endpoints_rev,
        keys.view_stats,
        keys.view_failures,
        keys.epoch,
        keys.schema,
    ], [held[1], held[0]] if held is not None else []


def records_call(keys: Keys, endpoint_id: str) -> tuple[list[str], list[str]]:
    """``get_records.lua``'s keys and arguments: one endpoint as a snapshot shows it."""
    return [keys.endpoints, keys.view_stats, keys.view_failures, keys.schema], [endpoint_id]


def one_from_records(
    endpoint_id: str,
    reply: Sequence[Any],
    stale_after_intervals: float = 2.0,
    stale_after_ms: int | None = None,
) -> EndpointView | None:
    """``get_records.lua``'s reply -> the endpoint as a snapshot at that moment would
    show it, or None if it is not registered."""
    if len(reply) > 5:
        check_schema(reply[5])
    if not reply[2]:
        return None
    return view_from_records(
        endpoint_id,
        str(reply[2]),
        str(reply[3]) or None,
        str(reply[4]) or None,
        server_ms(reply),
        stale_after_intervals,
        stale_after_ms,
    )
