"""The poller's exceptions.

    PollerError
     +-- ConfigError          bad settings, registry entry or argument (also a ValueError)
     +-- IdentityConflict     another live process heartbeats under this poller's id
     +-- ScrapeError          one scrape failed; ``reason`` is a failure reason (docs/schema.md)
     |    +-- FetchError      transport or HTTP: unreachable, timeout, http_status, auth, too_large
     |    +-- ParseError      the page is not valid exposition text (reason ``parse``)
     |    +-- ContractError   the page lacks required metrics (reason ``contract``)
     +-- StoreError           Redis refused a call or answered unexpectedly
          +-- StoreUnreachable  no answer: connection refused or lost, timed out
          +-- StoreAuthError    Redis refused our credentials or an ACL refused a command
          +-- SchemaMismatch    Redis holds another schema version

redis-py's exceptions become ``StoreError`` and below in one place,
``poller/redis/errors.py``. A failed scrape is data, not a crash: the worker turns a
``ScrapeError`` into a failure hash in Redis. Every message names the endpoint (when
there is one) and the problem.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "ConfigError",
    "ContractError",
    "FetchError",
    "IdentityConflict",
    "ParseError",
    "PollerError",
    "SchemaMismatch",
    "ScrapeError",
    "StoreAuthError",
    "StoreError",
    "StoreUnreachable",
]


class PollerError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(PollerError, ValueError):
    """A setting, registry entry or argument is invalid; ``field`` names it when known.

    Also a ``ValueError``: code that catches bad values the standard way catches it."""

    def __init__(self, message: str, *, endpoint: str | None = None, field: str | None = None):
        self.endpoint = endpoint
        self.field = field
        where = " ".join(
            p for p in (f"endpoint {endpoint!r}" if endpoint else "", field or "") if p
        )
        super().__init__(f"{where}: {message}" if where else message)


class IdentityConflict(PollerError):
    """Another live process heartbeats under this poller's id (``poller/store/members.py``):
    refused at start, or, with ``joined``, taken from this poller while it ran. ``host``
    and ``pid`` name that process (None: its poller version does not record them),
    ``age_ms`` its last heartbeat's age (None: unknown), ``wait_ms`` the time until that
    heartbeat expires."""

    def __init__(
        self,
        poller_id: str,
        *,
        host: str | None,
        pid: int | None,
        age_ms: float | None,
        wait_ms: float,
        joined: bool = False,
    ) -> None:
        self.poller_id = poller_id
        self.host = host
        self.pid = pid
        self.age_ms = age_ms
        self.wait_ms = wait_ms
        self.joined = joined
        where = f"host {host or '?'} pid {pid if pid is not None else '?'}"
        if host is None and pid is None:
            where = "host and pid not recorded"
        if joined:
            message = (
                f"poller id {poller_id!r} was taken by another process ({where}): stopped "
                "scraping, exiting; stop one of the two, or give each its own --id"
            )
        else:
            age = "unknown" if age_ms is None else f"{age_ms / 1000:.1f}s ago"
            message = (
                f"poller id {poller_id!r} is held by another live process ({where}, last "
                f"heartbeat {age}): stop that one, pick another --id, or wait "
                f"{math.ceil(wait_ms / 100) / 10:.1f}s if it crashed"
            )
        super().__init__(message)

    def taken(self) -> IdentityConflict:
        """The same conflict, met by a poller that was running under the id."""
        return IdentityConflict(
            self.poller_id,
            host=self.host,
            pid=self.pid,
            age_ms=self.age_ms,
            wait_ms=self.wait_ms,
            joined=True,
        )


class ScrapeError(PollerError):
    """One scrape of one endpoint failed. ``reason`` is one of the failure reasons of
    docs/schema.md (``P:failure:<id>``), which docs/operations.md explains."""

    reason: str = "parse"

    def __init__(self, detail: str, *, endpoint: str | None = None, reason: str | None = None):
        if reason is not None:
            self.reason = reason
        self.endpoint = endpoint
        self.detail = detail
        prefix = f"endpoint {endpoint!r}: " if endpoint else ""
        super().__init__(f"{prefix}{self.reason}: {detail}")


class FetchError(ScrapeError):
    """Transport or HTTP failure: unreachable, timeout, http_status, auth, too_large, config."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        endpoint: str | None = None,
        status: int | None = None,
        body: str = "",
    ):
        self.status = status
        #: A non-2xx answer's message (the first line of its body), for `poller check`.
        self.body = body
        super().__init__(detail, endpoint=endpoint, reason=reason)


class ParseError(ScrapeError):
    """The body is not Prometheus/OpenMetrics text; names the line and shows an excerpt."""

    reason = "parse"

    def __init__(self, message: str, *, line: int | None = None, excerpt: str | None = None):
        self.line = line
        self.excerpt = excerpt
        detail = message
        if line is not None:
            detail = f"line {line}: {message}"
        if excerpt is not None:
            detail = f"{detail}: {excerpt!r}"
        super().__init__(detail)


class ContractError(ScrapeError):
    """Required metrics are missing from an otherwise valid page (the seed's MissingError)."""

    reason = "contract"
    #: The other engines whose contract the page satisfies (``EngineMapping.read``).
    looks_like: tuple[str, ...] = ()

    def __init__(
        self,
        missing: Sequence[str],
        *,
        engine: str,
        endpoint: str | None = None,
        hint: str = "",
    ):
        self.missing = tuple(missing)
        self.engine = engine
        #: What the engine must run with to publish them (version, flag), when known.
        self.hint = hint
        #: The failure without the hint (``poller check`` gives its own advice).
        self.lacks = f"{engine} page lacks required metrics: {', '.join(self.missing)}"
        super().__init__(f"{self.lacks}; {hint}" if hint else self.lacks, endpoint=endpoint)


class StoreError(PollerError):
    """Redis refused a call, or replied with something unexpected."""


class StoreUnreachable(StoreError):
    """Redis could not be reached, or did not answer in time."""


class StoreAuthError(StoreError):
    """Redis refused our credentials (wrong password or user, none given) or an ACL
    refused a command, key or channel. Retrying does not help: the settings must change.
    ``kind`` is ``"authentication"`` or ``"permission"``."""

    def __init__(self, message: str, *, kind: str = "authentication") -> None:
        self.kind = kind
        super().__init__(message)


class SchemaMismatch(StoreError):
    """Redis already holds data written under another schema version; ``found`` is
    that version (None: unreadable), ``expected`` the one this code speaks."""

    def __init__(
        self, message: str, *, found: str | None = None, expected: str | None = None
    ) -> None:
        self.found = found
        self.expected = expected
        super().__init__(message)
