"""The registry in Redis (``P:endpoints``, its revision and events): reads, and writes
that compare-and-set on the revision so several writers converge instead of interleaving.

``RedisStore`` holds one ``RegistryStore`` and hands it the store's call wrapper, so
every registry call goes through the store's one ``_call``; callers use the
``RedisStore`` methods that delegate to it (``read_registry``, ``put_endpoint``, ...).
``Registry`` is the registry at one revision, as read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from poller.errors import StoreError
from poller.schema.endpoint import (
    Endpoint,
    endpoint_from_json,
    url_conflicts,
    validate_endpoint_id,
)
from poller.schema.keys import Keys
from poller.schema.lua import lua

__all__ = [
    "Call",
    "EntryExists",
    "Registry",
    "RegistryStore",
    "UrlTaken",
    "diff_registry",
    "sync_diff",
]

T = TypeVar("T")


class Call(Protocol):
    """How a Redis call is made: awaited, its errors mapped (``RedisStore._call``)."""

    def __call__(self, awaitable: Awaitable[T], what: str, /) -> Awaitable[T]: ...


class EntryExists(StoreError):
    """``put_endpoint(replace=False)`` of an id the registry already has."""

    def __init__(self, endpoint_id: str) -> None:
        self.endpoint_id = endpoint_id
        super().__init__(f"endpoint {endpoint_id!r} already exists")


class UrlTaken(StoreError):
    """An entry whose normalised URL (``normalize_url``) another entry already has: one
    line per such entry, each naming both ids and the URL."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


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


class RegistryStore:
    """The registry's reads and writes over ``client``, each made through ``call``."""

    def __init__(self, client: Any, keys: Keys, call: Call) -> None:
        self.client = client
        self.keys = keys
        self._call = call
        self._registry = client.register_script(lua("registry"))
        self._read_registry = client.register_script(lua("read_registry"))

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
            self.keys.updates,
        ]
        for e in remove:
            keys += [self.keys.stats(e), self.keys.failure(e), self.keys.lease(e)]
        args: list[str | int] = ["" if expected_rev is None else str(expected_rev), len(remove)]
        args += list(remove)
        for e, value in put.items():
            args += [e, value]
        return int(await self._call(self._registry(keys=keys, args=args), "update registry"))

    async def update_registry(
        self, expected_rev: int, remove: Sequence[str], put: Mapping[str, str]
    ) -> int:
        """Remove and put entries (id -> JSON) if the registry is still at
        ``expected_rev``; returns the new revision, or -1 when it moved (re-read, retry)."""
        return await self._apply_registry(expected_rev, remove, put)

    async def put_endpoint(
        self, endpoint: Endpoint, *, replace: bool = True, unique_url: bool = False
    ) -> int:
        """Add or update one entry; returns the new revision.

        With ``replace=False`` an existing id is ``EntryExists`` (``endpoints add``). With
        ``unique_url`` an entry whose normalised URL another entry has is ``UrlTaken``,
        checked against the registry the entry is written to (compare-and-set on its
        revision)."""
        if not unique_url:
            if not replace:
                exists = await self._call(
                    self.client.hexists(self.keys.endpoints, endpoint.id), "HEXISTS"
                )
                if exists:
                    raise EntryExists(endpoint.id)
            return await self._apply_registry(None, (), {endpoint.id: endpoint.to_json()})
        for _ in range(20):
            current = await self.read_registry()
            if not replace and endpoint.id in current.raw:
                raise EntryExists(endpoint.id)
            others = [(e.id, e.url) for e in current.endpoints.values() if e.id != endpoint.id]
            taken = url_conflicts([(endpoint.id, endpoint.url)], others)
            if taken:
                raise UrlTaken(taken)
            rev = await self._apply_registry(current.rev, (), {endpoint.id: endpoint.to_json()})
            if rev >= 0:
                return rev
        raise StoreError("registry kept changing under us; gave up adding the entry")

    async def remove_endpoint(self, endpoint_id: str) -> int | None:
        """Remove an entry with its stats, failure and lease; None if it did not exist."""
        validate_endpoint_id(endpoint_id)
        exists = await self._call(self.client.hexists(self.keys.endpoints, endpoint_id), "HEXISTS")
        if not exists:
            return None
        return await self._apply_registry(None, [endpoint_id], {})

    async def replace_registry(
        self, endpoints: Mapping[str, Endpoint], *, attempts: int = 20, unique_url: bool = False
    ) -> tuple[int, list[str], list[str], list[str]]:
        """Make the registry exactly ``endpoints``, atomically.

        Returns (rev, added, changed, removed). Writes nothing, and bumps no revision, when
        the registry already matches: several pollers syncing one file converge quietly.
        With ``unique_url``, ``UrlTaken`` when two entries of the result (``endpoints`` and
        the discovered entries a sync keeps) would share a normalised URL.
        """
        wanted = {e.id: e.to_json() for e in endpoints.values()}
        for _ in range(attempts):
            current = await self.read_registry()
            added, changed, removed = sync_diff(current, wanted)
            kept = [
                (e.id, e.url)
                for e in current.endpoints.values()
                if e.id not in wanted and e.id not in removed
            ]
            taken = (
                url_conflicts([(e.id, e.url) for e in endpoints.values()], kept)
                if unique_url
                else []
            )
            if taken:
                raise UrlTaken(taken)
            if not (added or changed or removed):
                return current.rev, [], [], []
            put = {e: wanted[e] for e in [*added, *changed]}
            rev = await self._apply_registry(current.rev, removed, put)
            if rev >= 0:
                return rev, added, changed, removed
        raise StoreError("registry kept changing under us; gave up replacing it")


def sync_diff(
    current: Registry, wanted: Mapping[str, str]
) -> tuple[list[str], list[str], list[str]]:
    """(added, changed, removed) for making the registry ``wanted`` (id -> JSON).

    Discovered entries belong to their source (poller/service/discovery/runner.py): a sync
    neither removes nor counts them, unless ``wanted`` names their id."""
    discovered = {e for e, v in current.endpoints.items() if v.source}
    managed = {e: v for e, v in current.raw.items() if e in wanted or e not in discovered}
    return diff_registry(managed, wanted)


def diff_registry(
    current: Mapping[str, str], wanted: Mapping[str, str]
) -> tuple[list[str], list[str], list[str]]:
    """(added, changed, removed) ids between two raw registries (id -> JSON)."""
    added = sorted(set(wanted) - set(current))
    removed = sorted(set(current) - set(wanted))
    changed = sorted(e for e in set(wanted) & set(current) if wanted[e] != current[e])
    return added, changed, removed
