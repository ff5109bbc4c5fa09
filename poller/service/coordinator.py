"""Who scrapes what: rendezvous assignment over live members, leases as the arbiter.

Every poller computes the same assignment from the same inputs (live members from the
``P:members`` zset, endpoint ids from the registry), so in steady state nobody fights.
While views differ (a member just joined or died) two pollers may both want an
endpoint; the lease decides, and fenced writes make a loser's late write harmless.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from poller.config import CoordinationSettings
from poller.errors import IdentityConflict
from poller.service.owned import Holdings
from poller.store.members import Instance
from poller.store.store import RedisStore
from poller.util.logs import count, few

__all__ = ["Coordinator", "ReconcileResult", "assign", "owner_of", "weight"]

log = logging.getLogger(__name__)


def weight(member: str, endpoint_id: str) -> int:
    """A stable 64-bit score for (member, endpoint): the same in every process.

    blake2b rather than ``hash()``, which is salted per process.
    """
    digest = hashlib.blake2b(
        member.encode() + b"\x00" + endpoint_id.encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big")


def owner_of(endpoint_id: str, members: Sequence[str]) -> str | None:
    """Highest-random-weight owner; ties (practically impossible) go to the smaller id."""
    best: str | None = None
    best_w = -1
    for member in members:
        w = weight(member, endpoint_id)
        if w > best_w or (w == best_w and best is not None and member < best):
            best, best_w = member, w
    return best


def assign(members: Iterable[str], endpoint_ids: Iterable[str]) -> dict[str, str]:
    """endpoint id -> owning member. Empty when there are no members.

    Adding a member moves only the endpoints it now wins (about 1/(N+1) of them),
    and only to itself; removing one moves only its own endpoints.
    """
    live = sorted(set(members))
    if not live:
        return {}
    return {e: owner_of(e, live) or live[0] for e in endpoint_ids}


@dataclass(slots=True)
class ReconcileResult:
    gained: dict[str, int] = field(default_factory=dict)  # id -> token
    lost: list[str] = field(default_factory=list)  # released, renew failed, or removed
    contested: list[str] = field(default_factory=list)  # preferred but held by another
    #: Contested, and the holder is no longer a live member (it died): its lease lapses
    #: within a TTL, and retrying soon beats waiting for the next reconcile.
    orphaned: list[str] = field(default_factory=list)
    renewed: int = 0  # leases renewed
    duration_s: float = 0.0


class Coordinator:
    """One poller's membership and leases, kept as records in ``holdings``."""

    def __init__(
        self,
        store: RedisStore,
        poller_id: str,
        settings: CoordinationSettings,
        holdings: Holdings | None = None,
        instance: Instance | None = None,
    ):
        self.store = store
        self.poller_id = poller_id
        #: The process we heartbeat as (None: this process, ``this_process()``).
        self.instance = instance
        #: A heartbeat under our id succeeded: from then on, another instance under it
        #: took the id from us (``IdentityConflict.joined``) rather than refused our start.
        self.joined = False
        self.settings = settings
        self.holdings = holdings if holdings is not None else Holdings()
        self.members: list[str] = []
        #: Live members a drain is requested for: rendezvous gives them nothing.
        self.draining: tuple[str, ...] = ()
        self.redis_now_ms = 0  # Redis clock at the last heartbeat
        #: The data epoch Redis reported at the last heartbeat: it changes only when
        #: Redis lost everything.
        self.epoch = ""

    @property
    def held(self) -> dict[str, int]:
        """endpoint id -> fencing token of every lease we hold (a copy)."""
        return self.holdings.tokens()

    async def heartbeat(self) -> bool:
        """Refresh membership; returns True when the live members, or which of them
        drain, changed.

        Raises IdentityConflict when another live process holds our id."""
        try:
            beat = await self.store.heartbeat(
                self.poller_id, self.settings.member_ttl_ms, self.instance
            )
        except IdentityConflict as exc:
            if self.joined:
                raise exc.taken() from None
            raise
        self.joined = True
        self.redis_now_ms, self.epoch = beat.now_ms, beat.epoch
        changed = beat.members != self.members or beat.draining != self.draining
        if beat.members != self.members:
            log.info("members changed", extra={"members": ",".join(beat.members) or "(none)"})
        if beat.draining != self.draining:
            log.info("draining members", extra={"draining": ",".join(beat.draining) or "(none)"})
        self.members, self.draining = beat.members, beat.draining
        return changed

    @property
    def serving(self) -> list[str]:
        """The live members rendezvous assigns to: those not draining."""
        return [m for m in self.members if m not in self.draining]

    def preferred(self, endpoint_ids: Iterable[str]) -> set[str]:
        if self.poller_id not in self.serving:
            return set()  # not (yet, or any longer) a live member, or draining: own nothing
        owners = assign(self.serving, endpoint_ids)
        return {e for e, owner in owners.items() if owner == self.poller_id}

    async def reconcile(self, endpoint_ids: Iterable[str]) -> ReconcileResult:
        """Release what we should not hold, renew the rest, acquire what we prefer.

        Three round trips at most, whatever the number of endpoints.
        """
        started = time.perf_counter()
        ids = set(endpoint_ids)
        mine = self.preferred(ids)
        result = ReconcileResult()
        ttl = self.settings.lease_ttl_ms

        give_up = {e: t for e, t in self.held.items() if e not in mine}
        if give_up:
            # Release (not just forget) so the preferred owner can take them at once.
            await self.store.release_leases(self.poller_id, give_up)
            for e, token in give_up.items():
                self.holdings.discard(e, token)
            result.lost.extend(sorted(give_up))
            self._log_handover(give_up, ids)

        sent = time.monotonic()
        held = self.held
        renewed = await self.store.renew_leases(self.poller_id, held, ttl)
        lapsed = []
        for e, ok in renewed.items():
            if ok:
                result.renewed += 1
                record = self.holdings.current(e, held[e])
                if record is not None:  # not discarded while the renewal was in flight
                    record.confirmed_at = sent
            else:
                self.holdings.discard(e, held[e])
                lapsed.append(e)
        if lapsed:
            # One line, not one per endpoint: after a Redis hang they lapse all at once.
            n = count(len(lapsed), "endpoint")
            log.warning("lease lost at renewal: %s", n, extra={"endpoints": few(lapsed)})
            result.lost.extend(lapsed)

        wanted = sorted(mine - self.held.keys())
        sent = time.monotonic()
        for acquired in await self.store.acquire_leases(self.poller_id, wanted, ttl):
            if acquired.token is not None:
                self.holdings.hold(acquired.endpoint_id, acquired.token, sent)
                result.gained[acquired.endpoint_id] = acquired.token
            else:
                result.contested.append(acquired.endpoint_id)
                holder = (acquired.holder or "").partition(" ")[0]
                if holder not in self.members:
                    result.orphaned.append(acquired.endpoint_id)
        result.duration_s = time.perf_counter() - started
        return result

    def _log_handover(self, released: Iterable[str], registered: set[str]) -> None:
        """The losing side says where its endpoints go (the gaining side logs them as
        acquired), grouped by their new owner."""
        owners = assign(self.serving, released)
        groups: dict[str, list[str]] = {}
        for e in released:
            groups.setdefault(owners.get(e, "") if e in registered else "-", []).append(e)
        for to, gone in sorted(groups.items()):
            n = count(len(gone), "endpoint")
            if to == "-":
                log.info("released %s removed from the registry", n, extra={"endpoints": few(gone)})
            elif to:
                log.info("handing over %s to %s", n, to, extra={"endpoints": few(gone), "to": to})
            else:
                fields = {"endpoints": few(gone)}
                log.info("released %s: no serving poller to take them", n, extra=fields)

    def forget(self, endpoint_id: str, token: int | None = None) -> None:
        """The lease is someone else's now. With ``token``, only if we still hold it
        under that token (not one re-acquired meanwhile)."""
        self.holdings.discard(endpoint_id, token)

    def expire(self, now: float) -> list[str]:
        """Forget the leases not confirmed within a TTL of ``now`` (monotonic): they have
        lapsed in Redis, or will before we could write, so no job may run for them."""
        ttl_s = self.settings.lease_ttl_ms / 1000
        gone = [r for r in self.holdings.records() if now - r.confirmed_at >= ttl_s]
        for record in gone:
            self.holdings.discard(record.endpoint_id, record.token)
        return [r.endpoint_id for r in gone]

    async def leave(self) -> int:
        """Graceful exit: leave membership first, so survivors' next reconcile no longer
        prefers us, then release every lease (publishing ``released``)."""
        await self.store.leave(self.poller_id)
        self.joined = False
        held = self.held
        for e, token in held.items():
            self.holdings.discard(e, token)
        return await self.store.release_leases(self.poller_id, held)
