"""States an operator must hear about once when they begin (and once when they end),
not once per coordination pass: an empty registry, a drain."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from poller.util.logs import count

__all__ = ["Notices"]

log = logging.getLogger(__name__)

#: What fills an empty registry; said with the state, so the line is its own runbook.
FILL = (
    "`poller endpoints add ID URL`, `poller endpoints sync FILE`, or run the pollers "
    "with --endpoints-file FILE"
)


class Notices:
    def __init__(self, poller_id: str, namespace: str) -> None:
        self.poller_id = poller_id
        self.namespace = namespace
        self._empty: bool | None = None  # None: not known (start, or Redis lost its data)
        self._draining = False

    def forget(self) -> None:
        """Redis lost its data: whatever the registry holds now is news again."""
        self._empty = None

    async def registry(
        self, empty: bool, namespaces: Callable[[], Awaitable[list[str] | None]]
    ) -> None:
        """After each read of the registry: an empty one means we hold nothing. Said with
        the other ``namespaces`` on this Redis (asked only then): a mistyped namespace
        reads as an empty registry."""
        if empty and self._empty is not True:
            others = [n for n in await namespaces() or () if n != self.namespace]
            hint = f"; other namespaces on this Redis: {', '.join(others)} (wrong --namespace?)"
            log.warning(
                "the registry is empty: this poller holds nothing; fill it with %s%s",
                FILL,
                hint if others else "",
            )
        elif not empty and self._empty is True:
            log.info("the registry has entries again")
        self._empty = empty

    def drain(self, draining: bool, held: int) -> None:
        """After each heartbeat: whether a drain of this poller is requested."""
        if draining and not self._draining:
            log.warning(
                "draining: handing over %s and taking no new ones; "
                "`poller drain %s --undo` returns this poller to service",
                count(held, "endpoint"),
                self.poller_id,
            )
        elif self._draining and not draining:
            log.info("back in service: taking endpoints again")
        self._draining = draining
