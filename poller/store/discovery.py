"""Redis calls of DNS discovery: the per-source lease, its status record, and the read of
every source's status for ``poller status`` and ``/v1/view``.

A source is resolved by one poller at a time, under a fenced lease ``P:discovery:<source>``
holding ``<poller> <token>`` (tokens come from the same ``P:fence`` counter as endpoint
leases, so they only grow). Status records live in one hash ``P:discovery``, source name ->
JSON, each with its own ``expires_ms``: a source nobody resolves any more fades out.
Registry writes go through ``RedisStore.update_registry`` (revision compare-and-set).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from poller.redis.clock import server_ms
from poller.redis.errors import redis_call
from poller.schema.keys import Keys
from poller.schema.lua import lua

__all__ = ["DiscoveryStore", "SourceLease", "read_sources"]


@dataclass(frozen=True, slots=True)
class SourceLease:
    """Outcome of acquiring a source: ``token`` when ours, else the ``holder``'s value."""

    token: int | None
    holder: str = ""


class DiscoveryStore:
    """The discovery lease and status calls of one poller, on the store's client."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        register = client.register_script
        self._acquire = register(lua("acquire"))
        self._renew = register(lua("renew"))
        self._release = register(lua("discovery_release"))
        self._status = register(lua("discovery_status"))

    async def acquire(self, source: str, poller_id: str, lease_ttl_ms: int) -> SourceLease:
        """Take the source's lease if it is free (or already ours: then renew it)."""
        reply = await redis_call(
            self._acquire(
                keys=[self.keys.fence, self.keys.discovery_lease(source)],
                args=[poller_id, lease_ttl_ms],
            ),
            "acquire discovery lease",
        )
        status, value = reply[0]
        if int(status) == 0:
            return SourceLease(None, str(value))
        return SourceLease(int(value))

    async def renew(self, source: str, poller_id: str, token: int, lease_ttl_ms: int) -> bool:
        reply = await redis_call(
            self._renew(
                keys=[self.keys.discovery_lease(source)],
                args=[lease_ttl_ms, f"{poller_id} {token}"],
            ),
            "renew discovery lease",
        )
        return bool(int(reply[0]))

    async def release(self, source: str, poller_id: str, token: int) -> bool:
        reply = await redis_call(
            self._release(keys=[self.keys.discovery_lease(source)], args=[f"{poller_id} {token}"]),
            "release discovery lease",
        )
        return bool(int(reply))

    async def holder(self, source: str) -> str:
        """The lease's value (``<poller> <token>``), or "" when nobody holds the source."""
        value = await redis_call(
            self.client.get(self.keys.discovery_lease(source)), "GET discovery lease"
        )
        return str(value or "")

    async def write_status(
        self,
        source: str,
        poller_id: str,
        token: int,
        *,
        answered: bool,
        failure: str,
        record: dict[str, Any],
        lease_ttl_ms: int,
        status_ttl_ms: int,
    ) -> bool:
        """Fenced: write the source's status only while we hold its lease (and renew it)."""
        reply = await redis_call(
            self._status(
                keys=[self.keys.discovery_lease(source), self.keys.discovery],
                args=[
                    f"{poller_id} {token}",
                    lease_ttl_ms,
                    status_ttl_ms,
                    source,
                    "1" if answered else "0",
                    failure,
                    json.dumps(record, separators=(",", ":")),
                ],
            ),
            "write discovery status",
        )
        return bool(int(reply[0]))


async def read_sources(client: Any, keys: Keys) -> list[dict[str, Any]]:
    """Every source's status, sorted by name, with ``holder`` (the lease's current owner,
    or None) and ``stale`` (the record outlived its ``expires_ms``: nobody resolves it)."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.hgetall(keys.discovery)
    now, raw = await redis_call(pipe.execute(), "read discovery status")
    now_ms = server_ms(now)
    records: list[dict[str, Any]] = []
    for name in sorted(raw):
        try:
            record = json.loads(raw[name])
        except ValueError:
            continue  # a foreign writer's garbage must not hide the other sources
        if isinstance(record, dict):
            records.append({**record, "source": name})
    if not records:
        return []
    holders = await redis_call(
        client.mget([keys.discovery_lease(r["source"]) for r in records]),
        "MGET discovery leases",
    )
    for record, value in zip(records, holders, strict=True):
        record["holder"] = str(value).split(" ", 1)[0] if value else None
        record["stale"] = _int(record.get("expires_ms")) < now_ms
        record["age_ms"] = (
            max(0, now_ms - _int(record.get("resolved_at_ms")))
            if record.get("resolved_at_ms")
            else None
        )
    return records


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
