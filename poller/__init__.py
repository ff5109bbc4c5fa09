"""llmgw-poller: one shared, fresh view of LLM engine load, through Redis.

The package's public API is the reader a gateway uses; the service (``poller run``)
lives in the modules behind the ``service`` extra.
"""

from poller._version import __version__
from poller.errors import PollerError, StoreError
from poller.reader.cache import ViewCache
from poller.reader.load import LocalLoad
from poller.reader.pick import pick
from poller.reader.picker import Picker
from poller.reader.reader import StatsReader, SyncStatsReader
from poller.reader.view import EndpointView, View
from poller.schema.stats import EndpointStats, Failure

__all__ = [
    "EndpointStats",
    "EndpointView",
    "Failure",
    "LocalLoad",
    "Picker",
    "PollerError",
    "StatsReader",
    "StoreError",
    "SyncStatsReader",
    "View",
    "ViewCache",
    "__version__",
    "pick",
]
