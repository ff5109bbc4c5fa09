"""The reader's own subscription to P:updates (poller/reader/view/feed.py): messages in order
and in batches, a lost connection and a refused subscription as StoreError, and the
fallback to redis-py's PubSub for clients whose connections it cannot copy.

Cached readers over TLS, ACL users, Sentinel and Cluster are tested with the readers
(tests/store/test_tls.py, tests/deploy/test_redis_acl.py, tests/store/test_sentinel.py,
tests/store/test_cluster.py)."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from poller.errors import StoreError
from poller.reader.view.feed import open_feed
from tests.support.redisproc import RedisProcess

CHANNEL = "{t}:updates"
# Connecting should succeed (or fail at once: refused, wrong password): generous, so a
# loaded machine never turns a success into a timeout.
CONNECT_S = 10.0


async def test_messages_arrive_in_order_and_in_batches(own_redis: RedisProcess) -> None:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    feed = await open_feed(client, CHANNEL, CONNECT_S)
    assert feed is not None
    try:
        sent = [f"stats e{i} {i} record-{i}" for i in range(200)]
        pipe = client.pipeline(transaction=False)
        for message in sent:
            pipe.execute_command("SPUBLISH", CHANNEL, message)
        await pipe.execute()
        got: list[str] = []
        calls = 0
        while len(got) < len(sent) and calls < 200:
            got += await feed.next(1.0)
            calls += 1
        assert got == sent
        assert calls < len(sent)  # several messages per wake-up, not one call each
        assert await feed.next(0.05) == []  # quiet: the timeout, no error
    finally:
        feed.close()
        await client.aclose()


async def test_a_second_channel_goes_to_its_callable_as_it_arrives(
    own_redis: RedisProcess,
) -> None:
    """The gateways' channel rides on the same subscription: its messages go to their
    callable in the order sent, the update channel's to ``next()`` as before."""
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    heard: list[str] = []
    feed = await open_feed(client, CHANNEL, CONNECT_S, {"{t}:gateways:updates": heard.append})
    assert feed is not None
    try:
        for i in range(50):
            await client.execute_command("SPUBLISH", "{t}:gateways:updates", f"{i} - g{i}")
            await client.execute_command("SPUBLISH", CHANNEL, f"stats e{i} {i} record-{i}")
        got: list[str] = []
        deadline = time.monotonic() + 30  # only ends a hang
        while len(got) < 50 and time.monotonic() < deadline:
            got += await feed.next(1.0)
        assert got == [f"stats e{i} {i} record-{i}" for i in range(50)]
        assert heard == [f"{i} - g{i}" for i in range(50)]
    finally:
        feed.close()
        await client.aclose()


async def test_a_lost_connection_is_a_store_error(own_redis: RedisProcess) -> None:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    feed = await open_feed(client, CHANNEL, CONNECT_S)
    assert feed is not None
    own_redis.stop()
    # Wait for the feed to notice the closed socket (an event, not a deadline); each
    # call returns [] when its timeout passes first. The bound only ends a hang.
    deadline = time.monotonic() + 30
    with pytest.raises(StoreError, match="closed the update subscription"):
        while time.monotonic() < deadline:
            await feed.next(1.0)
    await client.aclose()


async def test_a_refused_subscription_is_a_store_error(own_redis: RedisProcess) -> None:
    admin = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    await admin.config_set("requirepass", "right")
    wrong = aioredis.Redis.from_url(own_redis.url, password="wrong", decode_responses=True)
    with pytest.raises(StoreError, match="refused"):
        await open_feed(wrong, CHANNEL, CONNECT_S)
    right = aioredis.Redis.from_url(own_redis.url, password="right", decode_responses=True)
    feed = await open_feed(right, CHANNEL, CONNECT_S)
    assert feed is not None
    feed.close()
    for c in (wrong, right):
        await c.aclose()
    await admin.aclose()


async def test_an_unreachable_redis_is_a_store_error() -> None:
    client = aioredis.Redis(host="127.0.0.1", port=1)
    with pytest.raises(StoreError, match="unreachable"):
        await open_feed(client, CHANNEL, CONNECT_S)


async def test_a_unix_socket_client_falls_back_to_pubsub() -> None:
    client = aioredis.Redis(unix_socket_path="/nonexistent/redis.sock")
    assert await open_feed(client, CHANNEL, CONNECT_S) is None  # never connected either
