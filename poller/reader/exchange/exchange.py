"""The exchange: what the gateway replicas share, pushed as it changes.

A ``Router`` runs it (a task beside the asyncio follower, a thread beside the threaded
one). A change of this replica's requests in flight (``FleetLoad``,
poller/reader/load/fleet.py) goes out at once, while the pacer's tokens last, in one
call of poller/schema/scripts/share.lua: the script moves the gateways' totals per
endpoint (``P:gateways:load``) by what changed, publishes the change on
``P:gateways:updates``, and returns the totals that moved since this replica's last
read. The follower's subscription hears the others' changes as they happen
(``heard``) and this loop takes them in between its calls. Every piece of work, in
Redis and here, follows the endpoints that changed, never the number of replicas.
Where the prefix placements are shared (``Placements``,
poller/reader/prefix/placements.py) they go out and come back on the same calls
(``Carrier``, carrier.py): no command more. A call is made at least every ``FLOOR_S``
even when nothing changed: the field renewed before it expires (a replica that stops
calling leaves the totals), the placements and the totals read (which mends what the
subscription lost). The pick path never waits for any of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from poller.reader.exchange import rights
from poller.reader.exchange.carrier import Carrier
from poller.reader.exchange.pacer import Pacer
from poller.reader.exchange.wire import (
    PUBLISH_EVERY_MS,
    REFRESH_BEFORE_MS,
    REFUSED_RETRY_S,
    RETRY_S,
    TTL_MS,
)
from poller.reader.load.fleet import FleetLoad, pages_of
from poller.reader.prefix.placements import Placements
from poller.reader.view.cache import ViewCache
from poller.schema.lua import lua

__all__ = ["LISTEN_S", "Exchange"]

log = logging.getLogger(__name__)

#: The loop takes in the pages that changed (no command) and looks at its stop flag at
#: least this often (s).
LISTEN_S = 0.05


def _nothing() -> None:
    return None


class Exchange:
    """The share script's calls for one ``FleetLoad`` (and ``Placements``) on one view
    cache, and the other replicas' writes the follower heard. ``share_load`` False: the
    counts are not shared (no field written, none read), only the placements are."""

    def __init__(
        self,
        client: Any,
        gateways_key: str,
        cache: ViewCache,
        fleet: FleetLoad,
        placements: Placements | None = None,
        placements_key: str = "",
        channel: str = "",
        *,
        totals_keys: tuple[str, str, str] = ("", "", ""),
        share_load: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: Monotonic seconds (a test passes its own): the pacer's, the calls', the waits'.
        self.clock = clock
        self.share_load = share_load
        self.ttl_ms = TTL_MS
        self.retry_s = RETRY_S
        self._last_record = ""
        self._written_ms: float = -1e15

        self.key = gateways_key
        prefix = gateways_key.rsplit(":", 1)[0]
        #: The shard channel the script publishes the changes on (``P:gateways:updates``).
        self.channel = channel or prefix + ":updates"
        #: The gateways' totals (``P:gateways:load``), the endpoints' change numbers
        #: (``P:gateways:changed``) and the live replicas (``P:gateways:alive``).
        self.totals_keys = tuple(
            given or f"{prefix}:{name}"
            for given, name in zip(totals_keys, ("load", "changed", "alive"), strict=True)
        )
        #: The change number of the last read of the totals (None: read them all).
        self.number: int | None = None
        self.cache = cache
        self.fleet = fleet
        #: Carried on the same call (``RoutingOptions.share_placements``): no command more.
        self.carrier = None if placements is None else Carrier(placements, placements_key, clock)
        self.script = client.register_script(lua("share"))
        self.calls = 0  # commands sent, for the benchmark's commands/s
        self.pacer = Pacer()
        self._refused = False
        self._pages_now: dict[str, tuple[int, int]] | None = None
        self._version = -1  # the cache's version ``_pages_now`` is of
        #: Pages changed since the estimate was last worked out (None: any may have).
        self._changed: set[str] | None = None
        #: Pages changed since our record was last worked out (None: any may have): the
        #: record holds each page's scraped_at_ms, so a new page changes it.
        self._unrecorded: set[str] | None = None
        # The other replicas' writes the follower heard, not taken in yet.
        self._inbox: deque[str] = deque()
        #: The follower's subscription carries ``channel`` (False: the others' writes
        #: are read on each call instead, at the pacer's rate).
        self.listening = False
        self._resync = False  # subscribed again: read soon, what was pushed meanwhile lost
        # Our last call's change waits for the script's next publish (``PUBLISH_EVERY_MS``):
        # a call then, unless a message of that number or later is heard first.
        self._held: tuple[int, float] | None = None
        #: Publish our writes on ``channel`` (False once Redis refused the channel).
        self.publish = True
        self._publish_suspect = False  # refused while publishing: the channel's rights?
        self._channel_refused = False
        self._published = False  # whether the call in flight publishes
        self._said = threading.Lock()
        self._wake: Callable[[], None] = _nothing
        self._listen_failed = False  # said once
        self._prepare_failed = False  # said once

    # --- what the follower calls --------------------------------------------------------

    def heard(self, message: str) -> None:
        """A message of ``channel`` (any thread): taken in by the loop at once."""
        self._inbox.append(message)
        self._wake()

    def refused_channel(self, exc: Exception) -> bool:
        """The follower's subscription with ``channel`` failed with ``exc``: True when
        Redis refused this user the channel (an ACL of before the pushed counts), said
        once; the follower then subscribes without it, and the others' writes are read
        on each call at the pacer's rate."""
        if not rights.refused_channel(exc, self.channel):
            return False
        self._no_channel()
        self.subscribed(False)
        return True

    def _no_channel(self) -> None:
        """This user may not use ``channel``: the others' writes read on each call, ours
        not published; said once."""
        self.publish = False
        with self._said:  # the follower's thread and the exchange's may both find it
            if self._channel_refused:
                return
            self._channel_refused = True
        rights.say_no_channel(self.channel, [self.key, *self.totals_keys])

    def subscribed(self, up: bool) -> None:
        """The follower's subscription to ``channel`` is in place (True) or lost."""
        self.listening = self.fleet.pushed = up
        if up:
            self._resync = True  # what was published meanwhile is lost: read it back
        self._wake()

    def _pages(self) -> dict[str, tuple[int, int]]:
        """Every endpoint's page, kept from the cache's change log (all read again after
        a snapshot or when the log has moved on): the work follows what changed."""
        cache = self.cache
        version = cache.version  # read first: the changes up to it are all in the log
        pages = self._pages_now
        changes = None if pages is None else cache.changes_since(self._version, version)
        carrier = self.carrier
        if pages is None or changes is None:
            pages = self._pages_now = pages_of((i, cache.base(i)) for i in cache.ids())
            self._changed = self._unrecorded = None
            if carrier is not None:
                for endpoint_id in pages:
                    carrier.take_page(endpoint_id, cache.base(endpoint_id))
        else:
            changed = set(changes)
            for endpoint_id in changed:
                base = cache.base(endpoint_id)
                stats = getattr(base, "stats", None)
                if stats is None:
                    pages.pop(endpoint_id, None)
                else:
                    pages[endpoint_id] = (stats.running + stats.waiting, stats.scraped_at_ms)
                    if carrier is not None:
                        carrier.take_page(endpoint_id, base)
            # Added to what is not worked out yet (None: everything, still).
            self._changed = None if self._changed is None else self._changed | changed
            self._unrecorded = None if self._unrecorded is None else self._unrecorded | changed
        self._version = version
        return pages

    def listen(self) -> None:
        """Take in what the follower heard, the pages that changed and the other
        replicas' fields that expired (no command). A failure here (a bug, never bad
        input, which is skipped) is said once and leaves the loop running: the next
        call's read mends what it missed."""
        try:
            self._listen()
        except Exception:
            if not self._listen_failed:
                self._listen_failed = True
                log.warning("the gateway exchange could not take in an update", exc_info=True)

    def _listen(self) -> None:
        inbox = self._inbox
        messages = [inbox.popleft() for _ in range(len(inbox))]
        pages = self._pages()
        changed, self._changed = self._changed, set()
        cache = self.cache
        if self._held is not None and messages:
            number = messages[-1].partition(" ")[0]
            if number.isdigit() and int(number) >= self._held[0]:
                self._held = None  # published by another's call
        self.fleet.hear(messages, pages, cache.offset_ms, changed=changed)

    def call_in(self, now: float) -> float:
        """Seconds until the next call may go (0: now)."""
        at = self.pacer.next_call(now, self._urgent())
        if self._held is not None:  # a held change goes out once the window allows
            at = min(at, max(self._held[1], self.pacer.next_call(now, True)))
        return max(0.0, at - now)

    def _urgent(self) -> bool:
        """A call now if the pacer allows: our counts changed and someone listens, the
        subscription is new (what it missed read back), or there is none (the others'
        writes are read at the pacer's rate instead)."""
        if not self.share_load:
            return False  # placements only: they go at the floor's pace
        if self._resync or not self.listening:
            return True
        if not self.fleet.has_changed():
            return False
        return self.number is None or self.fleet.peers > 0

    def wait_s(self, call_in: float) -> float:
        """How long the loop may sleep: until the next call, or ``LISTEN_S``."""
        return max(0.001, min(call_in, LISTEN_S))

    def prepare(self) -> tuple[list[str], list[Any], dict[str, tuple[int, int]]]:
        pages = self._pages()
        fleet = self.fleet
        ours = fleet.take_changed()
        if self._changed is not None:
            self._changed |= ours
        todo, self._unrecorded = self._unrecorded, set()
        record = fleet.own_field(pages, self.cache.offset_ms, None if todo is None else todo | ours)
        outgoing = self._outgoing(record, self.cache.now_ms())
        fleet.wrote(outgoing)
        self.calls += 1
        now = self.clock()
        self.pacer.called(now)
        self._resync = False
        keys: list[str] = [self.key, self.channel, *self.totals_keys]
        self._published = self.publish  # what this call does: another thread may change it
        number = "" if self.number is None else self.number
        args: list[Any] = [
            fleet.replica_id,
            self.ttl_ms,
            outgoing,
            int(self.publish),
            number,
            PUBLISH_EVERY_MS,
        ]
        if self.carrier is not None:
            self.carrier.add_to(keys, args, now)
        return keys, args, pages

    def leaving(self) -> tuple[list[str], list[Any]] | None:
        """The last call, as the loop stops (None: nothing ever written): this replica's
        requests leave the totals and it leaves the live replicas at once."""
        if not self.share_load or self.calls == 0:
            return None
        number = "" if self.number is None else self.number
        args = [
            self.fleet.replica_id,
            self.ttl_ms,
            ".",
            int(self.publish),
            number,
            PUBLISH_EVERY_MS,
        ]
        return [self.key, self.channel, *self.totals_keys], args

    def _outgoing(self, record: str, now_ms: float) -> str:
        """What this call writes: the record when it changed or nears its expiry, "-"
        once when it became empty, "" (nothing) otherwise."""
        if record == self._last_record and (
            not record or now_ms - self._written_ms < self.ttl_ms - REFRESH_BEFORE_MS
        ):
            return ""
        self._last_record = record
        self._written_ms = now_ms
        return record or "-"

    def answered(self, reply: Sequence[Any], pages: Mapping[str, tuple[int, int]]) -> None:
        self._refused = False
        live, number, again, full, held = (int(x) for x in reply[2:7])
        fields = reply[7 if self.carrier is None else self.carrier.answered(reply, 7) :]
        if again and self._last_record:  # taken out of the totals: write it whole
            self._last_record = "\0"
        window_s = PUBLISH_EVERY_MS * min(1.0, (live + 1) / 64) / 1000  # as the script's
        self._held = (number, self.clock() + window_s) if held else None
        if self._publish_suspect:  # answered without publishing: the channel's rights
            self._publish_suspect = False
            self._no_channel()
        changed, self._changed = self._changed, set()
        now_ms = int(reply[0]) * 1000 + int(reply[1]) // 1000  # the script's TIME
        self.fleet.read(
            number,
            live,
            list(fields),
            pages,
            self.cache.offset_ms,
            now_ms,
            full=bool(full),
            changed=changed,
        )
        self.number = number

    def failed(self, exc: Exception, pages: Mapping[str, tuple[int, int]]) -> None:
        """Local counts only; the next try waits ``retry_s`` (a refusal: ``REFUSED_RETRY_S``)."""
        self.pacer.hold(self.clock() + self._failed(exc, pages))

    def _failed(self, exc: Exception, pages: Mapping[str, tuple[int, int]]) -> float:
        self._last_record = "\0"  # the last write may not have landed: write again
        changed, self._changed = self._changed, set()
        self.fleet.lost(pages, self.cache.offset_ms, changed=changed)
        refused = rights.refused(exc)
        # One suspect at a time, the channel first: the next call, not publishing, tells
        # whether it was the channel's right; then, without the stream, the stream's.
        if refused and self._published and not self._publish_suspect:
            if self.carrier is not None:
                self.carrier.failed(False)  # its body goes back, unsuspected
            self._publish_suspect, self.publish = True, False
            return self.retry_s
        if self._publish_suspect:  # refused without publishing too: not the channel's
            self._publish_suspect, self.publish = False, not self._channel_refused
        if self.carrier is not None and self.carrier.failed(refused):
            # The stream's rights, or the hash's: the next call, without the stream,
            # tells which (``Carrier.answered`` or below).
            return self.retry_s
        if refused:
            self.fleet.exchanged_at = None  # not shared from now: the health says so
            if not self._refused:
                rights.say_refused(exc, self.channel, [self.key, *self.totals_keys])
            self._refused = True
            return REFUSED_RETRY_S
        log.debug("gateway load sharing failed: %s", exc)
        return self.retry_s

    def next_step(
        self,
    ) -> tuple[tuple[list[str], list[Any], dict[str, tuple[int, int]]] | None, float]:
        """What the loop does now: take in what was heard, then the call to make (its
        keys, args and pages; None: not now) and otherwise how long it may sleep."""
        self.listen()
        now = self.clock()
        call_in = self.call_in(now)
        prepared = self.prepared() if call_in <= 0.0 else None
        if prepared is None and call_in <= 0.0:  # not prepared: the pacer holds the next try
            call_in = self.call_in(self.clock())
        return prepared, self.wait_s(call_in)

    def install(self, wake: Callable[[], None] | None) -> None:
        """The loop's wake-up (None: the loop ended): a change of ours or a message."""
        self._wake = wake or _nothing
        self.fleet.waker = wake

    def prepared(self) -> tuple[list[str], list[Any], dict[str, tuple[int, int]]] | None:
        """``prepare()``, or None when it failed (a bug, never bad input, which is
        skipped): said once, and the loop goes on to try again ``retry_s`` later."""
        try:
            return self.prepare()
        except Exception:
            self._pages_now = self._unrecorded = None  # all worked out again next time
            self.pacer.hold(self.clock() + self.retry_s)
            if not self._prepare_failed:
                self._prepare_failed = True
                log.warning("the gateway exchange could not prepare its call", exc_info=True)
            return None
