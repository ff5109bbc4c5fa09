"""The whole flow on a Redis Cluster (3 masters, 3 replicas), through a master failover."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from poller.errors import StoreError
from poller.reader import StatsReader
from poller.schema.endpoint import endpoint_from_dict
from poller.store.store import RedisStore
from poller_lab.sim import Simulator, fleet
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisCluster

pytestmark = [pytest.mark.slow, pytest.mark.redis_cluster]
NS = "clu"


async def test_pollers_registry_reader_and_events_on_cluster_through_failover(
    tmp_path: Path,
) -> None:
    cluster = RedisCluster(masters=3, replicas=1).start()
    client = aioredis.RedisCluster.from_url(cluster.url, decode_responses=True)
    store, reader = RedisStore(client, NS), StatsReader(client, NS)
    procs: list[PollerProc] = []
    try:
        async with Simulator(fleet(9, engines=("vllm", "sglang", "tgi")), seed=12) as sim:
            await store.replace_registry(
                {e["id"]: endpoint_from_dict(None, e) for e in sim.registry()}
            )
            env = {"POLLER_REDIS__CLUSTER": "true"}
            procs = [
                PollerProc(f"p{i}", cluster.url, NS, tmp_path, env=env).start() for i in range(3)
            ]

            async def fresh(since_ms: float = 0) -> bool:
                try:
                    view = await reader.snapshot()
                except StoreError:
                    return False
                return len(view.endpoints) == 9 and all(
                    e.state == "fresh" and e.stats is not None and e.stats.scraped_at_ms > since_ms
                    for e in view.endpoints.values()
                )

            async def all_live() -> bool:  # a poller that started late joins a bit later
                try:
                    return sorted((await reader.snapshot()).pollers) == ["p0", "p1", "p2"]
                except StoreError:
                    return False

            # three process starts on a loaded machine: ample start-up waits
            await until(fresh, 60, "every endpoint fresh on the cluster")
            await until(all_live, 60, "the three pollers live on the cluster")

            # events cross the cluster: a cached reader follows writes
            async with reader.router() as router:
                cache = router.cache
                seq = cache.get(sim.ids[0]).stats.seq  # type: ignore[union-attr]
                await until(
                    lambda: cache.get(sim.ids[0]).stats.seq > seq,  # type: ignore[union-attr]
                    30,
                    "an event-driven update in the cache",
                )

            # kill the master holding the {clu} slot: its replica takes over
            master = client.get_node_from_key(f"{{{NS}}}:endpoints")
            cluster.node(int(master.port)).stop()
            loop = asyncio.get_running_loop()
            started = loop.time()
            stopped_ms = time.time() * 1000
            # written after the master died: only through the promoted replica
            await until(lambda: fresh(stopped_ms), 60, "fresh again after the failover")
            took = loop.time() - started
            assert took < 25  # the failover's own bound (1 s node timeout)
            assert all(p.running() for p in procs)
    finally:
        for p in procs:
            p.cleanup()
        await client.aclose()
        cluster.cleanup()
