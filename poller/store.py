"""Redis schema v1: key names, Lua scripts, and ``RedisStore`` (every Redis call).

Keys share the hash tag ``{<namespace>}`` so multi-key scripts run on Redis Cluster.
Writes to an endpoint's view are fenced: a script checks that the endpoint's lease
still holds the writer's token before it touches anything, so a poller that was paused
past its lease (GC, SIGSTOP, partition) cannot overwrite the new owner's data.
Timestamps in the view come from Redis ``TIME`` (one clock for every reader).

Scripts are registered once and run with EVALSHA; redis-py's ``Script`` reloads them
after NOSCRIPT (a restarted or failed-over Redis has no scripts).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from .config import RedisSettings
from .connection import connect
from .errors import SchemaMismatch, StoreError
from .registry import Endpoint, endpoint_from_json, validate_endpoint_id

__all__ = [
    "SCHEMA_VERSION",
    "Acquired",
    "Keys",
    "RedisStore",
    "Registry",
    "WriteResult",
    "connect",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
T = TypeVar("T")


class Keys:
    """Every key of schema v1 under the prefix ``{namespace}``."""

    def __init__(self, namespace: str = "llmgw") -> None:
        self.namespace = namespace
        self.prefix = "{" + namespace + "}"
        self.schema = f"{self.prefix}:schema"
        self.endpoints = f"{self.prefix}:endpoints"
        self.endpoints_rev = f"{self.prefix}:endpoints:rev"
        self.members = f"{self.prefix}:members"
        self.fence = f"{self.prefix}:fence"
        self.events = f"{self.prefix}:events"
        self.epoch = f"{self.prefix}:epoch"
        # The whole view in two hashes, for snapshots in one cheap read (docs/schema.md).
        self.view_stats = f"{self.prefix}:view:stats"
        self.view_failures = f"{self.prefix}:view:failures"

    def lease(self, endpoint_id: str) -> str:
        return f"{self.prefix}:lease:{endpoint_id}"

    def stats(self, endpoint_id: str) -> str:
        return f"{self.prefix}:stats:{endpoint_id}"

    def failure(self, endpoint_id: str) -> str:
        return f"{self.prefix}:failure:{endpoint_id}"


# --- Lua (5.1). Lease values are "<poller id> <token>"; poller ids have no spaces. ------

# KEYS: fence, lease...   ARGV: poller id, lease ttl ms
# Returns, per lease: {1, token} newly acquired, {2, token} already ours (renewed),
# {0, "<holder> <token>"} held by someone else.
ACQUIRE_LUA = """
local out = {}
for i = 2, #KEYS do
  local cur = redis.call('GET', KEYS[i])
  if not cur then
    local token = redis.call('INCR', KEYS[1])
    redis.call('SET', KEYS[i], ARGV[1] .. ' ' .. token, 'PX', ARGV[2])
    out[#out + 1] = {1, token}
  else
    local sp = string.find(cur, ' ', 1, true)
    if sp and string.sub(cur, 1, sp - 1) == ARGV[1] then
      redis.call('PEXPIRE', KEYS[i], ARGV[2])
      out[#out + 1] = {2, tonumber(string.sub(cur, sp + 1))}
    else
      out[#out + 1] = {0, cur}
    end
  end
end
return out
"""

# KEYS: lease...   ARGV: lease ttl ms, expected value per lease
# Returns, per lease: 1 renewed, 0 lost (missing or another token).
RENEW_LUA = """
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i + 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# KEYS: events, lease...   ARGV: (expected value, endpoint id) per lease
# Deletes each lease that still holds the expected value and publishes "released <id>".
# Returns the number released.
RELEASE_LUA = """
local n = 0
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[2 * i - 3] then
    redis.call('DEL', KEYS[i])
    redis.call('PUBLISH', KEYS[1], 'released ' .. ARGV[2 * i - 2])
    n = n + 1
  end
end
return n
"""

# Redis clock in Unix ms (TIME is allowed in scripts: Redis 5+ replicates effects).
_NOW_MS = """
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
"""

# KEYS: lease, stats, failure, events, view stats, view failures
# ARGV: lease value, lease ttl ms, stats ttl ms, endpoint id, then field/value pairs
# Fenced: only if the lease still holds our value. Renews the lease, replaces the stats
# hash (so fields the engine stopped publishing disappear), stamps scraped_at_ms from
# TIME, bumps seq, sets the TTL, clears the failure, mirrors the stats as one record in
# the view hash and publishes "stats <id> <seq>".
# Returns {1, seq} accepted, or {0, current lease value or ""} rejected.
WRITE_STATS_LUA = (
    """
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
    + _NOW_MS
    + """
local seq = (tonumber(redis.call('HGET', KEYS[2], 'seq')) or 0) + 1
local sp = string.find(ARGV[1], ' ', 1, true)
redis.call('DEL', KEYS[2])
local poller, token = string.sub(ARGV[1], 1, sp - 1), string.sub(ARGV[1], sp + 1)
local fields = {'seq', seq, 'scraped_at_ms', now, 'poller', poller, 'token', token}
local record = {seq = tostring(seq), scraped_at_ms = now, poller = poller, token = token}
for i = 5, #ARGV, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  record[ARGV[i]] = ARGV[i + 1]
end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[3])
local expires = string.format('%.0f', tonumber(now) + tonumber(ARGV[3]))
redis.call('HSET', KEYS[5], ARGV[4], now .. ' ' .. (record['interval_ms'] or '0') .. ' ' ..
           expires .. ' ' .. poller .. ' ' .. token .. '|' .. cjson.encode(record))
redis.call('HDEL', KEYS[6], ARGV[4])
redis.call('PUBLISH', KEYS[4], 'stats ' .. ARGV[4] .. ' ' .. seq)
return {1, seq}
"""
)

# KEYS: lease, failure, events, view failures
# ARGV: lease value, lease ttl ms, failure ttl ms, endpoint id, reason, detail, missing
# Fenced like WRITE_STATS. Keeps since_ms and counts while the reason stays the same;
# leaves the last good stats alone; mirrors the failure as one record in the view hash.
# Publishes "failure <id> <reason>".
# Returns {1, count} accepted, or {0, current lease value or ""} rejected.
WRITE_FAILURE_LUA = (
    """
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
    + _NOW_MS
    + """
local since = now
local count = 1
if redis.call('HGET', KEYS[2], 'reason') == ARGV[5] then
  since = redis.call('HGET', KEYS[2], 'since_ms') or now
  count = (tonumber(redis.call('HGET', KEYS[2], 'count')) or 0) + 1
else
  redis.call('DEL', KEYS[2])
end
local sp = string.find(ARGV[1], ' ', 1, true)
local poller, token = string.sub(ARGV[1], 1, sp - 1), string.sub(ARGV[1], sp + 1)
redis.call('HSET', KEYS[2], 'reason', ARGV[5], 'detail', ARGV[6], 'missing', ARGV[7],
           'since_ms', since, 'at_ms', now, 'count', count, 'poller', poller, 'token', token)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local record = {reason = ARGV[5], detail = ARGV[6], missing = ARGV[7], since_ms = since,
                at_ms = now, count = tostring(count), poller = poller, token = token}
local expires = string.format('%.0f', tonumber(now) + tonumber(ARGV[3]))
redis.call('HSET', KEYS[4], ARGV[4], now .. ' ' .. expires .. ' ' .. poller .. ' ' .. token ..
           '|' .. cjson.encode(record))
redis.call('PUBLISH', KEYS[3], 'failure ' .. ARGV[4] .. ' ' .. ARGV[5])
return {1, count}
"""
)

# KEYS: members, schema, epoch
# ARGV: poller id ("" = only read), member ttl ms, schema version, a fresh random epoch
# Adds/refreshes us (score = Redis-clock expiry), prunes expired members, claims the schema
# version and a data epoch if Redis has none (a restart that lost everything gets a new
# epoch: pollers notice within a heartbeat, even when the registry revision repeats) and
# returns {now, schema version found, epoch, member, member, ...}: the live members.
HEARTBEAT_LUA = (
    _NOW_MS
    + """
local schema = redis.call('GET', KEYS[2])
local epoch = redis.call('GET', KEYS[3])
if ARGV[1] ~= '' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  if not schema then
    redis.call('SET', KEYS[2], ARGV[3])
    schema = ARGV[3]
  end
  if not epoch then
    redis.call('SET', KEYS[3], ARGV[4])
    epoch = ARGV[4]
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
end
local out = {now, schema or '', epoch or ''}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do out[#out + 1] = m end
return out
"""
)

# KEYS: endpoints, rev, events, view stats, view failures, then (stats, failure, lease)
#       of each removed id
# ARGV: expected rev ("" = any), n removed, removed ids..., then id/json pairs to set
# Compare-and-set on the revision, so concurrent syncs converge instead of interleaving.
# Returns the new revision, or -1 when the revision moved (caller re-reads and retries).
REGISTRY_LUA = """
local rev = redis.call('GET', KEYS[2]) or '0'
if ARGV[1] ~= '' and ARGV[1] ~= rev then return -1 end
local n = tonumber(ARGV[2])
for i = 1, n do
  redis.call('HDEL', KEYS[1], ARGV[2 + i])
  redis.call('HDEL', KEYS[4], ARGV[2 + i])
  redis.call('HDEL', KEYS[5], ARGV[2 + i])
  redis.call('DEL', KEYS[5 + 3 * i - 2], KEYS[5 + 3 * i - 1], KEYS[5 + 3 * i])
end
for i = 3 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local new = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', KEYS[3], 'endpoints ' .. new)
return new
"""


# KEYS: endpoints, rev   Returns {rev, {id, json, ...}}: one consistent read, also on
# Cluster (whose redis-py MULTI pipelines run on a private event loop in a thread).
READ_REGISTRY_LUA = """
return {redis.call('GET', KEYS[2]) or '0', redis.call('HGETALL', KEYS[1])}
"""


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


@dataclass(frozen=True, slots=True)
class Registry:
    """The endpoint registry at one revision; invalid entries are kept with their error."""

    rev: int
    endpoints: dict[str, Endpoint]
    invalid: dict[str, str]
    raw: dict[str, str]

    @property
    def ids(self) -> list[str]:
        return sorted([*self.endpoints, *self.invalid])


class WriteBatcher:
    """Sends the fenced writes that arrive within ``window_s`` as one pipeline.

    A lone command costs redis-py ~0.2 ms of CPU, mostly the send/recv system calls; in
    a pipeline it is ~0.03 ms (PERFORMANCE.md). Scrapes finish at random moments, so
    waiting a few milliseconds gathers several writes per round trip at a few hundred
    endpoints per second, at no cost to the data (a write is late by at most the window).
    EVALSHA is sent directly, not through redis-py's pipeline script support, which would
    add a SCRIPT EXISTS round trip per batch; a NOSCRIPT reply is retried one by one
    through ``Script``, which loads the script.
    """

    def __init__(self, client: Any, window_s: float = 0.005, max_batch: int = 256) -> None:
        self.client = client
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, future))
        if len(self._pending) >= self.max_batch:
            self._start_flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._start_flush)
        return await future

    def _start_flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._flush(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(
        self, batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]]
    ) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for script, keys, args, _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the connection failed: every caller sees it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (script, keys, args, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, rexc.NoScriptError):
                try:
                    reply = await script(keys=keys, args=args)
                except Exception as exc:
                    future.set_exception(exc)
                    continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)


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
        self.epoch = ""
        #: Batch fenced writes over this window (0: one EVALSHA per write). redis-py does
        #: not pipeline EVALSHA on Cluster, so Cluster clients write one by one.
        batching = write_batch_window_s > 0 and not isinstance(client, RedisCluster)
        self._batcher = WriteBatcher(client, write_batch_window_s) if batching else None
        register = client.register_script
        self._acquire = register(ACQUIRE_LUA)
        self._renew = register(RENEW_LUA)
        self._release = register(RELEASE_LUA)
        self._write_stats = register(WRITE_STATS_LUA)
        self._write_failure = register(WRITE_FAILURE_LUA)
        self._heartbeat = register(HEARTBEAT_LUA)
        self._registry = register(REGISTRY_LUA)
        self._read_registry = register(READ_REGISTRY_LUA)

    @classmethod
    def from_settings(cls, settings: RedisSettings) -> RedisStore:
        return cls(
            connect(settings),
            settings.namespace,
            write_batch_window_s=settings.write_batch_ms / 1000,
        )

    async def close(self) -> None:
        await self.client.aclose()
        # A Sentinel-managed client keeps its own connections to the sentinels.
        manager = getattr(getattr(self.client, "connection_pool", None), "sentinel_manager", None)
        for sentinel in getattr(manager, "sentinels", ()):
            await sentinel.aclose()

    async def _call(self, awaitable: Awaitable[T], what: str) -> T:
        """The one place redis-py's exceptions become ours."""
        try:
            return await awaitable
        except rexc.ResponseError as exc:
            raise StoreError(f"Redis rejected {what}: {exc}") from exc
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            raise StoreError(f"Redis unreachable during {what}: {exc}") from exc
        except rexc.RedisError as exc:
            raise StoreError(f"Redis error during {what}: {exc}") from exc
        except UnicodeDecodeError as exc:
            # Only with a client of the caller's that decodes strictly; connect() replaces.
            raise StoreError(
                f"Redis returned invalid UTF-8 during {what} (use a client with "
                "encoding_errors='replace', as poller.connection.connect() builds)"
            ) from exc

    def _run(self, script: Any, keys: list[str], args: list[Any]) -> Awaitable[Any]:
        if self._batcher is not None:
            return self._batcher.call(script, keys, args)
        result: Awaitable[Any] = script(keys=keys, args=args)
        return result

    # --- schema ------------------------------------------------------------------------

    async def ensure_schema(self) -> None:
        """Claim schema v1 in an empty Redis; refuse to run against another version."""
        await self._call(self.client.set(self.keys.schema, SCHEMA_VERSION, nx=True), "SET schema")
        found = await self._call(self.client.get(self.keys.schema), "GET schema")
        if found != SCHEMA_VERSION:
            raise self._mismatch(None if found is None else str(found))

    async def ping(self) -> bool:
        return bool(await self._call(self.client.ping(), "PING"))

    # --- membership ----------------------------------------------------------------------

    async def heartbeat(self, poller_id: str, member_ttl_ms: int) -> tuple[int, list[str]]:
        """Refresh our membership; returns (Redis now ms, live members, sorted).

        Raises SchemaMismatch if Redis holds data of another schema version."""
        reply = await self._call(
            self._heartbeat(
                keys=[self.keys.members, self.keys.schema, self.keys.epoch],
                args=[poller_id, member_ttl_ms, SCHEMA_VERSION, secrets.token_hex(8)],
            ),
            "heartbeat",
        )
        if poller_id and reply[1] != SCHEMA_VERSION:
            raise self._mismatch(reply[1])
        #: The data epoch Redis reported: it changes only when Redis lost everything.
        self.epoch = str(reply[2])
        return int(reply[0]), sorted(reply[3:])

    def _mismatch(self, found: str | None) -> SchemaMismatch:
        return SchemaMismatch(
            f"Redis key {self.keys.schema} says schema version {found!r}, this poller "
            f"speaks version {SCHEMA_VERSION}; upgrade the poller or use another namespace"
        )

    async def live_members(self) -> list[str]:
        return (await self.heartbeat("", 0))[1]

    async def leave(self, poller_id: str) -> None:
        await self._call(self.client.zrem(self.keys.members, poller_id), "ZREM members")

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
            self._release(keys=[self.keys.events, *(self.keys.lease(e) for e in ids)], args=args),
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

    # --- registry ------------------------------------------------------------------------

    async def registry_rev(self) -> int:
        return int(await self._call(self.client.get(self.keys.endpoints_rev), "GET rev") or 0)

    async def read_registry(self) -> Registry:
        """Registry and revision read together, so they belong together."""
        rev, flat = await self._call(
            self._read_registry(keys=[self.keys.endpoints, self.keys.endpoints_rev]),
            "read registry",
        )
        it = iter(flat)
        raw = dict(zip(it, it, strict=True))
        endpoints: dict[str, Endpoint] = {}
        invalid: dict[str, str] = {}
        for endpoint_id, value in raw.items():
            try:
                endpoints[endpoint_id] = endpoint_from_json(endpoint_id, value)
            except Exception as exc:  # a foreign writer's bad entry must not hide the others
                invalid[endpoint_id] = str(exc)
        return Registry(int(rev or 0), endpoints, invalid, dict(raw))

    async def _apply_registry(
        self, expected_rev: int | None, remove: Sequence[str], put: Mapping[str, str]
    ) -> int:
        keys = [
            self.keys.endpoints,
            self.keys.endpoints_rev,
            self.keys.events,
            self.keys.view_stats,
            self.keys.view_failures,
        ]
        for e in remove:
            keys += [self.keys.stats(e), self.keys.failure(e), self.keys.lease(e)]
        args: list[str | int] = ["" if expected_rev is None else str(expected_rev), len(remove)]
        args += list(remove)
        for e, value in put.items():
            args += [e, value]
        return int(await self._call(self._registry(keys=keys, args=args), "update registry"))

    async def put_endpoint(self, endpoint: Endpoint, *, replace: bool = True) -> int:
        """Add or update one entry; returns the new revision.

        With ``replace=False`` an existing id is an error (``endpoints add``)."""
        if not replace:
            exists = await self._call(
                self.client.hexists(self.keys.endpoints, endpoint.id), "HEXISTS"
            )
            if exists:
                raise StoreError(f"endpoint {endpoint.id!r} already exists")
        return await self._apply_registry(None, (), {endpoint.id: endpoint.to_json()})

    async def remove_endpoint(self, endpoint_id: str) -> int | None:
        """Remove an entry with its stats, failure and lease; None if it did not exist."""
        validate_endpoint_id(endpoint_id)
        exists = await self._call(self.client.hexists(self.keys.endpoints, endpoint_id), "HEXISTS")
        if not exists:
            return None
        return await self._apply_registry(None, [endpoint_id], {})

    async def replace_registry(
        self, endpoints: Mapping[str, Endpoint], *, attempts: int = 20
    ) -> tuple[int, list[str], list[str], list[str]]:
        """Make the registry exactly ``endpoints``, atomically.

        Returns (rev, added, changed, removed). Writes nothing, and bumps no revision, when
        the registry already matches: several pollers syncing one file converge quietly.
        """
        wanted = {e.id: e.to_json() for e in endpoints.values()}
        for _ in range(attempts):
            current = await self.read_registry()
            added, changed, removed = diff_registry(current.raw, wanted)
            if not (added or changed or removed):
                return current.rev, [], [], []
            put = {e: wanted[e] for e in [*added, *changed]}
            rev = await self._apply_registry(current.rev, removed, put)
            if rev >= 0:
                return rev, added, changed, removed
        raise StoreError("registry kept changing under us; gave up replacing it")

    # --- events --------------------------------------------------------------------------

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[aioredis.client.PubSub]:
        """A pub/sub connection on ``P:events`` (callers read with get_message)."""
        client: Any = self.client
        if isinstance(client, RedisCluster):
            # Cluster PUBLISH reaches every node: listen on any one of them.
            node = client.get_random_node()
            client = aioredis.Redis(
                host=node.host, port=int(node.port), **_pubsub_options(self.client)
            )
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await self._call(pubsub.subscribe(self.keys.events), "SUBSCRIBE")
            yield pubsub
        finally:
            try:
                await pubsub.aclose()
            except Exception:
                log.debug("pubsub close failed", exc_info=True)
            if client is not self.client:
                await client.aclose()


def _pubsub_options(client: Any) -> dict[str, Any]:
    kwargs = client.get_connection_kwargs() if hasattr(client, "get_connection_kwargs") else {}
    keep = ("username", "password", "ssl", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
    return {k: kwargs[k] for k in keep if k in kwargs} | {"decode_responses": True}


def diff_registry(
    current: Mapping[str, str], wanted: Mapping[str, str]
) -> tuple[list[str], list[str], list[str]]:
    """(added, changed, removed) ids between two raw registries (id -> JSON)."""
    added = sorted(set(wanted) - set(current))
    removed = sorted(set(current) - set(wanted))
    changed = sorted(e for e in set(wanted) & set(current) if wanted[e] != current[e])
    return added, changed, removed
