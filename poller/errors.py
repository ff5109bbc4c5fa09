"""The poller's exceptions.

    PollerError
     +-- ConfigError          bad settings, registry entry or argument (also a ValueError)
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

from collections.abc import Sequence

__all__ = [
    "ConfigError",
    "ContractError",
    "FetchError",
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
        detail = f"{engine} page lacks required metrics: {', '.join(self.missing)}"
        super().__init__(f"{detail}. {hint}" if hint else detail, endpoint=endpoint)


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
