"""A ticket: one request a Router counts in flight, from its pick until it ends.

``router.pick(...)`` hands one out; the request counts on its endpoint (this replica's
``LocalLoad``, shared with the other replicas) until the ticket ends, once, however it
ends: ``with ticket:`` (an exception out of the block is a failed request, a
cancellation is not), or ``ticket.done(ok=...)`` from a callback that learns of the end
elsewhere, or ``ticket.cancel()`` for a request never sent. A ticket ended twice counts
once. ``moved`` hands the request over to
another endpoint (a proxy's retry on a fallback).
"""

from __future__ import annotations

import threading
from types import TracebackType

from poller.reader.load.local import LocalLoad
from poller.reader.view.cache import ViewCache
from poller.reader.view.records import EndpointView

__all__ = ["Ticket"]

# One lock for every ticket's open flag: a flag turns once, and two threads ending the
# same ticket (a callback and a timeout) must not both count the end.
_ENDING = threading.Lock()


class Ticket:
    """A request in flight to the endpoint ``id`` (the registry's endpoint id).

    ``url``: the endpoint's base URL, where the request goes (its registry entry);
    ``endpoint``: the endpoint as the view shows it now (an ``EndpointView``);
    ``fallbacks``: the endpoint ids to try next, best first, when ``pick`` was asked
    for them (``fallbacks=N``); ``open``: not ended yet.
    """

    __slots__ = ("_cache", "_local", "_open", "_started_at", "fallbacks", "id")

    def __init__(
        self,
        cache: ViewCache,
        local: LocalLoad,
        endpoint_id: str,
        fallbacks: tuple[str, ...] = (),
    ) -> None:
        self.id = endpoint_id
        self.fallbacks = fallbacks
        self._cache = cache
        self._local = local
        self._open = True
        self._started_at = local.started(endpoint_id)

    @property
    def url(self) -> str:
        """The endpoint's base URL (``""`` once it left the registry)."""
        base = self._cache.base(self.id)
        entry = None if base is None else base.entry
        return "" if entry is None else entry.url

    @property
    def endpoint(self) -> EndpointView | None:
        """The endpoint as the view shows it now (None once it left the registry)."""
        return self._cache.get(self.id)

    @property
    def open(self) -> bool:
        return self._open

    def done(self, ok: bool = True) -> None:
        """The request ended (``ok=False``: an error answer, a broken connection; an
        engine that fails fast must not look idle). A second call does nothing."""
        with _ENDING:
            if not self._open:
                return
            self._open = False
        self._local.finished(self.id, self._started_at, ok=ok)

    def cancel(self) -> None:
        """The request was never sent (the gateway found no way to the endpoint, or
        gave up before sending): it stops counting, and its time says nothing of the
        endpoint. Ends the ticket as ``done`` does; a second end does nothing."""
        with _ENDING:
            if not self._open:
                return
            self._open = False
        self._local.finished(self.id, self._started_at, sent=False)

    def moved(self, endpoint_id: str, *, ok: bool = False) -> Ticket:
        """The request went on to ``endpoint_id`` instead (a proxy retried it there):
        this ticket ends (``ok``: how the first endpoint did; by default it failed, as a
        retry means) and the returned one counts it there. An ended ticket moves
        nothing and is returned as it is."""
        if not isinstance(endpoint_id, str):
            raise TypeError(f"endpoint_id must be a str, got {type(endpoint_id).__name__}")
        if endpoint_id == self.id or not self._open:
            return self
        self.done(ok=ok)
        return Ticket(self._cache, self._local, endpoint_id)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A cancellation (the client left) is no engine's fault; an exception is.
        self.done(ok=exc_type is None or not issubclass(exc_type, Exception))

    def __repr__(self) -> str:
        state = "open" if self._open else "done"
        return f"Ticket({self.id!r}, {state})"
