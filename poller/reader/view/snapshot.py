"""The shared view at one moment: ``View``, what ``snapshot()`` returns and a cache's
``view()`` builds."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from poller.reader.view.records import EndpointView
from poller.schema.keys import SCHEMA_VERSION

__all__ = ["View"]


@dataclass(frozen=True, slots=True)
class View:
    """A snapshot: every registered endpoint at one moment of the Redis clock. Frozen:
    a reader builds it whole, and a view shared by tasks or threads never changes."""

    now_ms: int
    rev: int
    endpoints: Mapping[str, EndpointView]
    #: Live pollers (heartbeat not expired at ``now_ms``).
    pollers: list[str] = field(default_factory=list)
    #: Redis clock minus local ``time.monotonic()`` in ms when the view was read (None:
    #: unknown, e.g. a view built by hand); places this replica's requests on the view.
    offset_ms: float | None = None
    #: False when the reader had lost Redis: the numbers are the last ones it had.
    healthy: bool = True
    #: Redis clock of the reader's last contact with Redis (None: ``now_ms``).
    confirmed_ms: int | None = None
    #: True when the namespace has no schema key (``{namespace}:schema``): nothing ever
    #: wrote there (no poller, no ``poller endpoints`` change), which mostly means a wrong
    #: namespace. The view is empty then, and a cache built on it is not ``healthy``.
    schema_missing: bool = False

    def __getitem__(self, endpoint_id: str) -> EndpointView:
        return self.endpoints[endpoint_id]

    def get(self, endpoint_id: str) -> EndpointView | None:
        return self.endpoints.get(endpoint_id)

    def counts(self) -> dict[str, int]:
        out = {"fresh": 0, "stale": 0, "failing": 0, "unknown": 0}
        for e in self.endpoints.values():
            out[e.state] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": int(SCHEMA_VERSION),
            "now_ms": self.now_ms,
            "rev": self.rev,
            "pollers": self.pollers,
            "counts": self.counts(),
            "endpoints": [self.endpoints[e].to_dict() for e in sorted(self.endpoints)],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
