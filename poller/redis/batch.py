"""Fenced writes that arrive within a few milliseconds, sent as one pipeline."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.exceptions as rexc

__all__ = ["WriteBatcher"]


class WriteBatcher:
    """Sends the fenced writes that arrive within ``window_s`` as one pipeline.

    A lone command costs redis-py ~0.2 ms of CPU, mostly the send/recv system calls; in
    a pipeline it is ~0.03 ms (PERFORMANCE.md). Scrapes finish at random moments, so
    waiting a few milliseconds gathers several writes per round trip at a few hundred
    endpoints per second, at no cost to the data (a write is late by at most the window).
    EVALSHA is sent directly, not through redis-py's pipeline script support, which would
    add a SCRIPT EXISTS round trip per batch; a NOSCRIPT reply is retried one by one
    through ``Script``, which loads the script.
    """

    def __init__(self, client: Any, window_s: float = 0.005, max_batch: int = 256) -> None:
        self.client = client
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, future))
        if len(self._pending) >= self.max_batch:
            self._start_flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._start_flush)
        return await future

    def _start_flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._flush(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(
        self, batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]]
    ) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for script, keys, args, _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the connection failed: every caller sees it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (script, keys, args, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, rexc.NoScriptError):
                try:
                    reply = await script(keys=keys, args=args)
                except Exception as exc:
                    future.set_exception(exc)
                    continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)
