"""The view: what the pollers wrote, as a gateway replica reads it.

    records.py   EndpointView (one endpoint) and the Timing its state follows
    snapshot.py  View: every endpoint at one moment of the Redis clock
    decode.py    the read scripts' replies as views (one decode for every way of reading)
    cache.py     ViewCache: the view kept locally, every read a dict lookup
    follow.py    the follow protocol without I/O: what a cached reader does next
    feed.py      the update channel read in the event loop's data callback

It imports nothing of what shares or routes (load, prefix, exchange, routing): those
sit above it and read it.
"""

from poller.reader.view.cache import ViewCache
from poller.reader.view.records import DEFAULT_BOUND_MS, EndpointView, State, Timing
from poller.reader.view.snapshot import View

__all__ = ["DEFAULT_BOUND_MS", "EndpointView", "State", "Timing", "View", "ViewCache"]
