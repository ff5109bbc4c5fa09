"""Gateway replicas share what they sent: every replica's requests in flight, per endpoint.

Every request a gateway fleet sends is one of its replicas' ``LocalLoad``; the scraped
page is as old as its scrape plus the engine's own lag. ``FleetLoad`` adds the two up by
the rule of docs/reader.md ("The load estimate"): the fleet's requests in flight now,
exact for the traffic the gateways sent, plus what the page shows beyond what the
gateways had in flight when it was scraped (traffic from outside the gateways).

A ``Router`` keeps one. Its exchange (poller/reader/exchange/) writes this replica's
``own_field`` when its counts change; Redis keeps the gateways' totals per endpoint, and
the others' share of them comes back pushed as it changes (``hear``) or read (``read``,
the totals that moved: ``Others``, others.py). A replica that stops calling is taken
out of the totals within the exchange's TTL. The pick path never touches Redis: it
reads ``extra``. Redis lost, or no right to the keys: the counts of this replica only
(``outside``).
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from poller.reader.load.local import LocalLoad
from poller.reader.load.others import Others

__all__ = ["FleetLoad", "default_replica_id", "pages_of"]

#: Pages per endpoint the outside-traffic estimate looks back over (their minimum): a
#: load from outside the gateways is counted once every one of them shows it, so what
#: comes and goes between pages is not (docs/reader.md, "The load estimate").
PAGES = 8
#: The pages are taken as current (the engines' own lag small against their scrape's
#: age) while they miss at most this share of the requests the gateways had in flight
#: when they were scraped: a page measured when it is scraped shows every one of them
#: (docs/reader.md, "The load estimate").
CURRENT_MISS = 0.03
#: The weight of one page in the moving sums that tell it (about the last 64 pages).
MISS_ALPHA = 1 / 64


def default_replica_id() -> str:
    """``<hostname>-<pid>-<4 random hex>``: unique per process, readable in the hash."""
    return f"{socket.gethostname()}-{os.getpid()}-{random.getrandbits(16):04x}"


class FleetLoad:
    """The gateway fleet's requests in flight per endpoint, as this replica knows them.

    - ``attach(local)``: a ``LocalLoad`` whose requests this replica publishes (the
      picker attaches the one it is given; a replica normally has one).
    - ``own_field(pages, offset_ms)`` -> this replica's field: per endpoint with requests
      in flight, ``[in flight now, in flight at the page's scrape, that scrape's ms]``.
    - ``wrote(record)``: the record the exchange's call carries (this replica's share of
      the totals from then on).
    - ``read(number, live, fields, ...)``: the totals that moved, as the share script
      returned them; ``hear(messages, ...)``: the totals that moved as the channel
      pushed them (``<number> <Redis ms> <endpoint>:<total> ...``); ``lost``:
      Redis did not answer. Each recomputes ``extra`` where something moved.
    - ``extra``: endpoint id -> the load to add to this replica's own in flight there
      (the other replicas' in flight now + the outside traffic the page shows). An
      endpoint missing from it counts its page's running + waiting. ``outside``: the
      same without the other replicas' (what a pick adds while the others' counts are
      not current: Redis lost, ``answered_within``).

    ``pages`` is ``(endpoint id, running + waiting, scraped_at_ms)`` for the endpoints of
    the view, ``offset_ms`` the Redis clock minus the local clock (``ViewCache``'s).
    """

    def __init__(
        self,
        replica_id: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if replica_id is not None and (
            not isinstance(replica_id, str) or not replica_id or len(replica_id.split()) != 1
        ):
            raise ValueError(
                f"replica_id must be a non-empty string without spaces, got {replica_id!r}"
            )
        self.replica_id = replica_id or default_replica_id()
        #: Seconds of the exchange's clock (``time.monotonic``; a simulation passes its own).
        self.clock = clock
        self._locals: weakref.WeakSet[LocalLoad] = weakref.WeakSet()
        #: Endpoint id -> load to add to our own in flight (see the class doc).
        self.extra: dict[str, float] = {}
        #: Endpoint id -> the outside traffic alone (``extra`` without the others').
        self.outside: dict[str, float] = {}
        #: Endpoint id -> (our requests in flight when its newest page was scraped, the
        #: others' then, the others' now): with ours now, what the gateways' in flight
        #: changed by since the page (routing/models.py judges a page's age by it).
        self.at_page: dict[str, tuple[int, int, int]] = {}
        #: Other live replicas (the last read's count).
        self.peers = 0
        #: The others' changes are heard as they happen (the exchange's subscription is
        #: up): their counts are exact but for a few milliseconds, not a read's age.
        self.pushed = False
        #: ``clock()`` seconds of the last exchange Redis answered; None: never.
        self.exchanged_at: float | None = None
        #: Called (no arguments, from any thread) when an attached load's first change
        #: since the last ``take_changed`` happens: the exchange's wake-up.
        self.waker: Callable[[], None] | None = None
        #: Endpoint id -> (its newest page's scrape on the local clock, s; the requests
        #: that page showed beyond the outside floor), for endpoints with such an
        #: excess. The score counts it, fading, while ``current``.
        self.fading: dict[str, tuple[float, int]] = {}
        #: The pages show the gateways' requests as at their scrape (see ``CURRENT_MISS``).
        self.current = False
        # endpoint -> recent (scraped_at_ms, the page's count minus the gateways' in
        # flight at its scrape: negative when it missed some, the gateways' in flight)
        self._outside: dict[str, deque[tuple[int, int, int]]] = {}
        # Moving sums over pages: the gateways' requests a page missed, and those it
        # could have shown.
        self._missed = 0.0
        self._held = 0.0
        # This replica's field, per endpoint, as ``own_field`` last built it.
        self._own: dict[str, list[int]] | None = None
        # This replica's requests in flight per endpoint as its last write put them in
        # Redis's totals (``wrote``).
        self._written: dict[str, int] = {}
        # The other replicas' requests in flight, summed per endpoint.
        self._others = Others()
        self._lock = threading.Lock()

    # --- this replica ----------------------------------------------------------------------

    def attach(self, local: LocalLoad) -> None:
        """Publish ``local``'s requests here (its changes wake the exchange)."""
        self._locals.add(local)
        local.wake_on(self.wake)

    def detach(self, local: LocalLoad) -> None:
        """``local`` is published no more here (it moved to another router's fleet)."""
        self._locals.discard(local)
        held = local.wake_on(None)
        if held is not None and held != self.wake:
            local.wake_on(held)  # another fleet's: left as it was

    def holds(self, local: LocalLoad) -> bool:
        """``local`` is attached here."""
        return local in self._locals

    def wake(self) -> None:
        """An attached load changed (``LocalLoad`` calls it once per exchange at most)."""
        waker = self.waker
        if waker is not None:
            waker()

    def _mine(
        self, endpoint_id: str, since_local_s: float, loads: list[LocalLoad]
    ) -> tuple[int, int]:
        """(in flight now, in flight at ``since_local_s``) over ``loads`` (the attached
        ones, listed once per call of ``own_field`` or ``take``)."""
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

    def has_changed(self) -> bool:
        """An attached load started or ended a request since the last ``take_changed``."""
        return any(local.has_changed() for local in list(self._locals))

    def own_field(
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
        own = self._own
        todo: Iterable[str]
        if changed is None or own is None:
            own = self._own = {}
            todo = self._ids()
        else:
            todo = changed
        for endpoint_id in todo:
            page = pages.get(endpoint_id)
            scraped_ms = page[1] if page is not None else 0
            now, at = self._mine(endpoint_id, (scraped_ms - offset_ms) / 1000, loads)
            if now or at:
                own[endpoint_id] = [now, at, scraped_ms]
            else:
                own.pop(endpoint_id, None)
        if not own:
            return ""
        return json.dumps(dict(sorted(own.items())), separators=(",", ":"))

    @property
    def written(self) -> dict[str, int]:
        """This replica's requests in flight per endpoint as the totals in Redis hold
        them (its last record written)."""
        return dict(self._written)

    def wrote(self, record: str) -> None:
        """The record the exchange's call writes (``own_field``'s, "-" for nothing in
        flight; "" writes nothing): the share of the totals that is ours."""
        if record == "-":
            self._written = {}
        elif record:
            own = self._own or {}
            self._written = {e: counts[0] for e, counts in own.items() if counts[0]}

    # --- the others ----------------------------------------------------------------------

    def read(
        self,
        number: int,
        live: int,
        fields: Sequence[Any],
        pages: Mapping[str, tuple[int, int]],
        offset_ms: float,
        now_ms: float,
        *,
        full: bool = False,
        changed: Iterable[str] | None = None,
    ) -> None:
        """A read of the gateways' totals (``[endpoint, total, ...]``: those that moved
        since the last read, or every one when ``full``) answered at change number
        ``number``, with ``live`` other replicas, at ``now_ms`` of the Redis clock.
        ``changed``: as for ``own_field`` (None: every endpoint is worked out again);
        then only those and the endpoints whose totals moved are: the others' figures
        depend on nothing else."""
        moved = self._others.read(number, live, fields, self._written, now_ms, full=full)
        self._estimate(pages, offset_ms, changed, moved, answered=True)

    def lost(
        self,
        pages: Mapping[str, tuple[int, int]],
        offset_ms: float,
        *,
        changed: Iterable[str] | None = None,
    ) -> None:
        """Redis did not answer: the others' figures stay as last known (a pick leaves
        them out once no exchange answered for ``LOST_AFTER_MS``); the pages are taken in."""
        self._estimate(pages, offset_ms, changed, set(), answered=False)

    def hear(
        self,
        messages: Iterable[str],
        pages: Mapping[str, tuple[int, int]],
        offset_ms: float,
        *,
        changed: Iterable[str] | None = None,
    ) -> None:
        """The gateways' totals as the channel pushed them (``<number> <Redis ms>
        <endpoint>:<total> ...``); ``changed`` as for ``read``. No message at all: the
        pages only."""
        moved = self._others.hear(messages)
        self._estimate(pages, offset_ms, changed, moved, answered=False)

    def _estimate(
        self,
        pages: Mapping[str, tuple[int, int]],
        offset_ms: float,
        changed: Iterable[str] | None,
        moved: set[str],
        *,
        answered: bool,
    ) -> None:
        """``extra`` again for ``changed`` and ``moved`` (None: for every endpoint): a
        new dict, or the held one changed in place (a pick reads one entry at a time)."""
        loads = list(self._locals)
        others = self._others
        todo: Iterable[str]
        if changed is None:
            extra: dict[str, float] = {}
            outside: dict[str, float] = {}
            fading: dict[str, tuple[float, int]] = {}
            at_page: dict[str, tuple[int, int, int]] = {}
            todo = pages
            for gone in [e for e in self._outside if e not in pages]:
                del self._outside[gone]
        else:
            extra, outside, fading = self.extra, self.outside, self.fading
            at_page = self.at_page
            todo = set(changed)
            for endpoint_id in moved - todo:
                # Only the others' count moved (the most common case by far, as they
                # are heard): the outside floor and their count at the page stand.
                known = at_page.get(endpoint_id)
                page = pages.get(endpoint_id)
                if known is None or page is None or others.at(endpoint_id, page[1]) != known[1]:
                    todo.add(endpoint_id)
                    continue
                peer_now = others.now(endpoint_id)
                extra[endpoint_id] = outside[endpoint_id] + peer_now
                at_page[endpoint_id] = (known[0], known[1], peer_now)
            for gone in [e for e in todo if e not in pages]:
                extra.pop(gone, None)
                outside.pop(gone, None)
                fading.pop(gone, None)
                at_page.pop(gone, None)
                self._outside.pop(gone, None)
                todo.discard(gone)
        for endpoint_id in todo:
            requests, scraped_ms = pages[endpoint_id]
            _, at_me = self._mine(endpoint_id, (scraped_ms - offset_ms) / 1000, loads)
            peer_now, peer_at = others.now(endpoint_id), others.at(endpoint_id, scraped_ms)
            history = self._outside.get(endpoint_id)
            if history is None:
                history = self._outside[endpoint_id] = deque(maxlen=PAGES)
            held = at_me + peer_at
            beyond = requests - held
            if history and history[-1][0] == scraped_ms:
                history[-1] = (scraped_ms, beyond, held)  # the same page, better known now
            else:
                if history:  # the page before, as well as it will be known: one sample
                    _, last, last_held = history[-1]
                    self._missed += MISS_ALPHA * ((-last if last < 0 else 0) - self._missed)
                    self._held += MISS_ALPHA * (last_held - self._held)
                history.append((scraped_ms, beyond, held))
            floor = max(0, min(o for _, o, _ in history))
            extra[endpoint_id] = float(floor + peer_now)
            outside[endpoint_id] = float(floor)
            at_page[endpoint_id] = (at_me, peer_at, peer_now)
            if beyond > floor:
                fading[endpoint_id] = ((scraped_ms - offset_ms) / 1000, beyond - floor)
            else:
                fading.pop(endpoint_id, None)
        with self._lock:
            self.extra = extra
            self.outside = outside
            self.fading = fading
            self.at_page = at_page
            self.current = self._held > 0 and self._missed <= CURRENT_MISS * self._held
            self.peers = self._others.live
            if answered:
                self.exchanged_at = self.clock()

    def answered_within(self, seconds: float) -> bool:
        """An exchange that brought the others' counts answered within ``seconds`` (the
        exchange's bound, ``LOST_AFTER_MS``): their counts are current."""
        at = self.exchanged_at
        return at is not None and self.clock() - at <= seconds

    def peer_in_flight(self, endpoint_id: str) -> int:
        """The other replicas' requests in flight to ``endpoint_id``, as last known."""
        return self._others.now(endpoint_id)

    def __repr__(self) -> str:
        return f"FleetLoad({self.replica_id!r}, {self.peers} peers)"


def pages_of(items: Iterable[tuple[str, Any]]) -> dict[str, tuple[int, int]]:
    """``endpoint id -> (running + waiting, scraped_at_ms)`` of decoded endpoints."""
    pages: dict[str, tuple[int, int]] = {}
    for endpoint_id, view in items:
        stats = getattr(view, "stats", None)
        if stats is not None:
            pages[endpoint_id] = (stats.running + stats.waiting, stats.scraped_at_ms)
    return pages
