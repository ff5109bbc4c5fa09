"""llmgw-poller: one shared, fresh view of LLM engine load, through Redis.

The package's public API is the reader a gateway uses (``poller.reader``, whose names
are all here); the service (``poller run``) lives in the modules behind the ``service``
extra.
"""

from typing import Any

from poller._version import __version__
from poller.reader import (
    DEPRECATED,
    ConfigError,
    Endpoint,
    EndpointStats,
    EndpointView,
    Failure,
    PollerError,
    RedisSettings,
    Refusal,
    Router,
    RoutingOptions,
    SchemaMismatch,
    State,
    StatsReader,
    StoreAuthError,
    StoreError,
    StoreUnreachable,
    SyncStatsReader,
    Ticket,
    Timing,
    View,
    ViewCache,
    WhenSaturated,
    deprecated,
    prompt_of,
)

__all__ = [
    "ConfigError",
    "Endpoint",
    "EndpointStats",
    "EndpointView",
    "Failure",
    "PollerError",
    "RedisSettings",
    "Refusal",
    "Router",
    "RoutingOptions",
    "SchemaMismatch",
    "State",
    "StatsReader",
    "StoreAuthError",
    "StoreError",
    "StoreUnreachable",
    "SyncStatsReader",
    "Ticket",
    "Timing",
    "View",
    "ViewCache",
    "WhenSaturated",
    "__version__",
    "prompt_of",
]


def __getattr__(name: str) -> Any:
    if name in DEPRECATED:
        return deprecated(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
