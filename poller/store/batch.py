"""Fenced writes that arrive within a few milliseconds, sent as one pipeline."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from hiredis import pack_command as _pack  # a dependency (redis[hiredis])

__all__ = ["WriteBatcher"]

_EVALSHA = b"EVALSHA"


class WriteBatcher:
    """Sends the fenced writes that arrive within ``window_s`` as one pipeline.

    A lone command costs redis-py ~0.2 ms of CPU, mostly the send/recv system calls; in
    a pipeline it is ~0.03 ms (tests/bench/bench_batch.py measures it). Scrapes finish at
    random moments, so waiting a few milliseconds gathers several writes per round trip at
    a few hundred endpoints per second, at no cost to the data (a write is late by at most
    the window).
    EVALSHA is sent directly, not through redis-py's pipeline script support, which would
    add a SCRIPT EXISTS round trip per batch; a NOSCRIPT reply is retried one by one
    through ``Script``, which loads the script.
    """

    def __init__(self, client: Any, window_s: float = 0.005, max_batch: int = 256) -> None:
        self.client = client
        # On a plain redis-py client the batch is packed by hiredis (C) and sent on one
        # pooled connection; redis-py's Pipeline packs each argument in Python (~5% of a
        # scrape's CPU at 300 endpoints). Any other client (a fake one in tests, a
        # subclass) goes through the Pipeline.
        self._packed = type(client) is aioredis.Redis
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
            if self._packed:
                replies = await self._send_packed(batch)
            else:
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

    async def _send_packed(
        self, batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]]
    ) -> list[Any]:
        """Every EVALSHA of the batch in one write; one reply (or ResponseError) each."""
        payload = b"".join(
            [
                _pack((_EVALSHA, script.sha, len(keys), *keys, *args))
                for script, keys, args, _ in batch
            ]
        )
        pool = self.client.connection_pool
        conn = await pool.get_connection()
        try:
            # The client's retry policy, as redis-py's Pipeline applies it: a dropped
            # connection is reconnected and the batch sent again.
            replies: list[Any] = await conn.retry.call_with_retry(
                lambda: self._exchange(conn, payload, len(batch)),
                lambda _error: conn.disconnect(),
            )
        except BaseException:
            # A failed or cancelled exchange leaves replies unread: never reuse the socket.
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
        return replies

    @staticmethod
    async def _exchange(conn: Any, payload: bytes, count: int) -> list[Any]:
        await conn.send_packed_command(payload)
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(await conn.read_response())
            except rexc.ResponseError as exc:  # this command's error, not the link's
                replies.append(exc)
        return replies
