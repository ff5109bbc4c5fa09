"""A deliberately naive policy: least in flight per slot, counts shared through Redis.

Each replica counts its own requests in flight per endpoint and, every ``PERIOD_S``,
writes them as its field of one Redis hash and reads the others' fields back; a request
goes to the endpoint with the least (own in flight + the others' last read) / running
slots, ties at random. No page and no model of the engines: the yardstick of what
sharing counts alone buys, against which the picker's use of the view is judged.

Options (``PolicyContext.options``): ``slots`` (endpoint id -> running slots) and ``key``
(the hash, one per cell, so that no replica of an earlier cell is read).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from typing import Any

from poller_lab.routing.policies import PolicyContext, register

__all__ = ["PERIOD_S", "Naive"]

PERIOD_S = 0.1
#: The hash outlives a few missed periods, not the cell.
_TTL_MS = 2000


class Naive:
    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.slots: dict[str, int] = dict(ctx.options["slots"])
        self.key: str = ctx.options["key"]
        self.replica = f"{os.getpid()}-{ctx.rng.getrandbits(32):08x}"
        self.own: Counter[str] = Counter()
        self.others: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    async def warm_up(self) -> None:
        import redis.asyncio as aioredis

        assert self.ctx.redis_url is not None
        client: Any = aioredis.Redis.from_url(self.ctx.redis_url, decode_responses=True)
        await self._exchange(client)
        self._task = asyncio.create_task(self._loop(client))

    async def _loop(self, client: Any) -> None:
        try:
            while True:
                await asyncio.sleep(PERIOD_S)
                await self._exchange(client)
        finally:
            await client.aclose()

    async def _exchange(self, client: Any) -> None:
        pipe = client.pipeline(transaction=False)
        pipe.hset(self.key, self.replica, json.dumps({k: v for k, v in self.own.items() if v}))
        pipe.pexpire(self.key, _TTL_MS)
        pipe.hgetall(self.key)
        *_, fields = await pipe.execute()
        others: Counter[str] = Counter()
        for replica, counts in fields.items():
            if replica != self.replica:
                others.update(json.loads(counts))
        self.others = others

    async def prepare(self) -> None:
        return None

    def choose(self) -> str | None:
        rng = self.ctx.rng
        return min(
            self.ctx.candidates,
            key=lambda e: ((self.own[e] + self.others[e]) / self.slots[e], rng.random()),
        )

    def started(self, endpoint_id: str) -> None:
        self.own[endpoint_id] += 1

    def finished(self, endpoint_id: str, ok: bool = True) -> None:
        self.own[endpoint_id] -= 1


# Not run by the old single-fleet bench unless named: it needs the slots and a key.
register("naive", Naive, default=False)
