"""What Redis may refuse the gateway's user in the share script, and how it is said.

The user of deploy/redis/users.acl may run the share script's writes on its keys and
publish on its channel through one selector; an ACL file of an older release, or one
written for a read-only gateway, lacks some of it. The exchange (exchange.py) goes on
with what is left: without the channel it reads the totals on each call, without the
keys it routes on this replica's own counts. Each case is said once, with the selector
to add.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from poller.redis.errors import store_error

__all__ = ["SELECTOR_COMMANDS", "refused", "refused_channel", "selector"]

log = logging.getLogger(__name__)

#: The commands the share script runs that the gateway user's root rights (reads of the
#: view) do not give: its selector's (deploy/redis/users.acl).
SELECTOR_COMMANDS = (
    "+hset +hdel +hincrby +hmget +hkeys +zadd +zrem +zrevrange +zcard +pexpire +spublish"
)

#: Redis's refusal of a subscription (7.0; 7.2 and later name the channel instead).
_CHANNELS_REFUSED = "one of the channels used as arguments"


def refused(exc: Exception) -> bool:
    """Redis said no to the share script: the user lacks a right it needs (NOPERM for
    a command, "The user executing the script can't ..." for one inside the script)."""
    return getattr(store_error(exc, "the share script"), "kind", None) == "permission"


def refused_channel(exc: Exception, channel: str) -> bool:
    """A subscription failed with ``exc`` because Redis refused this user ``channel``."""
    text = str(exc)
    return getattr(exc, "kind", None) == "permission" and any(
        mark in text for mark in (_CHANNELS_REFUSED, f"'{channel}' channel")
    )


def selector(keys: Sequence[str], channel: str) -> str:
    """The ACL selector the gateway user needs for the share script (without the
    placements' stream), as deploy/redis/users.acl has it."""
    return f"({' '.join(f'~{k}' for k in keys)} &{channel} {SELECTOR_COMMANDS})"


def say_no_channel(channel: str, keys: Sequence[str]) -> None:
    log.warning(
        "Redis refused the gateway's user the channel %s: the other replicas' counts "
        "are read on each call instead of heard as they change (up to 20 calls/s). "
        "Grant it: add &%s to the user's channels and make its selector of the keys "
        "%s as in deploy/redis/users.acl, then restart the gateway",
        channel,
        channel,
        selector(keys, channel),
    )


def say_refused(exc: Exception, channel: str, keys: Sequence[str]) -> None:
    log.warning(
        "gateway load sharing refused by Redis (%s): this replica routes on its own "
        "requests in flight and the pages. The gateway's ACL user needs the share "
        "script's writes on %s and SPUBLISH on %s: add %s to its line "
        "(deploy/redis/users.acl), or open the router with RoutingOptions(share=False)",
        exc,
        ", ".join(keys),
        channel,
        selector(keys, channel),
    )
