"""The gateway side: snapshots, a cached view, and a reference picker.

Imports only the leaves (errors, config, registry, stats) and ``poller.schema.keys``, so a
gateway installs no scraping or scheduling stack.
"""

from poller.reader.cache import ViewCache
from poller.reader.load import LocalLoad
from poller.reader.pick import pick
from poller.reader.picker import Picker
from poller.reader.reader import StatsReader, SyncStatsReader
from poller.reader.view import EndpointView, View

__all__ = [
    "EndpointView",
    "LocalLoad",
    "Picker",
    "StatsReader",
    "SyncStatsReader",
    "View",
    "ViewCache",
    "pick",
]
