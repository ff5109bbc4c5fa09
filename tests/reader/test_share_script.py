"""The share script (poller/schema/scripts/share.lua) on a real redis-server: the totals
kept by difference, a replica that stops taken out, a replica that leaves, the changes
published in one message per window, a new run of numbers read whole, and records no
replica of ours writes skipped. The replies are read as the exchange reads them."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from poller.schema.keys import Keys
from poller.schema.lua import lua
from tests.support.redisproc import RedisProcess


class Share:
    """The script as one namespace's replicas call it, and what it published."""

    def __init__(self, server: RedisProcess, ns: str) -> None:
        self.client = redis.Redis.from_url(server.url, decode_responses=True)
        self.keys = Keys(ns)
        self.script = self.client.register_script(lua("share"))
        self.pubsub = self.client.pubsub()
        self.pubsub.ssubscribe(self.keys.gateways_updates)
        self.pubsub.get_sharded_message(timeout=5.0)  # the subscription's confirmation

    def call(
        self, replica: str, record: str = "", last: object = "", *, ttl: int = 800, every: int = 0
    ) -> dict[str, Any]:
        reply = self.script(keys=self.keys.share(), args=[replica, ttl, record, 1, last, every])
        pairs = reply[7:]
        return {
            "others": reply[2],
            "number": reply[3],
            "again": reply[4],
            "full": reply[5],
            "held": reply[6],
            "totals": {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)},
        }

    def totals(self) -> dict[str, int]:
        stored = self.client.hgetall(self.keys.gateways_load)
        return {k: int(v) for k, v in stored.items() if k[0].isalnum()}

    def published(self) -> list[tuple[int, dict[str, int]]]:
        """The messages published since the last look: (number, totals)."""
        out = []
        while (message := self.pubsub.get_sharded_message(timeout=0.2)) is not None:
            number, _, *pairs = str(message["data"]).split(" ")
            out.append((int(number), {p.split(":")[0]: int(p.split(":")[1]) for p in pairs}))
        return out

    def close(self) -> None:
        self.pubsub.close()
        self.client.close()


def record(**counts: int) -> str:
    return json.dumps({e: [n, 0, 0] for e, n in counts.items()}, separators=(",", ":"))


def test_the_totals_move_by_each_replicas_difference_and_read_what_moved(
    redis_server: RedisProcess,
) -> None:
    share = Share(redis_server, "sum")
    first = share.call("g1", record(a=2, b=1))
    assert first["full"] == 1 and first["totals"] == {"a": 2, "b": 1}
    assert first["others"] == 0 and first["held"] == 0
    second = share.call("g2", record(a=3), "")
    assert second["others"] == 1 and second["totals"] == {"a": 5, "b": 1}
    n = second["number"]
    assert n == first["number"] + 1
    third = share.call("g1", record(a=1, c=4), first["number"])
    # g1 read at its first number: "a" moved since (g2's and its own), "b" and "c" too.
    assert third["full"] == 0 and third["totals"] == {"a": 4, "b": 0, "c": 4}
    assert share.call("g2", "", n)["totals"] == {"a": 4, "b": 0, "c": 4}
    assert share.call("g2", "", third["number"])["totals"] == {}  # nothing moved since
    assert share.totals() == {"a": 4, "c": 4}  # an endpoint at 0 has no field
    share.call("g1", "-", third["number"])  # nothing in flight
    assert share.totals() == {"a": 3}
    share.close()


def test_a_replica_that_stops_calling_leaves_the_totals_and_writes_again_if_it_returns(
    redis_server: RedisProcess,
) -> None:
    share = Share(redis_server, "gone")
    share.call("g1", record(a=2), ttl=50)
    share.call("g2", record(a=1))
    time.sleep(0.1)  # g1's 50 ms are up: the next call of anyone takes it out
    reply = share.call("g2")
    assert reply["others"] == 0 and share.totals() == {"a": 1}
    assert not share.client.hexists(share.keys.gateways_inflight, "g1")
    back = share.call("g1")  # its record unchanged, as far as it knows: it is told
    assert back["again"] == 1 and share.totals() == {"a": 1}
    share.call("g1", record(a=2))
    assert share.totals() == {"a": 3} and share.call("g2")["again"] == 0
    share.close()


def test_a_replica_that_leaves_is_gone_at_once(redis_server: RedisProcess) -> None:
    share = Share(redis_server, "leave")
    share.call("g1", record(a=2))
    share.call("g2", record(a=1))
    left = share.call("g1", ".")
    assert left["others"] == 1 and share.totals() == {"a": 1}
    assert share.call("g2")["others"] == 0
    share.close()


def test_the_changes_of_a_window_go_out_in_one_message_with_the_next_call_after_it(
    redis_server: RedisProcess,
) -> None:
    share = Share(redis_server, "window")
    a = share.call("g1", record(a=1), every=60_000)
    assert a["held"] == 0 and share.published() == [(a["number"], {"a": 1})]
    b = share.call("g2", record(a=2, b=1), every=60_000)  # within the window: held
    c = share.call("g1", record(b=5), every=60_000)
    assert b["held"] == c["held"] == 1 and share.published() == []
    assert share.call("g2", "", every=60_000)["held"] == 0  # nothing of its own moved
    flushed = share.call("g3", "", every=0)  # the window is up: everything since the last
    assert flushed["held"] == 0
    assert share.published() == [(c["number"], {"a": 2, "b": 6})]
    share.close()


def test_keys_lost_start_a_new_run_read_whole(redis_server: RedisProcess) -> None:
    share = Share(redis_server, "lost")
    first = share.call("g1", record(a=2))
    share.client.delete(*share.keys.share())  # a Redis that restarted without them
    share.call("g2", record(b=1))
    again = share.call("g1", "", first["number"])
    assert again["full"] == 1 and again["totals"] == {"b": 1}  # g1's "a" went with it
    assert again["again"] == 1 and again["number"] > first["number"]
    share.close()


def test_what_no_replica_of_ours_writes_is_skipped(redis_server: RedisProcess) -> None:
    """Records that are not JSON, nested past cjson's depth, with endpoint ids that are
    not ids (spaces would break the message), counts out of range; the in-flight hash
    edited by another hand (a replica of the release before prunes it): the totals
    stay what the replicas' records add up to."""
    share = Share(redis_server, "foreign")
    deep = '{"a":' + "[" * 5000 + "]" * 5000 + "}"
    bad = ['{"a":', deep, '{"a b":[1,0,0]}', '{"a":[1e999,0,0]}', '{"a":[-3,0,0]}', '{"a":"x"}']
    for i, text in enumerate(bad):
        reply = share.call(f"odd-{i}", text)
        assert reply["totals"] == {}, text
    share.call("g1", '{"a":[2.7,0,0],"b c":[1,0,0],"d":[1,0,0]}')
    assert share.totals() == {"a": 2, "d": 1}
    share.client.delete(share.keys.gateways_inflight)
    share.call("g1", record(a=1))
    assert share.totals() == {"a": 1}
    share.close()
