"""Drain: the request in Redis, rendezvous without draining members, the handover logs,
and the once-per-state notices (empty registry). Workers on one fakeredis server, driven
pass by pass."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis

from poller.config import ScrapeSettings, Settings
from poller.reader import StatsReader
from poller.schema.endpoint import Endpoint, endpoint_from_dict
from poller.schema.keys import Keys
from poller.service.worker import Worker
from poller.store.members import (
    cancel_drain,
    lease_holders,
    leases_of,
    read_members,
    request_drain,
)
from poller.store.store import RedisStore
from poller.util.logs import text_of
from poller_lab.sim import Simulator, fleet
from tests.support.procs import pollers, until
from tests.support.redisproc import RedisProcess

IDS = [f"e{i}" for i in range(12)]


def engines(endpoint: Endpoint) -> httpx.AsyncBaseTransport:
    return httpx.MockTransport(lambda r: httpx.Response(200, text="vllm:num_requests_running 1\n"))


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Worker, Worker]]:
    server = fakeredis.FakeServer()
    workers = []
    for poller_id in ("p1", "p2"):
        client = fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
        settings = Settings(id=poller_id, scrape=ScrapeSettings(interval_s=1.0, timeout_s=0.5))
        workers.append(Worker(settings, RedisStore(client, "t"), transport_factory=engines))
    first, second = workers
    await first.store.ensure_schema()
    for endpoint_id in IDS:
        await first.store.put_endpoint(Endpoint(id=endpoint_id, url="http://engine.test:8000"))
    yield first, second
    for worker in workers:
        await worker.jobs.stop()
        await worker.scraper.aclose()
        await worker.store.client.aclose()


async def settle(*workers: Worker, passes: int = 3) -> None:
    for _ in range(passes):
        for worker in workers:
            await worker.step()


async def test_a_drained_poller_hands_everything_over_and_takes_nothing_back(
    pair: tuple[Worker, Worker], caplog: pytest.LogCaptureFixture
) -> None:
    p1, p2 = pair
    await settle(p1, p2)
    assert p1.owned and p2.owned and set(p1.owned) | set(p2.owned) == set(IDS)
    mine = sorted(p1.owned)
    client, keys = p1.store.client, p1.store.keys
    caplog.set_level(logging.INFO)

    assert await request_drain(client, keys, "p1", "cli") == "requested"
    assert await request_drain(client, keys, "p1", "cli") == "already"
    await settle(p1, p2)
    assert p1.owned == {} and set(p2.owned) == set(IDS)
    assert await leases_of(client, keys, "p1") == []
    assert await leases_of(client, keys, "p2") == sorted(IDS)
    assert p1.draining and not p2.draining
    # seen by every poller, acknowledged in the drained one's own info
    assert p2.coordinator.draining == ("p1",) and p2.coordinator.serving == ["p2"]
    info = json.loads(await client.hget(keys.members_info, "p1"))
    assert info["draining"] is True
    _, members = await read_members(client, keys)
    assert [(m.id, m.state, (m.drain or {}).get("by")) for m in members] == [
        ("p1", "draining", "cli"),
        ("p2", "serving", None),
    ]
    # the losing side says where its endpoints went, counts agree in number
    lines = [text_of(r) for r in caplog.records]
    n = len(mine)
    assert any(
        line.startswith(f"draining: handing over {n} endpoint{'s' * (n != 1)}") for line in lines
    ), lines
    assert any(
        line.startswith(f"handing over {n} endpoint{'s' * (n != 1)} to p2 endpoints=")
        for line in lines
    ), lines
    assert any(line.startswith(f"acquired {n} endpoint{'s' * (n != 1)} ") for line in lines)

    # more passes change nothing: a draining poller stays empty
    await settle(p1, p2)
    assert p1.owned == {}

    assert await cancel_drain(client, keys, "p1") is True
    assert await cancel_drain(client, keys, "p1") is False
    await settle(p1, p2)
    assert sorted(p1.owned) == mine and not p1.draining
    assert "draining" not in json.loads(await client.hget(keys.members_info, "p1"))
    assert any(text_of(r) == "back in service: taking endpoints again" for r in caplog.records)


async def test_sigusr1_writes_the_request_itself(pair: tuple[Worker, Worker]) -> None:
    p1, p2 = pair
    await settle(p1, p2)
    p1.drain.request()  # what the SIGUSR1 handler calls
    await settle(p1, p2)
    assert p1.owned == {} and set(p2.owned) == set(IDS)
    _, members = await read_members(p1.store.client, p1.store.keys)
    assert members[0].drain is not None and members[0].drain["by"] == "signal"


async def test_drain_requests_go_with_their_member(pair: tuple[Worker, Worker]) -> None:
    p1, p2 = pair
    await settle(p1, p2)
    client, keys = p1.store.client, p1.store.keys
    assert await request_drain(client, keys, "nobody", "cli") == "not live"
    assert await client.hlen(keys.members_drain) == 0
    assert await request_drain(client, keys, "p1", "cli") == "requested"
    await p1.coordinator.leave()  # a stopped poller: a restart with its id serves again
    assert await client.hget(keys.members_drain, "p1") is None
    assert await client.hget(keys.members_info, "p1") is None
    # an expired member's request is pruned by the next heartbeat of anyone
    await p1.step()
    assert await request_drain(client, keys, "p1", "cli") == "requested"
    await client.zadd(keys.members, {"p1": 1})  # its heartbeat expired long ago
    await p2.step()
    assert await client.hget(keys.members_drain, "p1") is None
    with pytest.raises(ValueError, match="must match"):
        await request_drain(client, keys, "p2", 'cli", "x')


async def test_the_empty_registry_is_said_once_and_again_after_redis_lost_its_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    worker = Worker(Settings(id="p1"), RedisStore(client, "t"), transport_factory=engines)
    caplog.set_level(logging.INFO, logger="poller.service.notices")
    try:
        await settle(worker)
        await worker.store.put_endpoint(Endpoint(id="a", url="http://engine.test:8000"))
        await settle(worker)
        assert set(worker.owned) == {"a"}
        await client.flushall()  # Redis restarted empty
        await settle(worker)
        assert worker.owned == {}
    finally:
        await worker.jobs.stop()
        await worker.scraper.aclose()
        await client.aclose()
    said = [r.getMessage() for r in caplog.records]
    empty = [m for m in said if m.startswith("the registry is empty")]
    assert len(empty) == 2, said  # at start, and after the restart; not once per pass
    assert "`poller endpoints add ID URL`, `poller endpoints sync FILE`" in empty[0]
    assert "the registry has entries again" in said


async def test_an_empty_registry_names_the_namespaces_that_exist(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # `poller run --namespace llmgww` beside a namespace that exists: a typo, most likely
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    for namespace in ("llmgw", "other"):
        await RedisStore(client, namespace).ensure_schema()
    settings = Settings(id="p1", redis={"namespace": "llmgww"})
    worker = Worker(settings, RedisStore(client, "llmgww"), transport_factory=engines)
    caplog.set_level(logging.INFO, logger="poller.service.notices")
    try:
        await settle(worker)
    finally:
        await worker.jobs.stop()
        await worker.scraper.aclose()
        await client.aclose()
    [empty] = [r.getMessage() for r in caplog.records if r.name == "poller.service.notices"]
    assert empty.startswith("the registry is empty: this poller holds nothing; fill it with ")
    assert empty.endswith("; other namespaces on this Redis: llmgw, other (wrong --namespace?)")


# --- real pollers, real Redis, the CLI as a subprocess -----------------------------------


def cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "poller", *args, "--redis-url", redis_url, "--namespace", NS]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


NS = "drain"


@pytest.mark.slow
async def test_drain_moves_every_endpoint_and_keeps_the_health_port(
    own_redis: RedisProcess, tmp_path: Path
) -> None:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    store, keys = RedisStore(client, NS), Keys(NS)
    try:
        async with Simulator(fleet(6, engines=("vllm",)), seed=31) as sim:
            await store.replace_registry(
                {e["id"]: endpoint_from_dict(None, e) for e in sim.registry()}
            )
            ids = sorted(sim.ids)
            json_logs = ("--log-format", "json")
            with pollers(2, own_redis.url, NS, tmp_path, extra_args=json_logs) as (p0, p1):

                async def both_hold() -> bool:
                    held = await lease_holders(client, keys)
                    return sorted(held) == ids and set(held.values()) == {"p0", "p1"}

                await until(both_hold, 30, "both pollers holding leases")
                await until(lambda: p0.get("/readyz")[0] == 200, 30, "p0 ready")

                done = await asyncio.to_thread(cli, own_redis.url, "drain", "p0", "--wait", "30")
                assert done.returncode == 0, done.stderr
                assert done.stdout.startswith("draining p0: it hands its endpoints over")
                assert "p0 holds no lease" in done.stdout
                assert await leases_of(client, keys, "p1") == ids

                # p1 writes every endpoint now; p0 still answers on its health port
                reader = StatsReader(client, NS)

                async def all_by_p1() -> bool:
                    view = await reader.snapshot()
                    return all(
                        e.state == "fresh" and e.owner == "p1" for e in view.endpoints.values()
                    )

                await until(all_by_p1, 20, "every endpoint written by p1")
                assert p0.get("/healthz") == (200, "ok\n")
                status, body = p0.get("/readyz")
                assert status == 503 and body.startswith("not ready: draining"), body
                assert p0.metric("poller_leases_held") == 0 and p0.metric("poller_draining") == 1
                assert p1.metric("poller_draining") == 0
                assert p0.running()

                shown = await asyncio.to_thread(cli, own_redis.url, "status")
                [row] = [line for line in shown.stdout.splitlines() if line.startswith("p0 ")]
                assert row.split()[1:3] == ["draining", "(by"], row
                members = json.loads(
                    (await asyncio.to_thread(cli, own_redis.url, "status", "--json")).stdout
                )["members"]
                assert [(m["id"], m["state"], m["leases"]) for m in members] == [
                    ("p0", "draining", 0),
                    ("p1", "serving", len(ids)),
                ]

                # mistakes are one line and exit 2
                last = await asyncio.to_thread(cli, own_redis.url, "drain", "p1")
                assert last.returncode == 2 and "p1 is the last serving poller" in last.stderr
                assert last.stderr.count("\n") == 1
                nobody = await asyncio.to_thread(cli, own_redis.url, "drain", "p9")
                assert nobody.returncode == 2
                assert nobody.stderr == "Error: no live poller 'p9' (live pollers: p0, p1)\n"

                undo = await asyncio.to_thread(cli, own_redis.url, "drain", "p0", "--undo")
                assert undo.returncode == 0 and "p0 returns to service" in undo.stdout
                await until(both_hold, 20, "p0 taking its share again")
                await until(lambda: p0.get("/readyz")[0] == 200, 30, "p0 ready again")

                # SIGUSR1 does what `poller drain` does
                p0.signal(signal.SIGUSR1)

                async def p0_empty() -> bool:
                    return await leases_of(client, keys, "p0") == []

                await until(p0_empty, 20, "p0 empty after SIGUSR1")
                _, found = await read_members(client, keys)
                assert [(m.id, m.state) for m in found] == [("p0", "draining"), ("p1", "serving")]
                assert found[0].drain is not None and found[0].drain["by"] == "signal"
                p0.signal(signal.SIGTERM)
                assert await asyncio.to_thread(p0.wait, 15) == 0
            lines = [json.loads(x) for x in p0.log().splitlines() if x.startswith("{")]
            assert lines and all(line["poller"] == "p0" for line in lines)
            handovers = [line for line in lines if line["msg"].startswith("handing over")]
            assert handovers and all(line["to"] == "p1" for line in handovers)
            assert any(line["msg"].startswith("draining: handing over") for line in lines)
    finally:
        await client.aclose()
