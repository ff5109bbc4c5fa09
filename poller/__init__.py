"""llmgw-poller: one shared, fresh view of LLM engine load, through Redis.

The package's public API is the reader a gateway uses; the service (``poller run``)
lives in the modules behind the ``service`` extra.
"""

from ._version import __version__
from .errors import PollerError, StoreError
from .reader import StatsReader, SyncStatsReader
from .stats import EndpointStats, Failure
from .view import EndpointView, View, ViewCache, pick

__all__ = [
    "EndpointStats",
    "EndpointView",
    "Failure",
    "PollerError",
    "StatsReader",
    "StoreError",
    "SyncStatsReader",
    "View",
    "ViewCache",
    "__version__",
    "pick",
]
