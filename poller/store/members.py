"""The live pollers as operators see them (``poller status``, the page, ``poller drain``):
membership, each member's own word (``P:members:info``), drain requests
(``P:members:drain``) and duplicates (``P:members:duplicates``).

One id, one process: every process heartbeats with a random instance token of its own
(``this_process()``) and records it, with its host and pid, in its info. The heartbeat
script checks and claims the id in one step: a process that finds its id held by a live
member of another instance writes nothing but a duplicate record (its instance, host,
pid) and is told who holds the id; it refuses to start, or stops if it was running (its
entry was rewritten under it). The record flags the id in ``poller status`` and on the
page until it expires (``DUPLICATE_MEMORY_MS``) or the member goes.

A drain request is written by ``poller drain ID`` (or by the poller itself on SIGUSR1)
and removed by ``poller drain ID --undo``, or with the member when it leaves or expires.
The member acknowledges it at its next heartbeat (its info then says ``"draining":
true``) and rendezvous gives it nothing from then on, in every poller.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from poller.errors import IdentityConflict
from poller.redis.clock import server_ms
from poller.redis.errors import redis_call
from poller.schema.keys import Keys
from poller.schema.lua import lua

__all__ = [
    "DUPLICATE_MEMORY_MS",
    "Heartbeat",
    "Instance",
    "Member",
    "cancel_drain",
    "duplicate_line",
    "duplicate_of",
    "heartbeat_of",
    "lease_holders",
    "leases_of",
    "read_members",
    "request_drain",
    "this_process",
    "where",
]

Client = Redis | RedisCluster
_BY = re.compile(r"[A-Za-z0-9._@-]{1,64}")

#: How long a duplicate record flags its id (unless the member goes first).
DUPLICATE_MEMORY_MS = 600_000


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What a heartbeat learned: Redis's clock, the live members, the data epoch."""

    now_ms: int
    #: Live member ids, sorted.
    members: list[str]
    #: Changes only when Redis lost everything (an empty restart).
    epoch: str
    #: Live members a drain is requested for (``P:members:drain``), sorted: rendezvous
    #: gives them nothing.
    draining: tuple[str, ...] = ()


def heartbeat_of(poller_id: str, reply: list[Any]) -> Heartbeat:
    """The heartbeat script's reply (``[now ms, schema, epoch, ...]``, then the members;
    with a ``poller_id``, the members, "" and the draining ones) as a ``Heartbeat``.
    Raises ``IdentityConflict`` when it says another live instance holds the id ("",
    then the holder's expiry and info)."""
    rest = [str(m) for m in reply[3:]]
    if poller_id and rest[0] == "":  # the id is held: "", its expiry, its info
        raise _conflict(poller_id, int(reply[0]), float(rest[1]), rest[2])
    draining: list[str] = []
    if poller_id:  # members, "", then the draining ones (ids are never empty)
        split = rest.index("")
        rest, draining = rest[:split], rest[split + 1 :]
    return Heartbeat(int(reply[0]), sorted(rest), str(reply[2]), tuple(sorted(draining)))


def _conflict(poller_id: str, now_ms: int, expires_ms: float, info_text: str) -> IdentityConflict:
    """The refusal the heartbeat script's "held" reply means."""
    try:
        info = json.loads(info_text) if info_text else {}
    except ValueError:
        info = {}
    if not isinstance(info, dict):
        info = {}
    host, pid, ttl = info.get("host"), info.get("pid"), info.get("member_ttl_ms")
    left_ms = max(0.0, expires_ms - now_ms)
    age_ms = max(0.0, ttl - left_ms) if isinstance(ttl, int) and ttl > 0 else None
    return IdentityConflict(
        poller_id,
        host=host if isinstance(host, str) and host else None,
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        age_ms=age_ms,
        wait_ms=left_ms,
    )


@dataclass(frozen=True, slots=True)
class Instance:
    """One process heartbeating under a poller id: a random token, its host and pid."""

    token: str
    host: str
    pid: int

    @classmethod
    def new(cls) -> Instance:
        return cls(secrets.token_hex(8), socket.gethostname(), os.getpid())

    def record(self) -> dict[str, Any]:
        """The fields the member info and a duplicate record carry."""
        return {"instance": self.token, "host": self.host, "pid": self.pid}


_this: Instance | None = None


def this_process() -> Instance:
    """This process's instance (a new one in a forked child)."""
    global _this
    if _this is None or _this.pid != os.getpid():
        _this = Instance.new()
    return _this


def where(record: Mapping[str, Any]) -> str:
    """``host web-3 pid 4242`` from an info or duplicate record (``?`` where absent)."""
    host, pid = record.get("host"), record.get("pid")
    host = host if isinstance(host, str) and host else "?"
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else "?"
    return f"host {host} pid {pid}"


@dataclass(frozen=True, slots=True)
class Member:
    id: str
    #: Heartbeat expiry, Redis clock (ms).
    expires_ms: int
    #: The member's own word: version, member_ttl_ms, draining.
    info: dict[str, Any] = field(default_factory=dict)
    #: The drain request (``since_ms``, ``by``), None without one.
    drain: dict[str, Any] | None = None
    #: Another process seen under this id (``instance``, ``host``, ``pid``, ``at_ms``,
    #: ``expires_ms``), None without one.
    duplicate: dict[str, Any] | None = None

    @property
    def state(self) -> str:
        """``serving``, ``draining`` (acknowledged) or ``drain requested`` (not yet, or
        by a poller version that does not drain)."""
        if self.drain is None:
            return "serving"
        return "draining" if self.info.get("draining") is True else "drain requested"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "expires_ms": self.expires_ms,
            "state": self.state,
            "version": self.info.get("version"),
            "member_ttl_ms": self.info.get("member_ttl_ms"),
            "drain": self.drain,
            "instance": self.info.get("instance"),
            "host": self.info.get("host"),
            "pid": self.info.get("pid"),
            "duplicate": self.duplicate,
        }

    def duplicate_line(self, now_ms: int) -> str:
        """What an operator reads under the fleet table ("" without a duplicate)."""
        if self.duplicate is None:
            return ""
        return duplicate_line(self.id, self.info, self.duplicate, now_ms)


def duplicate_line(
    poller_id: str, info: Mapping[str, Any], duplicate: Mapping[str, Any], now_ms: int
) -> str:
    """``p1 is seen from two processes: ...``: the holder, the other and what to do."""
    at = duplicate.get("at_ms")
    ago = f"{max(0, now_ms - at) / 1000:.1f}s ago" if isinstance(at, int) else "recently"
    return (
        f"{poller_id} is seen from two processes: {where(info)} holds it, "
        f"{where(duplicate)} heartbeated under it {ago} and was turned away; "
        "give each poller its own --id"
    )


def duplicate_of(text: Any, info: Mapping[str, Any], now_ms: int) -> dict[str, Any] | None:
    """The member's ``P:members:duplicates`` entry if still in force (not past its
    ``expires_ms``) and of another instance than the member's own, else None."""
    if text is None:
        return None
    record = _object(text)
    expires = record.get("expires_ms")
    if isinstance(expires, int) and expires < now_ms:
        return None
    if record.get("instance") is not None and record.get("instance") == info.get("instance"):
        return None
    return record


def _object(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


async def read_members(client: Client, keys: Keys) -> tuple[int, list[Member]]:
    """(Redis now in ms, the live members sorted by id)."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.zrange(keys.members, 0, -1, withscores=True)
    pipe.hgetall(keys.members_info)
    pipe.hgetall(keys.members_drain)
    pipe.hgetall(keys.members_duplicates)
    replies = await redis_call(pipe.execute(), "members")
    now, scored, infos, drains, duplicates = replies
    now_ms = server_ms(now)
    members = []
    for member, score in scored:
        if score < now_ms:
            continue
        info = _object(infos.get(member))
        members.append(
            Member(
                str(member),
                int(score),
                info,
                _object(drains[member]) if member in drains else None,
                duplicate_of(duplicates.get(member), info, now_ms),
            )
        )
    return now_ms, sorted(members, key=lambda m: m.id)


async def request_drain(client: Client, keys: Keys, poller_id: str, by: str) -> str:
    """Ask a live member to drain: ``requested``, ``already`` (a request stands) or
    ``not live`` (no such live member: nothing written). ``by`` says who asked."""
    if not _BY.fullmatch(by):
        raise ValueError(f"drain requester {by!r} must match {_BY.pattern}")
    script = client.register_script(lua("drain"))
    reply = await redis_call(
        script(keys=[keys.members, keys.members_drain], args=[poller_id, by]), "drain request"
    )
    return {1: "requested", 0: "already"}.get(int(reply), "not live")


async def cancel_drain(client: Client, keys: Keys, poller_id: str) -> bool:
    """Return a member to service; False when no drain was requested for it."""
    removed = await redis_call(client.hdel(keys.members_drain, poller_id), "drain undo")
    return bool(removed)


async def lease_holders(
    client: Client, keys: Keys, endpoint_ids: Iterable[str] | None = None
) -> dict[str, str]:
    """Endpoint id -> the poller holding its lease now (unheld ones absent), for
    ``endpoint_ids`` or else every registered endpoint. Only commands the gateway's and
    the poller's ACL users have (deploy/redis/users.acl): no HKEYS."""
    if endpoint_ids is None:
        registry = await redis_call(client.hgetall(keys.endpoints), "HGETALL endpoints")
        ids = sorted(str(e) for e in registry)
    else:
        ids = sorted(endpoint_ids)
    if not ids:
        return {}
    values = await redis_call(client.mget([keys.lease(e) for e in ids]), "MGET leases")
    return {e: str(v).split(" ")[0] for e, v in zip(ids, values, strict=True) if v}


async def leases_of(client: Client, keys: Keys, poller_id: str) -> list[str]:
    """The registered endpoints whose lease ``poller_id`` holds now (sorted)."""
    return [e for e, p in (await lease_holders(client, keys)).items() if p == poller_id]
