"""Following the registry in Redis, and keeping it equal to ``--endpoints-file``.

The registry is read again only when its revision moved (or Redis lost its data: a new
epoch), so a pass costs one GET in steady state.
"""

from __future__ import annotations

import logging
import os

from poller.config import Settings
from poller.config.registry_file import endpoints_from_file
from poller.errors import ConfigError
from poller.schema.endpoint import Endpoint, validate_endpoint_id
from poller.store.store import RedisStore

__all__ = ["RegistryFollower"]

log = logging.getLogger(__name__)


class RegistryFollower:
    """The registry as last read: usable entries, and invalid ones with their error."""

    def __init__(self, settings: Settings, store: RedisStore) -> None:
        self.settings = settings
        self.store = store
        self.rev = -1
        self.entries: dict[str, Endpoint] = {}
        #: Entries that failed validation: they still get a lease and a config failure.
        self.invalid: dict[str, str] = {}
        #: Entries in the registry, whatever they are (``external`` ones included).
        self.size = 0
        self._unusable: set[str] = set()
        self._file_mtime: float | None = None

    def ids(self) -> list[str]:
        """Every id that gets a lease: usable entries and invalid ones."""
        return [*self.entries, *self.invalid]

    def forget(self) -> None:
        """Redis lost everything (an empty restart): its registry revision may repeat
        an old number, so read the registry and the file again."""
        self.rev = -1
        self._file_mtime = None

    async def sync(self) -> bool:
        """Apply the file if it changed, then re-read the registry if its revision moved.
        Returns True when the registry was re-read."""
        await self._sync_file()
        rev = await self.store.registry_rev()
        if rev == self.rev:
            return False
        registry = await self.store.read_registry()
        entries = {e: ep for e, ep in registry.endpoints.items() if (ep.engine or "") != "external"}
        invalid: dict[str, str] = {}
        for endpoint_id, error in registry.invalid.items():
            try:
                validate_endpoint_id(endpoint_id)
            except ConfigError:
                # An id that breaks keys, events or log lines cannot carry a failure
                # record: it is left alone (and shown by `poller endpoints ls`).
                if endpoint_id not in self._unusable:
                    self._unusable.add(endpoint_id)
                    log.error(
                        "registry id unusable; ignoring it", extra={"endpoint": endpoint_id[:100]}
                    )
                continue
            invalid[endpoint_id] = error
        self.rev, self.entries, self.invalid = registry.rev, entries, invalid
        self.size = len(registry.raw)
        if self.settings.endpoints_file and not registry.raw:
            self._file_mtime = None  # registry emptied (a Redis restart): sync again now
        return True

    async def _sync_file(self) -> None:
        path = self.settings.endpoints_file
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime
        except OSError as exc:
            log.warning("endpoints file unreadable", extra={"file": path, "why": exc.strerror})
            return
        if mtime == self._file_mtime:
            return
        try:
            wanted = endpoints_from_file(path)
        except ConfigError as exc:
            # one problem per line in the message: one log field, problems joined
            why = "; ".join(str(exc).splitlines())
            log.error("endpoints file not applied", extra={"file": path, "why": why})
            self._file_mtime = mtime  # do not retry until it changes
            return
        rev, added, changed, removed = await self.store.replace_registry(wanted)
        self._file_mtime = mtime
        if added or changed or removed:
            log.info(
                "registry synced from the endpoints file",
                extra={
                    "file": path,
                    "rev": rev,
                    "added": len(added),
                    "changed": len(changed),
                    "removed": len(removed),
                },
            )
