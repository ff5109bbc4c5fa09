"""WriteBatcher's hiredis-packed send against redis-py's Pipeline: the same
replies, per-command errors kept per command, and a connection never reused mid-reply."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions as rexc

from poller.store.batch import WriteBatcher

ECHO = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1, #ARGV}"
FAIL = "return redis.error_reply('ERR refused ' .. ARGV[1])"


async def run_batch(batcher: WriteBatcher, client: aioredis.Redis) -> list[Any]:
    echo, fail = client.register_script(ECHO), client.register_script(FAIL)
    await echo(keys=["warm"], args=["x", 0])
    calls = [batcher.call(echo, [f"k{i}"], [f"v{i}", i, "é", b"\x00\xff"]) for i in range(10)] + [
        batcher.call(fail, ["k"], ["me"])
    ]
    return await asyncio.gather(*calls, return_exceptions=True)


@pytest.mark.parametrize("packed", [True, False])
async def test_packed_and_pipeline_agree(real_client: aioredis.Redis, packed: bool) -> None:
    batcher = WriteBatcher(real_client, window_s=0.01)
    assert batcher._packed  # a plain redis-py client takes the packed path
    batcher._packed = packed
    replies = await run_batch(batcher, real_client)
    assert replies[:10] == [[f"k{i}", f"v{i}", i + 1, 4] for i in range(10)]
    assert isinstance(replies[10], rexc.ResponseError) and "refused me" in str(replies[10])


async def test_noscript_in_a_packed_batch_is_reloaded(real_client: aioredis.Redis) -> None:
    batcher = WriteBatcher(real_client, window_s=0.01)
    echo = real_client.register_script(ECHO)
    await echo(keys=["warm"], args=["x", 0])
    await real_client.script_flush()
    replies = await asyncio.gather(*(batcher.call(echo, ["k"], ["v", i]) for i in range(5)))
    assert replies == [["k", "v", i + 1, 2] for i in range(5)]


async def test_cancelled_exchange_does_not_poison_the_pool(
    real_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    batcher = WriteBatcher(real_client, window_s=0.0)
    # The cancel must land while a reply is owed: after the command is on the socket.
    # Redis answers nobody while the script runs (CLIENT LIST included), so the signal is
    # the client's own: the write of the batch has completed.
    sent = asyncio.Event()
    exchange = WriteBatcher._exchange

    async def exchange_signalling(conn: Any, payload: bytes, count: int) -> list[Any]:
        send = conn.send_packed_command

        async def send_then_signal(*args: Any, **kwargs: Any) -> None:
            await send(*args, **kwargs)
            sent.set()

        conn.send_packed_command = send_then_signal
        try:
            return await exchange(conn, payload, count)
        finally:
            del conn.send_packed_command  # the pooled connection gets its own method back

    monkeypatch.setattr(batcher, "_exchange", exchange_signalling)
    slow = real_client.register_script(
        "local i = 0 while i < tonumber(ARGV[1]) do i = i + 1 end return i"
    )
    echo = real_client.register_script(ECHO)
    await echo(keys=["warm"], args=["x", 0])
    await slow(keys=[], args=[1])
    # Lua for ~0.1 s idle (2 s measured at load 15 on 2 cores): long enough to cancel while
    # the reply is owed, short enough to stay under Redis's 5 s busy limit when loaded.
    task = asyncio.ensure_future(batcher._send_packed([(slow, [], [5_000_000], asyncio.Future())]))
    await asyncio.wait_for(sent.wait(), 30)
    # This runs before the task can read a reply: the reply is still owed when it is cancelled.
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Past lua-time-limit (5 s: a loaded machine) Redis answers BUSY to every client until
    # the script ends: end it as an operator would (NOTBUSY when it already finished).
    with contextlib.suppress(rexc.ResponseError):
        await real_client.script_kill()
    # The reply of the cancelled command must not be read as the next command's reply.
    for i in range(3):
        assert await batcher.call(echo, ["k"], ["v", i]) == ["k", "v", i + 1, 2]


def test_other_clients_use_the_pipeline(fake_client: aioredis.Redis) -> None:
    assert not WriteBatcher(fake_client)._packed
