"""The gateway side: snapshots, a cached view, and a reference picker.

Imports only the leaves (errors, schema, the Redis plumbing), so a gateway installs no
scraping or scheduling stack. Every public name of the reader is here, and the same
names are in ``poller`` (docs/reader.md).
"""

from poller.errors import (
    ConfigError,
    PollerError,
    SchemaMismatch,
    StoreAuthError,
    StoreError,
    StoreUnreachable,
)
from poller.reader.cache import ViewCache
from poller.reader.load import LocalLoad
from poller.reader.pick import pick
from poller.reader.picker import Picker, WhenSaturated
from poller.reader.prefix import prompt_of
from poller.reader.reader import StatsReader
from poller.reader.sync import SyncStatsReader
from poller.reader.view import EndpointView, State, Timing, View
from poller.redis.settings import RedisSettings
from poller.schema.endpoint import Endpoint
from poller.schema.stats import EndpointStats, Failure

__all__ = [
    "ConfigError",
    "Endpoint",
    "EndpointStats",
    "EndpointView",
    "Failure",
    "LocalLoad",
    "Picker",
    "PollerError",
    "RedisSettings",
    "SchemaMismatch",
    "State",
    "StatsReader",
    "StoreAuthError",
    "StoreError",
    "StoreUnreachable",
    "SyncStatsReader",
    "Timing",
    "View",
    "ViewCache",
    "WhenSaturated",
    "pick",
    "prompt_of",
]
