"""Every key of Redis schema v1 (docs/schema.md): the one home for key names.

Keys share the hash tag ``{<namespace>}`` so multi-key scripts run on Redis Cluster. The
reader imports this module and nothing else of the writer side.
"""

from __future__ import annotations

__all__ = ["SCHEMA_VERSION", "Keys"]

SCHEMA_VERSION = "1"


class Keys:
    """Every key of schema v1 under the prefix ``{namespace}``."""

    def __init__(self, namespace: str = "llmgw") -> None:
        self.namespace = namespace
        self.prefix = "{" + namespace + "}"
        self.schema = f"{self.prefix}:schema"
        self.endpoints = f"{self.prefix}:endpoints"
        self.endpoints_rev = f"{self.prefix}:endpoints:rev"
        self.members = f"{self.prefix}:members"
        # poller id -> JSON {version, member_ttl_ms, instance, host, pid}: what the
        # heartbeat alone cannot say, and which process holds the id.
        self.members_info = f"{self.prefix}:members:info"
        # poller id -> JSON {since_ms, by}: drain requests (CLI or SIGUSR1). A draining
        # member keeps its membership but rendezvous gives it nothing (docs/schema.md).
        self.members_drain = f"{self.prefix}:members:drain"
        # poller id -> JSON {instance, host, pid, at_ms, expires_ms}: the latest other
        # process that heartbeated under a live member's id and was turned away.
        self.members_duplicates = f"{self.prefix}:members:duplicates"
        self.fence = f"{self.prefix}:fence"
        self.events = f"{self.prefix}:events"
        # A shard channel (SSUBSCRIBE) carrying what events carries, plus each stats and
        # failure record, so cached readers never read back (docs/schema.md). The write
        # scripts derive it from the events key: keep the two names in step.
        self.updates = f"{self.prefix}:updates"
        self.epoch = f"{self.prefix}:epoch"
        # The whole view in two hashes, for snapshots in one cheap read (docs/schema.md).
        self.view_stats = f"{self.prefix}:view:stats"
        self.view_failures = f"{self.prefix}:view:failures"
        # Discovery: source name -> JSON status (owner, last resolution, targets, failure).
        self.discovery = f"{self.prefix}:discovery"
        # Gateway replica id -> "<expiry ms> <JSON>": each replica's requests in flight per
        # endpoint, written and read by the gateways (poller/reader/load/fleet.py), pruned by
        # the share script at its expiry (docs/schema.md).
        self.gateways_inflight = f"{self.prefix}:gateways:inflight"
        # A shard channel carrying each change of the gateways' totals as it happens
        # ("<number> <Redis ms> <replica id> <endpoint>:<difference> ..."), so every
        # replica hears the others' changes at once instead of at its next read.
        self.gateways_updates = f"{self.prefix}:gateways:updates"
        # The gateways' requests in flight per endpoint, every live replica's summed
        # (kept by the share script from the records of the hash above), the change
        # number of each endpoint's last change, and each live replica's expiry: a
        # replica reads only the totals that moved since its last read (docs/schema.md).
        self.gateways_load = f"{self.prefix}:gateways:load"
        self.gateways_changed = f"{self.prefix}:gateways:changed"
        self.gateways_alive = f"{self.prefix}:gateways:alive"
        # A stream of the gateways' prefix placements (entries {"@": replica id, "p":
        # "<endpoint> <base64 block ids> ..."}), added and read by the share script,
        # trimmed by length and age (docs/schema.md).
        self.gateways_placements = f"{self.prefix}:gateways:placements"

    def share(self, placements: bool = False) -> list[str]:
        """The share script's keys, in its order (poller/schema/scripts/share.lua)."""
        keys = [
            self.gateways_inflight,
            self.gateways_updates,
            self.gateways_load,
            self.gateways_changed,
            self.gateways_alive,
        ]
        return [*keys, self.gateways_placements] if placements else keys

    def lease(self, endpoint_id: str) -> str:
        return f"{self.prefix}:lease:{endpoint_id}"

    def stats(self, endpoint_id: str) -> str:
        return f"{self.prefix}:stats:{endpoint_id}"

    def failure(self, endpoint_id: str) -> str:
        return f"{self.prefix}:failure:{endpoint_id}"

    def discovery_lease(self, source: str) -> str:
        """The fenced lease of one discovery source: ``<poller> <token>``, PX TTL."""
        return f"{self.prefix}:discovery:{source}"
