"""Gateway replicas share what they sent: every replica's requests in flight, per endpoint.

Every request a gateway fleet sends is one of its replicas' ``LocalLoad``; the scraped
page is as old as its scrape plus the engine's own lag. ``FleetLoad`` adds the two up by
the rule of docs/reader.md ("The load estimate"): the fleet's requests in flight now,
exact for the traffic the gateways sent, plus what the page shows beyond what the
gateways had in flight when it was scraped (traffic from outside the gateways).

A cached reader keeps one ``FleetLoad`` on its cache (``cache.fleet``) and exchanges it
with the other replicas every ``period_s`` in one script call (poller/reader/exchange.py,
poller/schema/scripts/share.lua): our field written when it changed (or is about to
expire), everyone else's read back, expired fields pruned by the Redis clock. The pick
path never touches Redis:
it reads ``FleetLoad.extra``, a dict replaced whole at every exchange.

Redis commands: one per period per replica (20/s at the default 50 ms, the cap the
sharing may use), whatever the request rate; the period is the staleness of the others'
counts, which is what double-books an engine between two exchanges, so it is as short
as the cap allows; a replica that dies leaves the others' view ``ttl_ms`` after its last
write (its field carries its expiry). Redis lost, or no right to the key: the counts of
this replica only, ``cache.load_shared`` False.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from poller.reader.load import LocalLoad

__all__ = ["FleetLoad", "default_replica_id", "pages_of"]

#: How often a replica exchanges its counts (seconds): one command per period, so 20/s,
#: the sharing's cap; nothing else may add a command per replica.
PERIOD_S = 0.05
#: How long a replica's field counts after its last write (ms): a replica that dies
#: leaves the others' view within this (plus one period).
TTL_MS = 800
#: An unchanged field is rewritten when this much of its TTL is left (ms).
REFRESH_BEFORE_MS = 500
#: Pages per endpoint the outside-traffic estimate looks back over (their minimum): a
#: load from outside the gateways is counted once every one of them shows it, so what
#: comes and goes between pages is not (docs/reader.md, "The load estimate").
PAGES = 8
#: How long the exchange may go unanswered before the counts are local only (ms).
LOST_AFTER_MS = 1000
#: How often a refused exchange (no right to the key) is tried again (seconds).
REFUSED_RETRY_S = 5.0


def default_replica_id() -> str:
    """``<hostname>-<pid>-<4 random hex>``: unique per process, readable in the hash."""
    return f"{socket.gethostname()}-{os.getpid()}-{random.getrandbits(16):04x}"


class FleetLoad:
    """The gateway fleet's requests in flight per endpoint, as this replica knows them.

    - ``attach(local)``: a ``LocalLoad`` whose requests this replica publishes (the
      picker attaches the one it is given; a replica normally has one).
    - ``record(pages, offset_ms)`` -> this replica's field: per endpoint with requests
      in flight, ``[in flight now, in flight at the page's scrape, that scrape's ms]``.
    - ``absorb(fields, now_ms, pages, offset_ms)``: the other replicas' fields as the
      share script returned them; recomputes ``extra``.
    - ``extra``: endpoint id -> the load to add to this replica's own in flight there
      (the other replicas' in flight now + the outside traffic the page shows). An
      endpoint missing from it counts its page's running + waiting.

    ``pages`` is ``(endpoint id, running + waiting, scraped_at_ms)`` for the endpoints of
    the view, ``offset_ms`` the Redis clock minus the local clock (``ViewCache``'s).
    """

    def __init__(
        self,
        replica_id: str | None = None,
        *,
        period_s: float = PERIOD_S,
        ttl_ms: int = TTL_MS,
    ) -> None:
        if replica_id is not None and (not isinstance(replica_id, str) or not replica_id):
            raise ValueError(f"replica_id must be a non-empty string, got {replica_id!r}")
        self.replica_id = replica_id or default_replica_id()
        self.period_s = period_s
        self.ttl_ms = ttl_ms
        self._locals: weakref.WeakSet[LocalLoad] = weakref.WeakSet()
        #: Endpoint id -> load to add to our own in flight (see the class doc).
        self.extra: dict[str, float] = {}
        #: Replicas seen live at the last exchange (ours not counted).
        self.peers = 0
        #: Monotonic seconds of the last exchange Redis answered; None: never.
        self.exchanged_at: float | None = None
        self._peer_now: dict[str, int] = {}
        #: The attached loads' clock at the last exchange: ours started since then are
        #: matched by about ``peers`` times as many of the others', not seen yet.
        self.since_s = -math.inf
        # endpoint -> recent (scraped_at_ms, what the page showed beyond the gateways)
        self._outside: dict[str, deque[tuple[int, int]]] = {}
        self._last_record = ""
        self._written_ms: float = -1e15
        # This replica's field, per endpoint, as ``record`` last built it.
        self._entries: dict[str, list[int]] | None = None
        # Replica id -> (its field's JSON, parsed: endpoint -> (now, at, scraped ms)).
        self._fields: dict[str, tuple[str, dict[str, tuple[int, int, int]]]] = {}
        self._lock = threading.Lock()

    # --- this replica ----------------------------------------------------------------------

    def attach(self, local: LocalLoad) -> None:
        self._locals.add(local)
        local.fleet = self

    def _mine(
        self, endpoint_id: str, since_local_s: float, loads: list[LocalLoad]
    ) -> tuple[int, int]:
        """(in flight now, in flight at ``since_local_s``) over ``loads`` (the attached
        ones, listed once per call of ``record`` or ``absorb``)."""
        if len(loads) == 1:
            local = loads[0]
            return local.in_flight(endpoint_id), local.in_flight_at(endpoint_id, since_local_s)
        now = at = 0
        for local in loads:
            now += local.in_flight(endpoint_id)
            at += local.in_flight_at(endpoint_id, since_local_s)
        return now, at

    def _ids(self) -> set[str]:
        ids: set[str] = set()
        for local in list(self._locals):
            ids.update(local.busy_ids())
        return ids

    def take_changed(self) -> set[str]:
        """Endpoints the attached loads started or ended requests to since the last call."""
        ids: set[str] = set()
        for local in list(self._locals):
            ids |= local.take_changed()
        return ids

    def record(
        self,
        pages: Mapping[str, tuple[int, int]],
        offset_ms: float,
        changed: Iterable[str] | None = None,
    ) -> str:
        """This replica's field (JSON), "" when it has nothing in flight anywhere.
        ``changed``: the endpoints whose page changed or to which this replica started
        or ended requests since the last call (None: any may have); only those are
        worked out again."""
        loads = list(self._locals)
        entries = self._entries
        todo: Iterable[str]
        if changed is None or entries is None:
            entries = self._entries = {}
            todo = self._ids()
        else:
            todo = changed
        for endpoint_id in todo:
            page = pages.get(endpoint_id)
            scraped_ms = page[1] if page is not None else 0
            now, at = self._mine(endpoint_id, (scraped_ms - offset_ms) / 1000, loads)
            if now or at:
                entries[endpoint_id] = [now, at, scraped_ms]
            else:
                entries.pop(endpoint_id, None)
        if not entries:
            return ""
        return json.dumps(dict(sorted(entries.items())), separators=(",", ":"))

    def outgoing(self, record: str, now_ms: float) -> str:
        """What the exchange writes: the record when it changed or nears its expiry,
        "-" once when it became empty, "" (nothing) otherwise."""
        if record == self._last_record and (
            not record or now_ms - self._written_ms < self.ttl_ms - REFRESH_BEFORE_MS
        ):
            return ""
        self._last_record = record
        self._written_ms = now_ms
        return record or "-"

    def forget_written(self) -> None:
        """The last write may not have landed (an error): write again next time."""
        self._last_record = "\0"

    # --- the others ----------------------------------------------------------------------

    def absorb(
        self,
        fields: Sequence[Any],
        pages: Mapping[str, tuple[int, int]],
        offset_ms: float,
        *,
        shared: bool = True,
        changed: Iterable[str] | None = None,
    ) -> None:
        """The other replicas' fields (``[id, value, id, value, ...]`` as the script
        returns them after the TIME pair); ``shared=False``: Redis did not answer, our
        own counts only (every peer's left out). ``changed``: as for ``record`` (None:
        every endpoint is worked out again); then only those and the endpoints in the
        fields of replicas whose counts changed, came or went are: the others' figures
        depend on nothing else."""
        peers, moved = self._take_fields(fields if shared else [])
        peer_now, peer_at = self._peer_counts(pages)
        loads = list(self._locals)
        todo: Iterable[str]
        if changed is None:
            extra: dict[str, float] = {}
            todo = pages
            for gone in [e for e in self._outside if e not in pages]:
                del self._outside[gone]
        else:
            extra = dict(self.extra)
            todo = {*changed, *moved}
            for gone in [e for e in todo if e not in pages]:
                extra.pop(gone, None)
                self._outside.pop(gone, None)
                todo.discard(gone)
        for endpoint_id in todo:
            requests, scraped_ms = pages[endpoint_id]
            _, at_me = self._mine(endpoint_id, (scraped_ms - offset_ms) / 1000, loads)
            gateways_at = at_me + peer_at.get(endpoint_id, 0)
            history = self._outside.get(endpoint_id)
            if history is None:
                history = self._outside[endpoint_id] = deque(maxlen=PAGES)
            outside = max(0, requests - gateways_at)
            if history and history[-1][0] == scraped_ms:
                history[-1] = (scraped_ms, outside)  # the same page, better known now
            else:
                history.append((scraped_ms, outside))
            extra[endpoint_id] = float(min(o for _, o in history) + peer_now.get(endpoint_id, 0))
        clocks = [local.now() for local in loads]
        with self._lock:
            self.since_s = clocks[0] if clocks else -math.inf
            self.extra = extra
            self._peer_now = peer_now
            self.peers = peers
            if shared:
                self.exchanged_at = time.monotonic()

    def _take_fields(self, fields: Sequence[Any]) -> tuple[int, set[str]]:
        """Keep the replicas' fields, parsing only those whose counts changed; returns
        (live peers, the endpoints in the fields that changed, came or went)."""
        old, new = self._fields, {}
        moved: set[str] = set()
        for i in range(1, len(fields), 2):
            replica, (_, _, body) = str(fields[i - 1]), str(fields[i]).partition(" ")
            held = old.get(replica)
            if held is not None and held[0] == body:
                new[replica] = held
                continue
            counts = _parse(body)
            if counts is None:
                continue
            new[replica] = (body, counts)
            moved.update(counts)
            if held is not None:
                moved.update(held[1])
        for replica, (_, counts) in old.items():
            if replica not in new:
                moved.update(counts)
        self._fields = new
        return len(new), moved

    def _peer_counts(
        self, pages: Mapping[str, tuple[int, int]]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """(endpoint -> the peers' in flight now, endpoint -> theirs in flight at the
        endpoint's page's scrape; a peer that has not seen that page yet: its now)."""
        peer_now: dict[str, int] = {}
        peer_at: dict[str, int] = {}
        for _, counts in self._fields.values():
            for endpoint_id, (now, at, scraped_ms) in counts.items():
                peer_now[endpoint_id] = peer_now.get(endpoint_id, 0) + now
                page = pages.get(endpoint_id)
                if page is not None and scraped_ms != page[1]:
                    at = now  # that replica has not seen this page yet: its best guess
                peer_at[endpoint_id] = peer_at.get(endpoint_id, 0) + at
        return peer_now, peer_at

    @property
    def shared(self) -> bool:
        """The other replicas' counts are current (the last exchange answered within
        ``LOST_AFTER_MS``): False means this replica's own counts only."""
        at = self.exchanged_at
        return at is not None and (time.monotonic() - at) * 1000 <= LOST_AFTER_MS

    def peer_in_flight(self, endpoint_id: str) -> int:
        """The other replicas' requests in flight to ``endpoint_id`` (last exchange)."""
        return self._peer_now.get(endpoint_id, 0)

    def __repr__(self) -> str:
        return f"FleetLoad({self.replica_id!r}, {self.peers} peers, shared={self.shared})"


def _parse(body: str) -> dict[str, tuple[int, int, int]] | None:
    """A replica's counts (``{endpoint: [now, at, scraped ms]}``), None: not readable."""
    try:
        raw = json.loads(body)
    except ValueError:
        return None
    if not isinstance(raw, dict):
        return None
    counts: dict[str, tuple[int, int, int]] = {}
    for endpoint_id, triple in raw.items():
        try:
            now, at, scraped_ms = (int(x) for x in triple)
        except (TypeError, ValueError):
            continue
        counts[str(endpoint_id)] = (now, at, scraped_ms)
    return counts


def pages_of(items: Iterable[tuple[str, Any]]) -> dict[str, tuple[int, int]]:
    """``endpoint id -> (running + waiting, scraped_at_ms)`` of decoded endpoints."""
    pages: dict[str, tuple[int, int]] = {}
    for endpoint_id, view in items:
        stats = getattr(view, "stats", None)
        if stats is not None:
            pages[endpoint_id] = (stats.running + stats.waiting, stats.scraped_at_ms)
    return pages
