"""One identity per live poller: a second process under a live id is refused (exit 2), a
poller whose id is taken under it stops (exit 1), and status and the page flag an id seen
from two processes. The script, the worker in process, then real `poller run` processes
against a private redis-server and the simulator."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis

from poller._version import __version__
from poller.config import Settings
from poller.errors import IdentityConflict
from poller.reader import StatsReader
from poller.schema.endpoint import Endpoint, endpoint_from_dict
from poller.schema.keys import Keys
from poller.service.web.page import OperatorPage
from poller.service.web.render import Query, render_page
from poller.service.worker import Worker
from poller.store.members import DUPLICATE_MEMORY_MS, Instance, read_members, this_process
from poller.store.store import RedisStore
from poller_lab.sim import Simulator, fleet
from tests.support.paths import DATA
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess

NS = "ident"
KEYS = Keys(NS)
A = Instance("a" * 16, "web-1", 101)
B = Instance("b" * 16, "web-2", 202)
VLLM = (DATA / "vllm-v1-synthetic-61k.txt").read_bytes()
HELD = re.compile(
    r"poller id 'p1' is held by another live process \(host (?P<host>\S+) pid (?P<pid>\d+), "
    r"last heartbeat \d+\.\ds ago\): stop that one, pick another --id, or wait \d+\.\ds if "
    r"it crashed"
)


async def now_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def write_member(client: aioredis.Redis, poller_id: str, instance: Instance) -> None:
    """What redis-cli would write: a live member entry of another process under the id."""
    now = await now_ms(client)
    await client.zadd(KEYS.members, {poller_id: now + 60_000})
    info = {"version": "0.0.9", "member_ttl_ms": 60_000, **instance.record()}
    await client.hset(KEYS.members_info, poller_id, json.dumps(info))


@pytest.fixture
async def redis(real_client: aioredis.Redis) -> aioredis.Redis:
    return real_client


# --- the script --------------------------------------------------------------------------


async def test_a_second_instance_is_refused_with_who_holds_the_id(redis: aioredis.Redis) -> None:
    store = RedisStore(redis, NS)
    assert (await store.heartbeat("p1", 2000, A)).members == ["p1"]
    info_before = await redis.hget(KEYS.members_info, "p1")
    score_before = await redis.zscore(KEYS.members, "p1")
    with pytest.raises(IdentityConflict) as refused:
        await store.heartbeat("p1", 2000, B)
    exc = refused.value
    assert (exc.host, exc.pid, exc.joined) == ("web-1", 101, False)
    assert exc.age_ms is not None and 0 <= exc.age_ms < 2000 and 0 < exc.wait_ms <= 2000
    assert HELD.fullmatch(str(exc)) and "host web-1 pid 101" in str(exc)
    # nothing of the heartbeat written: the holder's entry is as it was
    assert await redis.hget(KEYS.members_info, "p1") == info_before
    assert await redis.zscore(KEYS.members, "p1") == score_before
    # the newcomer is recorded, for status and the page
    record = json.loads(await redis.hget(KEYS.members_duplicates, "p1"))
    assert {k: record[k] for k in ("instance", "host", "pid")} == B.record()
    assert record["expires_ms"] - record["at_ms"] == DUPLICATE_MEMORY_MS
    _, [member] = await read_members(redis, KEYS)
    assert member.info["instance"] == A.token and member.duplicate == record
    assert member.to_dict()["duplicate"] == record and member.to_dict()["host"] == "web-1"
    # the holder heartbeats on
    assert (await store.heartbeat("p1", 2000, A)).members == ["p1"]


async def test_two_claims_at_once_never_both_pass(redis_server: RedisProcess) -> None:
    """Two processes started in the same millisecond: the check and the claim are one
    script, so exactly one of them gets the id, every time."""
    clients = [aioredis.Redis(port=redis_server.port, decode_responses=True) for _ in range(2)]
    try:
        stores = [RedisStore(c, NS) for c in clients]
        for _ in range(20):
            await clients[0].flushall()
            outcomes = await asyncio.gather(
                stores[0].heartbeat("p1", 2000, A),
                stores[1].heartbeat("p1", 2000, B),
                return_exceptions=True,
            )
            refused = [o for o in outcomes if isinstance(o, IdentityConflict)]
            assert len(refused) == 1, outcomes
            holder = json.loads(await clients[0].hget(KEYS.members_info, "p1"))["instance"]
            assert holder == (B if outcomes[0] is refused[0] else A).token
    finally:
        for c in clients:
            await c.aclose()


async def test_an_expired_holder_is_no_obstacle(redis: aioredis.Redis) -> None:
    """After a crash the old heartbeat expires, and the id is free again."""
    store = RedisStore(redis, NS)
    await store.heartbeat("p1", 2000, A)
    await redis.zadd(KEYS.members, {"p1": await now_ms(redis) - 1})  # its TTL has passed
    assert (await store.heartbeat("p1", 2000, B)).members == ["p1"]
    info = json.loads(await redis.hget(KEYS.members_info, "p1"))
    assert info["instance"] == B.token and info["pid"] == 202
    assert await redis.hget(KEYS.members_duplicates, "p1") is None


async def test_an_entry_without_an_instance_is_another_process(redis: aioredis.Redis) -> None:
    """A live entry that names no instance (an older poller, or a hand-written one) holds
    the id as much as any other process."""
    store = RedisStore(redis, NS)
    await redis.zadd(KEYS.members, {"p1": await now_ms(redis) + 60_000})
    with pytest.raises(IdentityConflict, match=r"host and pid not recorded, last heartbeat un"):
        await store.heartbeat("p1", 2000, A)
    await redis.hset(KEYS.members_info, "p1", "not json")
    with pytest.raises(IdentityConflict):
        await store.heartbeat("p1", 2000, A)


async def test_duplicate_records_expire_and_go_with_their_member(redis: aioredis.Redis) -> None:
    store = RedisStore(redis, NS)
    await store.heartbeat("p1", 2000, A)
    with pytest.raises(IdentityConflict):
        await store.heartbeat("p1", 2000, B)
    past = await now_ms(redis) - 1
    await redis.hset(KEYS.members_duplicates, "p1", json.dumps({**B.record(), "expires_ms": past}))
    _, [member] = await read_members(redis, KEYS)
    assert member.duplicate is None  # past its expiry: not shown
    await store.heartbeat("p1", 2000, A)
    assert await redis.hget(KEYS.members_duplicates, "p1") is None  # and pruned
    with pytest.raises(IdentityConflict):
        await store.heartbeat("p1", 2000, B)
    await store.leave("p1")
    assert await redis.hget(KEYS.members_duplicates, "p1") is None


# --- the worker, in process --------------------------------------------------------------


def engine(_: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=VLLM)


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    store = RedisStore(client, NS)
    await store.ensure_schema()
    for endpoint_id in ("e1", "e2"):
        await store.put_endpoint(Endpoint(id=endpoint_id, url=f"http://{endpoint_id}.test"))
    w = Worker(Settings(id="p1"), store, transport_factory=transport)
    yield w
    if not w._stopping.is_set():
        await w.stop()


def transport(_: str) -> httpx.MockTransport:
    return httpx.MockTransport(engine)


async def fatal(worker: Worker) -> None:
    """Wait until the worker has stopped itself (``serve`` would exit then)."""
    await until(lambda: worker.fatal is not None, 30, "the worker stopping itself")


async def test_a_worker_refuses_an_id_another_live_process_holds(worker: Worker) -> None:
    client = worker.store.client
    await write_member(client, "p1", B)
    await client.set(KEYS.lease("e1"), "p1 77", px=60_000)  # the other's, not a leftover
    await worker.start()
    await fatal(worker)
    assert isinstance(worker.fatal, IdentityConflict) and not worker.fatal.joined
    assert worker.exit_status == 2 and not worker.ready
    assert worker.unready_reason().startswith("stopped: poller id 'p1' is held by another live")
    assert "host web-2 pid 202" in str(worker.fatal) and worker.owned == {}
    await worker.stop()
    info = json.loads(await client.hget(KEYS.members_info, "p1"))
    assert info["instance"] == B.token  # left alone
    assert await client.get(KEYS.lease("e1")) == "p1 77"
    assert await client.get(KEYS.lease("e2")) is None  # nothing acquired


async def test_a_worker_whose_id_is_taken_stops_scraping_at_once(
    worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    client = worker.store.client
    await worker.start()
    await until(lambda: set(worker.owned) == {"e1", "e2"}, 30, "both endpoints owned")
    held = {e: await client.get(KEYS.lease(e)) for e in ("e1", "e2")}
    with caplog.at_level("ERROR"):
        await write_member(client, "p1", B)  # another process rewrote our entry
        await fatal(worker)
    assert isinstance(worker.fatal, IdentityConflict) and worker.fatal.joined
    assert worker.owned == {} and worker.coordinator.held == {}
    assert worker.jobs.scheduled_ids() == set()
    assert worker.exit_status == 1 and not worker.ready
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        "poller id 'p1' was taken by another process (host web-2 pid 202): stopped "
        "scraping, exiting; stop one of the two, or give each its own --id"
    ]
    await worker.stop()
    # nothing released or left: the id's membership and leases are the other's business
    info = json.loads(await client.hget(KEYS.members_info, "p1"))
    assert info["instance"] == B.token
    assert {e: await client.get(KEYS.lease(e)) for e in ("e1", "e2")} == held


async def test_the_same_process_heartbeats_on(worker: Worker) -> None:
    """A worker started again in this process (same instance) is not a duplicate."""
    await worker.step()
    again = Worker(Settings(id="p1"), worker.store, transport_factory=transport)
    await again.step()
    assert again.fatal is None and this_process().token in (
        await worker.store.client.hget(KEYS.members_info, "p1")
    )
    await again.jobs.stop()
    await again.scraper.aclose()


# --- status and the page -----------------------------------------------------------------


async def write_duplicate(client: aioredis.Redis) -> None:
    """By hand: p1 held by web-1 pid 101, and web-2 pid 202 seen under it 3 s ago."""
    await client.set(KEYS.schema, "1")
    await write_member(client, "p1", A)
    await write_member(client, "p2", Instance("c" * 16, "web-3", 303))
    now = await now_ms(client)
    record = {**B.record(), "at_ms": now - 3000, "expires_ms": now + 600_000}
    await client.hset(KEYS.members_duplicates, "p1", json.dumps(record))


async def test_status_flags_a_duplicate_written_by_hand(
    redis: aioredis.Redis, redis_server: RedisProcess
) -> None:
    await write_duplicate(redis)
    args = [sys.executable, "-m", "poller", "status", "--redis-url", redis_server.url]
    args += ["--namespace", NS]

    def status(*extra: str) -> str:
        done = subprocess.run(
            [*args, *extra], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    table = status()
    [flagged] = [ln for ln in table.splitlines() if "DUPLICATE" in ln]
    assert flagged.split()[:2] == ["p1", "DUPLICATE"]
    assert not any(ln.split()[:1] == ["p2"] and "DUPLICATE" in ln for ln in table.splitlines())
    [line] = [ln for ln in table.splitlines() if "seen from two processes" in ln]
    assert re.fullmatch(
        r"p1 is seen from two processes: host web-1 pid 101 holds it, host web-2 pid 202 "
        r"heartbeated under it \d+\.\ds ago and was turned away; give each poller its own --id",
        line,
    ), line
    members = {m["id"]: m for m in json.loads(status("--json"))["members"]}
    assert members["p1"]["duplicate"]["host"] == "web-2" and members["p2"]["duplicate"] is None
    assert (members["p1"]["instance"], members["p1"]["host"], members["p1"]["pid"]) == (
        A.token,
        "web-1",
        101,
    )


async def test_the_page_flags_a_duplicate(redis: aioredis.Redis) -> None:
    await write_duplicate(redis)
    # a record of the member's own instance is no duplicate
    await redis.hset(KEYS.members_duplicates, "p2", json.dumps({"instance": "c" * 16}))
    view, fleet_ = await OperatorPage(redis, NS, "p2", 2000).read()
    assert fleet_.duplicates is not None and set(fleet_.duplicates) == {"p1"}  # own: no
    html = render_page(view, fleet_, Query())
    assert re.search(r'class="poller duplicate" data-id="p1">.*?DUPLICATE', html)
    assert 'class="poller self" data-id="p2"' in html
    assert "p1 is seen from two processes: host web-1 pid 101 holds it, host web-2 pid" in html


async def test_hosts_on_the_page_are_escaped(redis: aioredis.Redis) -> None:
    await write_duplicate(redis)
    hostile = {**B.record(), "host": "<script>x</script>"}
    await redis.hset(KEYS.members_duplicates, "p1", json.dumps(hostile))
    view, fleet_ = await OperatorPage(redis, NS, "p2", 2000).read()
    html = render_page(view, fleet_, Query())
    assert "<script>x" not in html and "&lt;script&gt;x&lt;/script&gt;" in html


# --- real processes ----------------------------------------------------------------------


@pytest.fixture
async def sim_env(
    own_redis: RedisProcess,
) -> AsyncIterator[tuple[aioredis.Redis, Simulator]]:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    async with Simulator(fleet(6, engines=("vllm",)), seed=5) as sim:
        entries = {e["id"]: endpoint_from_dict(None, e) for e in sim.registry()}
        await RedisStore(client, NS).replace_registry(entries)
        yield client, sim
    await client.aclose()


async def live_info(client: aioredis.Redis, poller_id: str) -> dict[str, Any] | None:
    now = await now_ms(client)
    if poller_id not in await client.zrangebyscore(KEYS.members, now, "+inf"):
        return None
    text = await client.hget(KEYS.members_info, poller_id)
    return json.loads(text) if text else None


async def all_fresh(client: aioredis.Redis, n: int) -> bool:
    view = await StatsReader(client, NS).snapshot()
    return len(view.endpoints) == n and all(e.state == "fresh" for e in view.endpoints.values())


def error_lines(proc: PollerProc) -> list[str]:
    return [ln for ln in proc.log().splitlines() if "level=ERROR" in ln]


@pytest.mark.slow
async def test_a_second_poller_run_with_a_live_id_is_refused_then_one_starts_after_a_crash(
    own_redis: RedisProcess, sim_env: tuple[aioredis.Redis, Simulator], tmp_path: Path
) -> None:
    client, _ = sim_env
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    (tmp_path / "third").mkdir()
    first = PollerProc("p1", own_redis.url, NS, tmp_path / "first").start()
    second = PollerProc("p1", own_redis.url, NS, tmp_path / "second")
    third = PollerProc("p1", own_redis.url, NS, tmp_path / "third")
    try:
        # start-up on a loaded machine takes seconds: the waits are ample
        await until(lambda: all_fresh(client, 6), 60, "every endpoint fresh")
        info = await live_info(client, "p1")
        assert info is not None and info["pid"] == first.pid and info["host"]
        assert info["host"] == socket.gethostname() and info["version"] == __version__

        second.start()
        assert await asyncio.to_thread(second.wait, 60) == 2
        [line] = error_lines(second)
        message = line.split(" poller=p1 ", 1)[1]
        held = HELD.fullmatch(message)
        assert held is not None, line
        assert (held["host"], int(held["pid"])) == (socket.gethostname(), first.pid)
        assert "acquired" not in second.log() and "Traceback" not in second.log()
        assert first.running() and "lease lost" not in first.log()
        assert (await live_info(client, "p1") or {}).get("pid") == first.pid
        _, [member] = await read_members(client, KEYS)
        assert member.duplicate is not None and member.duplicate["pid"] == second.pid

        first.signal(signal.SIGKILL)
        assert await asyncio.to_thread(first.wait, 30) == -signal.SIGKILL

        # its heartbeat lapses after the member TTL: the event the next start waits for
        async def expired() -> bool:
            return await live_info(client, "p1") is None

        await until(expired, 30, "p1's heartbeat expired")
        third.start()
        await until(lambda: third.get("/readyz")[0] == 200, 60, "the new p1 ready")
        assert (await live_info(client, "p1") or {}).get("pid") == third.pid
        await until(lambda: all_fresh(client, 6), 60, "fresh again under the new p1")
        assert error_lines(third) == []
    finally:
        for proc in (first, second, third):
            proc.cleanup()


@pytest.mark.slow
async def test_a_poller_whose_entry_is_rewritten_stops_with_one_error(
    own_redis: RedisProcess, sim_env: tuple[aioredis.Redis, Simulator], tmp_path: Path
) -> None:
    client, _ = sim_env
    proc = PollerProc("p1", own_redis.url, NS, tmp_path).start()
    try:
        await until(lambda: all_fresh(client, 6), 60, "every endpoint fresh")
        await write_member(client, "p1", Instance("f" * 16, "elsewhere", 4242))
        status = await asyncio.to_thread(proc.wait, 60)
        assert status == 1
        [line] = error_lines(proc)
        assert line.endswith(
            " poller=p1 poller id 'p1' was taken by another process (host elsewhere pid "
            "4242): stopped scraping, exiting; stop one of the two, or give each its own --id"
        ), line
        assert "left the members" not in proc.log() and "Traceback" not in proc.log()
        # the entry is the other's still: not removed by a leave
        assert (await live_info(client, "p1") or {}).get("pid") == 4242
    finally:
        proc.cleanup()
