"""DNS discovery: keep the registry's discovered entries equal to what DNS says.

Each source (``dns+srv://`` or ``dns+a://``, see
``poller.config.discovery.DiscoverySource``) is resolved by one poller at a time: the
rendezvous owner of ``discovery/<name>`` over the live members, under a fenced lease
``P:discovery:<name>``, so a fleet asks DNS once per source per refresh. A source that
nobody takes (its preferred poller lacks it in its settings) is taken by any poller that
sees its lease free ``ORPHAN_PASSES`` (three) passes in a row.

The DNS queries are in ``resolve.py``; the Redis calls in ``poller/store/discovery.py``.

Reconcile, never wipe: a source only touches entries whose ``source`` is its name. A new
target is added at once; a target leaves after two consecutive answers without it. A
failed resolution (timeout, SERVFAIL), NXDOMAIN or an empty answer changes nothing and is
the source's current failure, because a DNS outage must not empty the view; with
``allow_empty`` NXDOMAIN and empty answers count as "no targets".
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from poller.config import DiscoverySource, Settings
from poller.errors import ConfigError, StoreError
from poller.schema.endpoint import Endpoint
from poller.service.coordinator import owner_of
from poller.service.discovery.resolve import Answer, Target, resolve
from poller.service.metrics import PollerMetrics, Surprises
from poller.store.discovery import DiscoveryStore
from poller.store.store import RedisStore
from poller.util.backoff import backoff_s, member_ttl_cap_s

__all__ = ["DiscoveryRunner", "Plan", "endpoint_for", "endpoint_id", "plan"]

log = logging.getLogger(__name__)

#: A target must be missing from this many consecutive answers before its entry leaves.
MISSES_TO_REMOVE = 2
#: A source whose lease stays free this many passes is taken by any poller (orphan).
ORPHAN_PASSES = 3
_ID_BAD = re.compile(r"[^A-Za-z0-9._:@/-]")


# --- reconciling (pure) ------------------------------------------------------------------


def endpoint_id(source: str, target: Target) -> str:
    """``<source>/<host>:<port>``, sanitised to the registry's id rules."""
    raw = _ID_BAD.sub("-", f"{source}/{target.host}:{target.port}")
    if len(raw) > 200:  # keep it unique: a readable head and a digest of the whole
        raw = raw[:183] + "~" + hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()
    return raw


def endpoint_for(source: DiscoverySource, target: Target) -> Endpoint:
    """The registry entry of one target; raises ConfigError if it cannot be one."""
    host = f"[{target.host}]" if ":" in target.host else target.host
    data = {
        **source.entry_template(),
        "id": endpoint_id(source.name, target),
        "url": f"{source.scheme}://{host}:{target.port}",
    }
    try:
        return Endpoint.model_validate(data)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"target {host}:{target.port} is unusable: {exc}") from None


@dataclass(frozen=True, slots=True)
class Plan:
    put: dict[str, str]
    remove: list[str]
    #: Entries of the source missing from answers so far (id -> consecutive misses).
    misses: dict[str, int]
    #: How many entries the source owns once the plan is applied.
    owned: int
    #: Targets whose id is taken by a hand-written or another source's entry.
    conflicts: list[str] = field(default_factory=list)


def plan(
    source: DiscoverySource,
    targets: tuple[Target, ...] | None,
    registry: Mapping[str, Endpoint],
    raw: Mapping[str, str],
    misses: Mapping[str, int],
) -> Plan:
    """What to write so the source's entries follow ``targets`` (None: change nothing)."""
    owned = {e for e, entry in registry.items() if entry.source == source.name}
    if targets is None:
        return Plan({}, [], dict(misses), len(owned))
    wanted: dict[str, str] = {}
    for target in targets:
        try:
            entry = endpoint_for(source, target)
        except ConfigError as exc:
            log.warning("discovery target skipped", extra={"source": source.name, "why": str(exc)})
            continue
        wanted[entry.id] = entry.to_json()
    conflicts = sorted(e for e in wanted if e in raw and e not in owned)
    put = {e: j for e, j in wanted.items() if e not in conflicts and raw.get(e) != j}
    remove: list[str] = []
    new_misses: dict[str, int] = {}
    for e in sorted(owned - set(wanted)):
        count = misses.get(e, 0) + 1
        if count >= MISSES_TO_REMOVE:
            remove.append(e)
        else:
            new_misses[e] = count
    return Plan(put, remove, new_misses, len((owned | set(put)) - set(remove)), conflicts)


# --- the runner --------------------------------------------------------------------------


@dataclass(slots=True)
class _State:
    source: DiscoverySource
    token: int | None = None
    next_refresh: float = 0.0
    misses: dict[str, int] = field(default_factory=dict)
    free_passes: int = 0
    #: Taken as an orphan (not preferred): kept until lost, never handed back and forth.
    orphan: bool = False
    #: What was last logged, so a lasting failure or conflict is logged once.
    failure: str = ""
    conflicts: frozenset[str] = frozenset()


Resolve = Callable[[DiscoverySource, float], Awaitable[Answer]]


class DiscoveryRunner:
    """Runs this poller's share of the discovery sources; ``step()`` is one pass."""

    def __init__(
        self,
        settings: Settings,
        store: RedisStore,
        metrics: PollerMetrics | None = None,
        *,
        members: Callable[[], Awaitable[list[str]]] | None = None,
        resolver: Resolve = resolve,
    ) -> None:
        self.id = settings.id
        self.coordination = settings.coordination
        self.store = store
        self.leases = DiscoveryStore(store.client, store.keys)
        self.metrics = metrics or PollerMetrics()
        self.surprises = Surprises(self.metrics)
        self._members = members or store.live_members
        self._resolve = resolver
        self.states = {s.name: _State(s) for s in settings.discovery}
        self._task: asyncio.Task[None] | None = None

    @property
    def held(self) -> list[str]:
        return sorted(name for name, st in self.states.items() if st.token is not None)

    async def start(self) -> None:
        if self.states and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="discovery")

    async def stop(self) -> None:
        """Stop, and hand our sources over at once by releasing their leases."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for name, st in self.states.items():
            if st.token is not None:
                try:
                    await self.leases.release(name, self.id, st.token)
                except StoreError as exc:
                    log.warning(
                        "discovery lease not released", extra={"source": name, "why": str(exc)}
                    )
                st.token = None

    async def _loop(self) -> None:
        tick_s = self.coordination.reconcile_interval_ms / 1000
        cap_s = member_ttl_cap_s(self.coordination.member_ttl_ms)
        failures = 0
        while True:
            try:
                await self.step()
                failures = 0
            except StoreError as exc:
                failures += 1
                # once per outage at WARNING: the worker reports Redis trouble too
                log.log(logging.WARNING if failures == 1 else logging.DEBUG, "discovery: %s", exc)
            except Exception as exc:
                failures += 1
                self.surprises.report("discovery", exc)
            await asyncio.sleep(backoff_s(failures, cap_s=cap_s) if failures else tick_s)

    async def step(self, now_s: float | None = None) -> None:
        """One pass: settle who holds which source, then resolve the sources that are due."""
        now = time.monotonic() if now_s is None else now_s
        members = await self._members()
        for st in self.states.values():
            await self._settle(st, members, now)
        due = [st for st in self.states.values() if st.token is not None and now >= st.next_refresh]
        results = await asyncio.gather(
            *(self._refresh(st, now) for st in due), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _settle(self, st: _State, members: list[str], now: float) -> None:
        name, ttl_ms = st.source.name, self.coordination.lease_ttl_ms
        preferred = owner_of(f"discovery/{name}", members)
        if st.token is not None:
            if preferred is not None and preferred != self.id and not st.orphan:
                log.info("discovery: handing over", extra={"source": name, "to": preferred})
                await self.leases.release(name, self.id, st.token)
                self._drop(st)
            elif not await self.leases.renew(name, self.id, st.token, ttl_ms):
                log.warning("discovery lease lost", extra={"source": name})
                self._drop(st)
            return
        if preferred != self.id:
            st.free_passes = st.free_passes + 1 if not await self.leases.holder(name) else 0
            if st.free_passes < ORPHAN_PASSES:
                return
        lease = await self.leases.acquire(name, self.id, ttl_ms)
        if lease.token is not None:
            log.info(
                "discovery: resolving",
                extra={"source": name, "query": st.source.query, "token": lease.token},
            )
            st.token, st.next_refresh, st.free_passes = lease.token, now, 0
            # With no live members listed yet, nobody is preferred: hand over normally later.
            st.orphan = preferred is not None and preferred != self.id

    def _drop(self, st: _State) -> None:
        # A later owner starts counting misses afresh: removals only ever get slower.
        st.token, st.misses, st.free_passes, st.orphan = None, {}, 0, False

    async def _refresh(self, st: _State, now: float) -> None:
        source, name = st.source, st.source.name
        st.next_refresh = now + source.refresh_s
        lifetime_s = max(0.2, min(2.0, source.refresh_s / 2, self.coordination.lease_ttl_ms / 2000))
        answer = await self._resolve(source, lifetime_s)
        self.metrics.discovery_resolutions.labels(name).inc()
        failure, targets = answer.failure, answer.targets
        if failure in ("nxdomain", "empty") and source.allow_empty:
            failure, targets = "", ()
        elif failure:
            targets = None
            self.metrics.discovery_failures.labels(name, failure).inc()
        if failure != st.failure:  # once per change: a DNS outage logs one line, not one a refresh
            if failure:
                log.warning(
                    "discovery failed (entries kept)",
                    extra={"source": name, "reason": failure, "detail": answer.detail},
                )
            else:
                log.info("discovery answering again", extra={"source": name})
            st.failure = failure
        assert st.token is not None
        if not await self.leases.renew(name, self.id, st.token, self.coordination.lease_ttl_ms):
            log.warning("discovery lease lost while resolving", extra={"source": name})
            self._drop(st)
            return
        try:
            owned = await self._reconcile(st, targets)
        except StoreError as exc:
            failure, owned = "registry", None
            answer = Answer(targets, failure, str(exc))
            self.metrics.discovery_failures.labels(name, failure).inc()
        if owned is not None:
            self.metrics.discovery_targets.labels(name).set(owned)
        record = {
            "kind": source.kind,
            "query": source.query,
            "targets": owned,
            "answer": None if answer.targets is None else len(answer.targets),
            "detail": answer.detail if failure else "",
            "refresh_s": source.refresh_s,
        }
        ok = await self.leases.write_status(
            name,
            self.id,
            st.token,
            answered=failure == "",
            failure=failure,
            record=record,
            lease_ttl_ms=self.coordination.lease_ttl_ms,
            status_ttl_ms=int(source.refresh_s * 3000) + self.coordination.lease_ttl_ms * 2,
        )
        if not ok:
            log.warning("discovery lease lost before the status write", extra={"source": name})
            self._drop(st)

    async def _reconcile(self, st: _State, targets: tuple[Target, ...] | None) -> int | None:
        """Apply the plan with the registry's revision compare-and-set; returns the number
        of entries the source owns, or None if the registry kept moving under us."""
        name = st.source.name
        for _ in range(10):
            registry = await self.store.read_registry()
            p = plan(st.source, targets, registry.endpoints, registry.raw, st.misses)
            for conflict in sorted(set(p.conflicts) - st.conflicts):
                log.warning(
                    "discovery: someone else's entry left alone",
                    extra={"source": name, "endpoint": conflict},
                )
            st.conflicts = frozenset(p.conflicts)
            if p.put or p.remove:
                rev = await self.store.update_registry(registry.rev, p.remove, p.put)
                if rev < 0:
                    continue
                log.info(
                    "discovery changed the registry",
                    extra={
                        "source": name,
                        "rev": rev,
                        "put": ",".join(sorted(p.put)) or "-",
                        "removed": ",".join(p.remove) or "-",
                    },
                )
            st.misses = p.misses
            return p.owned
        raise StoreError(f"discovery {name}: the registry kept changing; retrying next refresh")
