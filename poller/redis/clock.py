"""The Redis clock: ``TIME``'s reply in milliseconds.

Every reader and writer judges ages on the Redis clock (docs/schema.md), read with
``TIME`` (a ``[seconds, microseconds]`` pair: ints from redis-py, strings from a script
that returns ``redis.call('TIME')``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["server_ms"]


def server_ms(reply: Sequence[Any]) -> int:
    """Unix milliseconds of a ``TIME`` reply (its first two items: seconds, microseconds)."""
    return int(reply[0]) * 1000 + int(reply[1]) // 1000
