"""The prefix placements on the exchange's calls: what goes out, what comes back.

Where the placements are shared (``RoutingOptions.share_placements``, the default),
every call of poller/schema/scripts/share.lua that the exchange makes carries this
replica's new placements (``Placements.take_outbox``) and reads back the other replicas'
entries since the last one read: no command more. A refusal of the call is the stream's
rights or the hash's; the next call, made without the stream, tells which (``answered``,
``failed``). The pages the exchange takes in give the table each engine's prefix-cache
counters and KV capacity (``take_page``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from poller.reader.exchange.wire import READ_COUNT, REFUSED_RETRY_S, STREAM_MAXLEN
from poller.reader.prefix.placements import Placements

__all__ = ["Carrier"]

log = logging.getLogger(__name__)


class Carrier:
    """One ``Placements`` carried on one exchange's calls to ``key`` (the stream)."""

    def __init__(
        self, placements: Placements, key: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.placements = placements
        self.key = key
        self.clock = clock
        placements.sharing = True
        self._body: str | None = None  # the placements the call in flight writes
        self._refused = False  # said
        self._suspect = False  # refused with the stream: whose rights?
        self._retry_at = 0.0

    def take_page(self, endpoint_id: str, view: Any) -> None:
        """The endpoint's page: its prefix-cache counters (going back voids its
        placements) and its KV capacity (the others' placements there are judged by it
        too, not only this replica's)."""
        stats = getattr(view, "stats", None)
        if stats is not None:
            placements = self.placements
            placements.observe(
                endpoint_id,
                stats.prefix_cache_queries_total,
                stats.prefix_cache_hits_total,
                stats.scraped_at_ms,
            )
            placements.capacity(endpoint_id, stats.kv_capacity_tokens)

    def add_to(self, keys: list[str], args: list[Any], now: float) -> None:
        """The stream's key and the placement arguments, added to the share script's
        call about to go; none while refused lately (tried again ``REFUSED_RETRY_S``
        after)."""
        self._body = None
        if now < self._retry_at:
            return
        placements = self.placements
        self._body = placements.take_outbox()
        keys.append(self.key)
        age_ms = int(placements.age_s * 1000)
        args += [self._body, placements.last_id, STREAM_MAXLEN, age_ms, READ_COUNT]

    def answered(self, reply: Sequence[Any], at: int) -> int:
        """The call answered: the others' entries (``reply[at]``, when the call carried
        the stream) taken in. Returns where the rest of ``reply`` starts."""
        if self._body is not None:
            self._refused = False
            redis_ms = int(reply[0]) * 1000 + int(reply[1]) // 1000  # the script's TIME
            self.placements.take_entries(reply[at], redis_ms)
            return at + 1
        if self._suspect:  # refused with the stream, answered without it
            self._suspect = False
            self._refused_now()
        return at

    def failed(self, refused: bool) -> bool:
        """The call failed (``refused``: Redis said no to a right): what it carried goes
        back to the queue. True when the refusal may be the stream's: the next call goes
        without it, and tells."""
        body, self._body = self._body, None
        if body is not None:
            self.placements.put_back(body)
            if refused:
                self._suspect = True
                self._retry_at = self.clock() + REFUSED_RETRY_S
                return True
        self._suspect = False  # refused without the stream: the hash's rights
        return False

    def _refused_now(self) -> None:
        """The gateway's user lacks the stream's rights: own placements only, said once;
        tried again every ``REFUSED_RETRY_S``."""
        self.placements.exchanged_at = None
        if not self._refused:
            log.warning(
                "prefix placement sharing refused by Redis: this replica uses its own "
                "placements. The gateway's ACL user needs XADD, XTRIM, XRANGE, XREVRANGE "
                "and PEXPIRE on %s: add (~%s +xadd +xtrim +xrange +xrevrange +pexpire) to "
                "its line (deploy/redis/users.acl), or open the router with "
                "RoutingOptions(share_placements=False)",
                self.key,
                self.key,
            )
        self._refused = True
