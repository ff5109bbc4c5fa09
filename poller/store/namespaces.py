"""The namespaces on one Redis: those whose schema key exists (``{NS}:schema``).

A command or poller given a namespace nothing wrote (a typo, braces copied from a key)
names the ones that exist, so the mistake shows in the same line. Bounded: at most
``SCAN_CALLS`` SCANs, and nothing on a Cluster or for a user without SCAN.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import RedisCluster

from poller.redis.errors import REDIS_ERRORS

__all__ = ["SCAN_CALLS", "namespaces"]

#: At most this many SCAN calls (of COUNT 1000) look for other namespaces' schema keys.
SCAN_CALLS = 10


async def namespaces(client: Any) -> list[str] | None:
    """The namespaces with a schema key, sorted, from at most ``SCAN_CALLS`` SCANs; None
    when they cannot be listed cheaply (a Cluster, a user without SCAN, a keyspace too
    large to walk)."""
    if isinstance(client, RedisCluster):
        return None
    found: set[str] = set()
    cursor = 0
    try:
        for _ in range(SCAN_CALLS):
            cursor, names = await client.scan(cursor, match="{*}:schema", count=1000)
            found.update(str(name)[1:].rpartition("}:schema")[0] for name in names)
            if not cursor:
                return sorted(found - {""})
    except REDIS_ERRORS:
        return None  # not permitted (a read-only ACL user) or failing: say nothing
    return None
