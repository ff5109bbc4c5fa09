"""Redis as the worker sees it: reachable, unreachable, or refusing our credentials.

``RedisState`` logs each change once (not once per retry), keeps the reason ``/readyz``
gives, and drives the ``redis_up`` gauge. ``Refusals`` holds the rule for a refusal
(``StoreAuthError``: a login or an ACL permission refused): when it stops the poller, and
when it is over.

One rule: a refusal of something Redis has never allowed this run is a mistake in the
settings, and the poller stops (exit status 2) so that a deployment fails at once rather
than retries forever; a refusal of something Redis allowed before is a change on Redis's
side (the settings are read once and never change), and the poller holds ``/readyz`` at
503 and retries until it is undone. Two things Redis allows:

- the login (``kind == "authentication"``): allowed once any call succeeded;
- the calls the poller makes (``kind == "permission"``, an ACL without one of them):
  allowed once a whole pass made every call the leases need (a *complete* pass: the
  heartbeat, the registry, and a lease renewal, or nothing to hold), or once the first
  whole pass is a hold old (a poller given nothing to renew still settles).

A refusal in force ends at the next complete pass: the calls the ACL allows succeed in
between (a heartbeat-only pass, a pass that only re-acquires what lapsed) and must not
read as Redis being fine again. The hold bounds it: no refusal for three lease TTLs ends
it too, since a command refused every time it runs (a renewal) runs at least once in 1.5
lease TTLs (lapse, acquire, renew).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from poller.errors import StoreAuthError, StoreError

__all__ = ["RedisState", "Refusals"]

log = logging.getLogger(__name__)


class Refusals:
    """The refusal state of one worker; every method takes ``now`` (monotonic seconds)."""

    def __init__(self, lease_ttl_ms: int) -> None:
        self.hold_s = 3 * lease_ttl_ms / 1000
        #: Redis accepted the login once this run.
        self.logged_in = False
        #: Every call the poller makes was allowed once (or the first pass is a hold old).
        self.settled = False
        #: The refusal in force (None: none).
        self.refusal: StoreAuthError | None = None
        self._refused_at = -math.inf
        self._first_pass: float | None = None

    @property
    def in_force(self) -> bool:
        return self.refusal is not None

    def fatal(self, exc: StoreAuthError, now: float) -> bool:
        """Whether ``exc`` refuses what Redis never allowed this run (stop, exit 2)."""
        if exc.kind == "authentication":
            return not self.logged_in
        return not self._is_settled(now)

    def refused(self, exc: StoreAuthError, now: float) -> None:
        """A call was refused (and the poller goes on: ``fatal`` said no)."""
        self.refusal = exc
        self._refused_at = now

    def allowed(self, now: float) -> None:
        """A call succeeded: the login works; a refusal ends here only after the hold."""
        self.logged_in = True
        if self.refusal is not None and now - self._refused_at >= self.hold_s:
            self.refusal = None

    def passed(self, now: float, *, complete: bool) -> None:
        """A whole pass (heartbeat, registry, leases) ended without a Redis error;
        ``complete``: it made every call the leases need (see the module's docstring)."""
        self.logged_in = True
        if self._first_pass is None:
            self._first_pass = now
        if complete:
            self.settled = True
            self.refusal = None
        else:
            self.allowed(now)

    def _is_settled(self, now: float) -> bool:
        if not self.settled and self._first_pass is not None:
            self.settled = now - self._first_pass >= self.hold_s
        return self.settled


class RedisState:
    """Redis's state for one worker: ``ok``, the ``problem`` when not, the refusal rule."""

    def __init__(self, lease_ttl_ms: int, set_up: Callable[[float], None]) -> None:
        self.ok = False
        self.problem = "Redis not reached yet"  # why not ok, for /readyz
        self.refusals = Refusals(lease_ttl_ms)
        self._set_up = set_up  # the redis_up gauge's setter
        self._said = ""  # the state last logged: "", ok, refused, unreachable

    def seen(self, error: StoreError | None, now: float) -> None:
        """A call succeeded (``error`` None) or failed: log a change of state, once. A
        refusal stays in force past the calls the ACL allows until ``refusals`` says
        it is over."""
        if isinstance(error, StoreAuthError):
            self.refusals.refused(error, now)
            state = "refused"
        elif error is None:
            self.refusals.allowed(now)
            if self.refusals.in_force:
                return
            state = "ok"
        else:
            state = "unreachable"
        if state != self._said:
            self._said = state
            if state == "ok":
                log.info("redis reachable")
            elif state == "refused":
                # Retrying cannot fix this: say so loudly, not as a passing blip.
                log.error("%s; retrying until the settings or the ACL change", error)
            else:
                log.warning("redis unreachable: %s", error)
        if error is not None:
            self.problem = str(error)  # names it: unreachable, refused, rejected
        self.ok = error is None
        self._set_up(1 if self.ok else 0)
