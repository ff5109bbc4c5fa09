"""The gateway side: the view the pollers publish, and the Router a replica routes with.

Imports only the leaves (errors, schema, the Redis plumbing), so a gateway installs no
scraping or scheduling stack. Every public name of the reader is here, and the same
names are in ``poller`` (docs/reader.md). In the order data flows:

=================  ==================================================================
``view/``          the view: records, snapshots, the cache that follows ``P:updates``
``load/``          requests in flight: this replica's (``LocalLoad``) and the fleet's
``prefix/``        prompts as blocks, and the placements of where they went
``exchange/``      what the replicas share through Redis (the share script, its pacing)
``routing/``       the rules: options, the index, the load model, the pick, affinity
``router.py``      ``Router``: the one object a gateway replica holds
``ticket.py``      ``Ticket``: one request counted in flight until it ends
``reader.py``      ``StatsReader`` (asyncio): snapshots, ``get``, ``router()``
``sync.py``        ``SyncStatsReader``: the same for threaded gateways
``base.py``        what both readers share
``legacy.py``      the ``Picker`` API of earlier releases, on the Router's rules
=================  ==================================================================

Inside, imports flow down that list's first five rows: the view imports nothing of
load, prefix, exchange or routing; prefix nothing of the exchange (tests/test_layout.py).
"""

import warnings
from typing import Any

from poller.errors import (
    ConfigError,
    PollerError,
    SchemaMismatch,
    StoreAuthError,
    StoreError,
    StoreUnreachable,
)
from poller.reader.legacy import REPLACEMENTS
from poller.reader.prefix.blocks import prompt_of
from poller.reader.reader import StatsReader
from poller.reader.router import Refusal, Router
from poller.reader.routing.options import RoutingOptions, WhenSaturated
from poller.reader.sync import SyncStatsReader
from poller.reader.ticket import Ticket
from poller.reader.view import EndpointView, State, Timing, View, ViewCache
from poller.redis.settings import RedisSettings
from poller.schema.endpoint import Endpoint
from poller.schema.stats import EndpointStats, Failure

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
    "prompt_of",
]

#: The names of earlier releases, kept for one release with a DeprecationWarning.
DEPRECATED = ("LocalLoad", "Picker", "pick")


def deprecated(module: str, name: str) -> Any:
    """``name`` of the earlier API, with a warning that names its replacement."""
    warnings.warn(
        f"{module}.{name} is deprecated: {REPLACEMENTS[name]}",
        DeprecationWarning,
        stacklevel=3,
    )
    if name == "LocalLoad":
        from poller.reader.load.local import LocalLoad

        return LocalLoad
    import poller.reader.legacy as legacy

    return getattr(legacy, name)


def __getattr__(name: str) -> Any:
    if name in DEPRECATED:
        return deprecated(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
