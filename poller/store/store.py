"""``RedisStore``: every Redis call of the writer side (registry, membership, leases,
fenced writes). Key names are in ``poller/schema/keys.py``, the Lua scripts in
``poller/schema/scripts/*.lua`` (docs/schema.md is the contract they keep).

Writes to an endpoint's view are fenced: a script checks that the endpoint's lease
still holds the writer's token before it touches anything, so a poller that was paused
past its lease (GC, SIGSTOP, partition) cannot overwrite the new owner's data.
Timestamps in the view come from Redis ``TIME`` (one clock for every reader).

Scripts are registered once and run with EVALSHA; redis-py's ``Script`` reloads them
after NOSCRIPT (a restarted or failed-over Redis has no scripts).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from poller._version import __version__
from poller.errors import SchemaMismatch
from poller.redis.connection import close_client, connect, subscribe
from poller.redis.errors import redis_call
from poller.redis.settings import RedisSettings
from poller.schema.endpoint import Endpoint
from poller.schema.keys import SCHEMA_VERSION, Keys
from poller.schema.lua import lua
from poller.store.batch import WriteBatcher
from poller.store.members import (
    DUPLICATE_MEMORY_MS,
    Heartbeat,
    Instance,
    heartbeat_of,
    this_process,
)
from poller.store.registry import Registry, RegistryStore

__all__ = ["Acquired", "Heartbeat", "RedisStore", "WriteResult"]

log = logging.getLogger(__name__)

T = TypeVar("T")


# The Lua scripts (5.1) live in scripts/*.lua, each with a header naming KEYS, ARGV and
# the return value. Lease values are "<poller id> <token>"; poller ids have no spaces.


@dataclass(frozen=True, slots=True)
class Acquired:
    """Outcome of acquiring one lease: ``token`` when we hold it, else ``holder``."""

    endpoint_id: str
    token: int | None
    holder: str | None = None
    renewed: bool = False


@dataclass(frozen=True, slots=True)
class WriteResult:
    accepted: bool
    #: seq of the stats hash, or count of the failure, when accepted.
    value: int = 0
    #: The lease's current value when rejected ("" when the lease is gone).
    holder: str = ""


def _json(value: Mapping[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


def _fenced_value(poller_id: str, token: int) -> str:
    return f"{poller_id} {token}"


class RedisStore:
    """Schema v1 on one Redis (or Cluster): registry, membership, leases, fenced writes."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        namespace: str = "llmgw",
        *,
        write_batch_window_s: float = 0.0,
    ) -> None:
        self.client = client
        self.keys = Keys(namespace)
        #: Batch fenced writes over this window (0: one EVALSHA per write). redis-py does
        #: not pipeline EVALSHA on Cluster, so Cluster clients write one by one.
        batching = write_batch_window_s > 0 and not isinstance(client, RedisCluster)
        self._batcher = WriteBatcher(client, write_batch_window_s) if batching else None
        register = client.register_script
        self._acquire = register(lua("acquire"))
        self._renew = register(lua("renew"))
        self._release = register(lua("release"))
        self._write_stats = register(lua("write_stats"))
        self._write_failure = register(lua("write_failure"))
        self._heartbeat = register(lua("heartbeat"))
        # The registry's reads and writes, made through this store's ``_call``; the
        # methods below delegate to it.
        self._registry = RegistryStore(client, self.keys, self._call)

    @classmethod
    def from_settings(cls, settings: RedisSettings) -> RedisStore:
        return cls(
            connect(settings),
            settings.namespace,
            write_batch_window_s=settings.write_batch_ms / 1000,
        )

    async def close(self) -> None:
        await close_client(self.client)

    async def _call(self, awaitable: Awaitable[T], what: str) -> T:
        """Every Redis call of the store goes through here (tests inject faults in it)."""
        return await redis_call(awaitable, what)

    def _run(self, script: Any, keys: list[str], args: list[Any]) -> Awaitable[Any]:
        if self._batcher is not None:
            return self._batcher.call(script, keys, args)
        result: Awaitable[Any] = script(keys=keys, args=args)
        return result

    # --- registry (registry.py) ---------------------------------------------------------

    async def registry_rev(self) -> int:
        return await self._registry.registry_rev()

    async def read_registry(self) -> Registry:
        return await self._registry.read_registry()

    async def update_registry(
        self, expected_rev: int, remove: Sequence[str], put: Mapping[str, str]
    ) -> int:
        return await self._registry.update_registry(expected_rev, remove, put)

    async def put_endpoint(
        self, endpoint: Endpoint, *, replace: bool = True, unique_url: bool = False
    ) -> int:
        return await self._registry.put_endpoint(endpoint, replace=replace, unique_url=unique_url)

    async def remove_endpoint(self, endpoint_id: str) -> int | None:
        return await self._registry.remove_endpoint(endpoint_id)

    async def replace_registry(
        self, endpoints: Mapping[str, Endpoint], *, attempts: int = 20, unique_url: bool = False
    ) -> tuple[int, list[str], list[str], list[str]]:
        return await self._registry.replace_registry(
            endpoints, attempts=attempts, unique_url=unique_url
        )

    # --- schema ------------------------------------------------------------------------

    async def ensure_schema(self) -> None:
        """Claim schema v1 in an empty Redis; refuse to run against another version.
        Commands that add to the registry call this; the others (reads, a removal, a
        drain: they act only on what is there) ``check_schema``."""
        await self._call(self.client.set(self.keys.schema, SCHEMA_VERSION, nx=True), "SET schema")
        found = await self._call(self.client.get(self.keys.schema), "GET schema")
        if found != SCHEMA_VERSION:
            raise self._mismatch(None if found is None else str(found))

    async def check_schema(self) -> str | None:
        """The schema version Redis holds (None: nothing ever wrote this namespace),
        writing nothing: a read-only ACL user may call it. Another version raises
        ``SchemaMismatch``."""
        found = await self._call(self.client.get(self.keys.schema), "GET schema")
        if found is not None and found != SCHEMA_VERSION:
            raise self._mismatch(str(found))
        return None if found is None else str(found)

    async def ping(self) -> bool:
        return bool(await self._call(self.client.ping(), "PING"))

    # --- membership ----------------------------------------------------------------------

    async def heartbeat(
        self, poller_id: str, member_ttl_ms: int, instance: Instance | None = None
    ) -> Heartbeat:
        """Refresh our membership (with an empty ``poller_id``: only read it) as
        ``instance`` (default: this process's).

        Raises SchemaMismatch if Redis holds data of another schema version, and
        IdentityConflict if a live member of another instance holds ``poller_id`` (then
        nothing but a duplicate record is written: ``poller/store/members.py``)."""
        keys = [self.keys.members, self.keys.schema, self.keys.epoch]
        args: list[str | int] = [poller_id, member_ttl_ms, SCHEMA_VERSION, secrets.token_hex(8)]
        if poller_id:
            me = instance or this_process()
            keys += [self.keys.members_info, self.keys.members_drain, self.keys.members_duplicates]
            info = {"version": __version__, "member_ttl_ms": member_ttl_ms, **me.record()}
            args += [_json(info), me.token, DUPLICATE_MEMORY_MS, _json(me.record())]
        reply = await self._call(self._heartbeat(keys=keys, args=args), "heartbeat")
        beat = heartbeat_of(poller_id, reply)  # raises IdentityConflict: the id is held
        if poller_id and reply[1] != SCHEMA_VERSION:
            raise self._mismatch(reply[1])
        return beat

    def _mismatch(self, found: str | None) -> SchemaMismatch:
        return SchemaMismatch(
            f"Redis key {self.keys.schema} says schema version {found!r}, this poller "
            f"speaks version {SCHEMA_VERSION}; upgrade the poller or use another namespace"
        )

    async def live_members(self) -> list[str]:
        return (await self.heartbeat("", 0)).members

    async def leave(self, poller_id: str) -> None:
        """Leave membership; a drain of us ends with it (a restarted poller serves)."""
        pipe = self.client.pipeline(transaction=False)  # in order: membership first
        pipe.zrem(self.keys.members, poller_id)
        pipe.hdel(self.keys.members_info, poller_id)
        pipe.hdel(self.keys.members_drain, poller_id)
        pipe.hdel(self.keys.members_duplicates, poller_id)
        await self._call(pipe.execute(), "leave")

    # --- leases --------------------------------------------------------------------------

    async def acquire_leases(
        self, poller_id: str, endpoint_ids: Sequence[str], lease_ttl_ms: int
    ) -> list[Acquired]:
        if not endpoint_ids:
            return []
        keys = [self.keys.fence, *(self.keys.lease(e) for e in endpoint_ids)]
        reply = await self._call(
            self._acquire(keys=keys, args=[poller_id, lease_ttl_ms]), "acquire leases"
        )
        out = []
        for endpoint_id, (status, value) in zip(endpoint_ids, reply, strict=True):
            if int(status) == 0:
                out.append(Acquired(endpoint_id, None, holder=str(value)))
            else:
                out.append(Acquired(endpoint_id, int(value), renewed=int(status) == 2))
        return out

    async def renew_leases(
        self, poller_id: str, held: Mapping[str, int], lease_ttl_ms: int
    ) -> dict[str, bool]:
        """Renew every lease in ``held`` (id -> token) in one round trip."""
        if not held:
            return {}
        ids = list(held)
        reply = await self._call(
            self._renew(
                keys=[self.keys.lease(e) for e in ids],
                args=[lease_ttl_ms, *(_fenced_value(poller_id, held[e]) for e in ids)],
            ),
            "renew leases",
        )
        return {e: bool(int(r)) for e, r in zip(ids, reply, strict=True)}

    async def release_leases(self, poller_id: str, held: Mapping[str, int]) -> int:
        """Release the leases we still hold; others may take them at once."""
        if not held:
            return 0
        ids = list(held)
        args: list[str] = []
        for e in ids:
            args += [_fenced_value(poller_id, held[e]), e]
        reply = await self._call(
            self._release(
                keys=[self.keys.events, self.keys.updates, *(self.keys.lease(e) for e in ids)],
                args=args,
            ),
            "release leases",
        )
        return int(reply)

    async def lease_holder(self, endpoint_id: str) -> tuple[str, int] | None:
        value = await self._call(self.client.get(self.keys.lease(endpoint_id)), "GET lease")
        if not value:
            return None
        owner, _, token = str(value).partition(" ")
        return owner, int(token)

    async def release_leftovers(self, poller_id: str, endpoint_ids: Iterable[str]) -> int:
        """On start-up with a stable id, drop leases an earlier run of us left behind."""
        ids = list(endpoint_ids)
        if not ids:
            return 0
        values = await self._call(
            self.client.mget([self.keys.lease(e) for e in ids]), "MGET leases"
        )
        mine: dict[str, int] = {}
        for e, value in zip(ids, values, strict=True):
            if value and str(value).split(" ", 1)[0] == poller_id:
                mine[e] = int(str(value).split(" ", 1)[1])
        return await self.release_leases(poller_id, mine)

    # --- fenced writes -------------------------------------------------------------------

    async def write_stats(
        self,
        endpoint_id: str,
        poller_id: str,
        token: int,
        fields: Mapping[str, str],
        *,
        lease_ttl_ms: int,
        stats_ttl_ms: int,
    ) -> WriteResult:
        """One EVALSHA: check the lease, renew it, replace the stats, publish the event."""
        args: list[str | int] = [
            _fenced_value(poller_id, token),
            lease_ttl_ms,
            stats_ttl_ms,
            endpoint_id,
        ]
        for name, value in fields.items():
            args += [name, value]
        keys = [
            self.keys.lease(endpoint_id),
            self.keys.stats(endpoint_id),
            self.keys.failure(endpoint_id),
            self.keys.events,
            self.keys.view_stats,
            self.keys.view_failures,
            self.keys.updates,
        ]
        ok, value = await self._call(self._run(self._write_stats, keys, args), "write stats")
        if int(ok):
            return WriteResult(True, int(value))
        return WriteResult(False, holder=str(value))

    async def write_failure(
        self,
        endpoint_id: str,
        poller_id: str,
        token: int,
        *,
        reason: str,
        detail: str,
        missing: Sequence[str] = (),
        lease_ttl_ms: int,
        failure_ttl_ms: int,
    ) -> WriteResult:
        keys = [
            self.keys.lease(endpoint_id),
            self.keys.failure(endpoint_id),
            self.keys.events,
            self.keys.view_failures,
            self.keys.updates,
        ]
        args: list[str | int] = [
            _fenced_value(poller_id, token),
            lease_ttl_ms,
            failure_ttl_ms,
            endpoint_id,
            reason,
            detail[:1000],
            ",".join(missing),
        ]
        ok, value = await self._call(self._run(self._write_failure, keys, args), "write failure")
        if int(ok):
            return WriteResult(True, int(value))
        return WriteResult(False, holder=str(value))

    async def read_stats(self, endpoint_id: str) -> dict[str, str]:
        raw = await self._call(self.client.hgetall(self.keys.stats(endpoint_id)), "HGETALL stats")
        return {str(k): str(v) for k, v in raw.items()}

    async def read_stats_many(self, endpoint_ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """Stats hashes of several endpoints in one pipelined round trip."""
        if not endpoint_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for endpoint_id in endpoint_ids:
            pipe.hgetall(self.keys.stats(endpoint_id))
        replies = await self._call(pipe.execute(), "read stats")
        return {e: dict(r) for e, r in zip(endpoint_ids, replies, strict=True) if r}

    async def read_failure(self, endpoint_id: str) -> dict[str, str]:
        key = self.keys.failure(endpoint_id)
        raw = await self._call(self.client.hgetall(key), "HGETALL failure")
        return {str(k): str(v) for k, v in raw.items()}

    # --- events --------------------------------------------------------------------------

    def subscribe(self) -> AbstractAsyncContextManager[aioredis.client.PubSub]:
        """A pub/sub connection on ``P:events`` (callers read with get_message)."""
        return subscribe(self.client, self.keys.events)
