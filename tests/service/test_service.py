"""`poller run` as a service: health port, Redis outages, --endpoints-file, logs."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from poller.errors import StoreError
from poller.reader import StatsReader
from poller_lab.sim import Simulator, fleet
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess

pytestmark = pytest.mark.slow
NS = "svc"


def write_file(path: Path, sim: Simulator, ids: list[str]) -> None:
    entries = [e for e in sim.registry() if e["id"] in ids]
    path.write_text(json.dumps({"endpoints": entries}))  # JSON is YAML too


async def test_health_endpoints_and_redis_outage(own_redis: RedisProcess, tmp_path: Path) -> None:
    own_redis.stop()  # Redis is down when the poller starts
    async with Simulator(fleet(3, engines=("vllm",)), seed=7) as sim:
        file = tmp_path / "endpoints.yaml"
        write_file(file, sim, sim.ids)
        poller = PollerProc(
            "p0",
            own_redis.url,
            NS,
            tmp_path,
            extra_args=("--endpoints-file", str(file), "--log-format", "json"),
        )
        poller.start()
        try:
            # A process start on a loaded machine can take many seconds: ample headroom.
            await until(lambda: poller.get("/healthz")[0] == 200, 60, "healthz")
            assert poller.get("/readyz")[0] == 503
            # keeps running, retrying with backoff: the failed attempt is logged, then more
            await until(lambda: "redis unreachable" in poller.log(), 30, "the outage logged")
            await until(lambda: poller.metric("poller_redis_errors_total") >= 2, 30, "a retry")
            assert poller.running()
            own_redis.start()
            await until(lambda: poller.get("/readyz")[0] == 200, 30, "ready after Redis came up")
            client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
            reader = StatsReader(client, NS)

            async def fresh(n: int) -> bool:
                try:
                    view = await reader.snapshot()
                except StoreError:  # our own client, during the restart
                    return False
                return len(view.endpoints) == n and all(
                    e.state == "fresh" for e in view.endpoints.values()
                )

            await until(lambda: fresh(3), 30, "registry from the file, scraped")
            status, body = poller.get("/v1/view")
            assert status == 200 and len(json.loads(body)["endpoints"]) == 3
            status, metrics = poller.get("/metrics")
            assert 'poller_scrapes_total{engine="vllm",result="ok"}' in metrics
            assert "poller_leases_held 3.0" in metrics and "poller_redis_up 1.0" in metrics
            assert poller.get("/nope")[0] == 404

            # the file changes: the registry follows
            write_file(file, sim, sim.ids[:2])
            await until(lambda: fresh(2), 30, "registry shrunk with the file")

            # Redis restarts empty: the poller re-registers, re-syncs the file, writes again
            own_redis.restart()
            await until(lambda: fresh(2), 30, "fresh again after an empty restart")
            assert await client.get("{svc}:schema") == "1"
            await client.aclose()

            poller.signal(signal.SIGTERM)
            assert await asyncio.to_thread(poller.wait, 30) == 0
            lines = [json.loads(line) for line in poller.log().splitlines() if line.startswith("{")]
            messages = [entry["msg"] for entry in lines]
            assert any(m.startswith("redis unreachable") for m in messages)
            assert any(m == "redis reachable" for m in messages)
            # one line per state change, not one per retry
            assert sum(m.startswith("redis unreachable") for m in messages) <= 4
        finally:
            poller.cleanup()


async def test_two_pollers_with_the_same_file_converge(
    own_redis: RedisProcess, tmp_path: Path
) -> None:
    async with Simulator(fleet(4, engines=("vllm",)), seed=8) as sim:
        file = tmp_path / "endpoints.yaml"
        write_file(file, sim, sim.ids)
        procs = [
            PollerProc(
                f"p{i}", own_redis.url, NS, tmp_path, extra_args=("--endpoints-file", str(file))
            ).start()
            for i in range(2)
        ]
        client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
        try:
            await until(lambda: client.hlen("{svc}:endpoints"), 60, "registry written")

            def passes_done() -> bool:
                # Each full pass syncs the file first: two passes each, and both have had
                # their chance to write it.
                count = "poller_reconcile_duration_seconds_count"
                return all(p.metric(count) >= 2 for p in procs)

            await until(passes_done, 60, "two coordination passes in each poller")
            assert await client.get("{svc}:endpoints:rev") == "1"  # written once, no fight
        finally:
            await client.aclose()
            for p in procs:
                p.cleanup()


async def test_schema_mismatch_refuses_to_start(own_redis: RedisProcess, tmp_path: Path) -> None:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    await client.set("{svc}:schema", "2")
    await client.aclose()
    poller = PollerProc("p0", own_redis.url, NS, tmp_path).start()
    try:
        assert await asyncio.to_thread(poller.wait, 60) == 1
        assert "schema version '2'" in poller.log()
    finally:
        poller.cleanup()
