"""llmgw-poller: one shared, fresh view of LLM engine load, through Redis.

The package's public API is the reader a gateway uses (``poller.reader``, whose names
are all here); the service (``poller run``) lives in the modules behind the ``service``
extra.
"""

from poller._version import __version__
from poller.reader import (
    ConfigError,
    Endpoint,
    EndpointStats,
    EndpointView,
    Failure,
    LocalLoad,
    Picker,
    PollerError,
    RedisSettings,
    SchemaMismatch,
    State,
    StatsReader,
    StoreAuthError,
    StoreError,
    StoreUnreachable,
    SyncStatsReader,
    Timing,
    View,
    ViewCache,
    WhenSaturated,
    pick,
    prompt_of,
)

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
    "__version__",
    "pick",
    "prompt_of",
]
