"""The writer side of the Redis contract: ``RedisStore`` (fenced stats and failure
writes, leases, the registry), membership, write batching and discovery leases.

Pollers and the CLI use it; gateways never do (they read through ``poller.reader``)."""

from __future__ import annotations

from poller.store.store import RedisStore, WriteResult

__all__ = ["RedisStore", "WriteResult"]
