"""Failure logging: once per failure, not once per scrape.

A failure is reported again when *what* failed changes (another reason, another set of
missing metrics, another status code, another configuration problem), not on every
scrape while it lasts, and once more when the endpoint recovers. A contract violation
is a WARNING: every scrape fails, the gateways have no numbers for the endpoint and
route to it blind, and at the default log level nothing else would say so. When the page
is another engine's, the warning carries the hint naming it, as the failure's detail does.
"""

from __future__ import annotations

import logging

from poller.errors import ScrapeError

__all__ = ["FailureLog", "signature"]

log = logging.getLogger(__name__)

#: Reasons whose detail names the problem itself (not a transient measurement).
_DETAILED = ("config", "parse", "too_large", "auth", "http_status")


def signature(exc: ScrapeError) -> tuple[str, ...]:
    """What identifies a failure for logging: equal signatures are the same failure."""
    if exc.reason == "contract":
        return ("contract", ",".join(getattr(exc, "missing", ())))
    status = getattr(exc, "status", None)
    if exc.reason in _DETAILED:
        return (exc.reason, str(status or ""), exc.detail)
    return (exc.reason,)  # unreachable, timeout: the detail varies from try to try


class FailureLog:
    """The failure last reported for one endpoint."""

    __slots__ = ("_reported",)

    def __init__(self) -> None:
        self._reported: tuple[str, ...] | None = None

    def failed(self, endpoint_id: str, exc: ScrapeError) -> None:
        sig = signature(exc)
        fields = {"endpoint": endpoint_id, "reason": exc.reason}
        if exc.reason == "contract":
            fields["missing"] = ",".join(getattr(exc, "missing", ()))
            if getattr(exc, "looks_like", ()):
                # the page is another engine's: the hint names the engine to register
                fields["hint"] = getattr(exc, "hint", "")
        else:
            fields["detail"] = exc.detail
        if sig == self._reported:
            log.debug("scrape failed", extra=fields)
            return
        self._reported = sig
        if exc.reason == "contract":
            log.warning(
                "scrape failed: the engine does not serve the metrics this endpoint is read "
                "with; routing to it is uninformed",
                extra=fields,
            )
            return
        level = logging.WARNING if exc.reason in ("config", "auth") else logging.INFO
        log.log(level, "scrape failed", extra=fields)

    def recovered(self, endpoint_id: str) -> None:
        if self._reported is not None:
            log.info(
                "endpoint recovered", extra={"endpoint": endpoint_id, "after": self._reported[0]}
            )
            self._reported = None
