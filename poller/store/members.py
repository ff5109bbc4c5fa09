"""The live pollers as operators see them (``poller status``, the page, ``poller drain``):
membership, each member's own word (``P:members:info``) and drain requests
(``P:members:drain``).

A drain request is written by ``poller drain ID`` (or by the poller itself on SIGUSR1)
and removed by ``poller drain ID --undo``, or with the member when it leaves or expires.
The member acknowledges it at its next heartbeat (its info then says ``"draining":
true``) and rendezvous gives it nothing from then on, in every poller.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from poller.redis.clock import server_ms
from poller.redis.errors import redis_call
from poller.schema.keys import Keys
from poller.schema.lua import lua

__all__ = [
    "Member",
    "cancel_drain",
    "lease_holders",
    "leases_of",
    "read_members",
    "request_drain",
]

Client = Redis | RedisCluster
_BY = re.compile(r"[A-Za-z0-9._@-]{1,64}")


@dataclass(frozen=True, slots=True)
class Member:
    id: str
    #: Heartbeat expiry, Redis clock (ms).
    expires_ms: int
    #: The member's own word: version, member_ttl_ms, draining.
    info: dict[str, Any] = field(default_factory=dict)
    #: The drain request (``since_ms``, ``by``), None without one.
    drain: dict[str, Any] | None = None

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
        }


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
    now, scored, infos, drains = await redis_call(pipe.execute(), "members")
    now_ms = server_ms(now)
    members = [
        Member(
            str(member),
            int(score),
            _object(infos.get(member)),
            _object(drains[member]) if member in drains else None,
        )
        for member, score in scored
        if score >= now_ms
    ]
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
