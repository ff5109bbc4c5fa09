"""The virtual-time family's share script (lab/poller_lab/routing/script.py) answers as
poller/schema/scripts/share.lua does on a real redis-server: the same calls, fed the
same ``TIME``, give the same replies, messages and totals."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import redis

from poller.schema.keys import Keys
from poller.schema.lua import lua
from poller_lab.routing.script import ShareScript
from tests.support.redisproc import RedisProcess


def _pairs(items: list[Any]) -> dict[str, str]:
    return {str(items[i]): str(items[i + 1]) for i in range(0, len(items), 2)}


def test_the_family_s_script_answers_as_the_lua_script_does(redis_server: RedisProcess) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys("twin")
    lua_script = client.register_script(lua("share"))
    pubsub = client.pubsub()
    pubsub.ssubscribe(keys.gateways_updates)
    pubsub.get_sharded_message(timeout=5.0)
    twin = ShareScript()
    rng = random.Random(11)
    last: dict[str, object] = {}
    calls = messages = 0
    for step in range(400):
        replica = f"g{rng.randrange(6)}"
        roll = rng.random()
        if roll < 0.45:
            counts = {f"e{rng.randrange(8)}": [rng.randrange(0, 4), 0, 0] for _ in range(3)}
            record = json.dumps(counts, separators=(",", ":"))
        else:
            record = "" if roll < 0.85 else ("-" if roll < 0.95 else ".")
        ttl = rng.choice((30, 800))  # some replicas stop calling within the run
        every = rng.choice((0, 5, 10))
        args = [replica, ttl, record, 1, last.get(replica, ""), every]
        reply = lua_script(keys=keys.share(), args=args)
        now_us = int(reply[0]) * 1_000_000 + int(reply[1])
        expected, message = twin.call(now_us, args)
        assert [int(x) for x in reply[2:7]] == expected[2:7], (step, args)
        assert _pairs(reply[7:]) == _pairs(expected[7:]), (step, args)
        last[replica] = int(reply[3])
        got = pubsub.get_sharded_message(timeout=5.0) if message is not None else None
        if message is not None:
            assert got is not None, (step, "the Lua script published nothing")
            number, at, *pairs = str(got["data"]).split(" ")
            t_number, t_at, *t_pairs = message.split(" ")
            assert (number, at, sorted(pairs)) == (t_number, t_at, sorted(t_pairs)), step
            messages += 1
        calls += 1
        if rng.random() < 0.05:
            time.sleep(0.04)  # past the short TTLs: the next calls take replicas out
    stored = client.hgetall(keys.gateways_load)
    assert {k: int(v) for k, v in stored.items() if k[0].isalnum()} == twin.totals
    assert {k[1:]: v for k, v in stored.items() if k[0] == "@"} == twin.shares
    assert pubsub.get_sharded_message(timeout=0.2) is None  # nothing the twin did not
    assert calls == 400 and messages > 20
    pubsub.close()
    client.close()
