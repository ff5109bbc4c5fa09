"""Pollers and readers behind Redis Sentinel follow a master failover on their own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from poller.config import RedisSettings, load_settings
from poller.errors import ConfigError, StoreError
from poller.reader import StatsReader
from poller.redis.connection import connect
from poller.schema.endpoint import endpoint_from_dict
from poller.store.store import RedisStore
from poller_lab.sim import Simulator, fleet
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess, redis_server_binary, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.sentinel]
NS = "sen"


class SentinelSet:
    """1 master, 1 replica, 3 sentinels on loopback (quorum 2, 1 s down-after)."""

    def __init__(self, work: Path) -> None:
        # No 5 s diskless-sync delay: the replica must hold the data before the failover.
        self.master = RedisProcess(extra_args=["--repl-diskless-sync-delay", "0"]).start()
        self.replica = RedisProcess(
            extra_args=["--replicaof", "127.0.0.1", str(self.master.port)]
        ).start()
        wait_until(self._linked, 60, "the replica in sync")
        self.sentinels: list[RedisProcess] = []
        for i in range(3):
            conf = work / f"sentinel-{i}.conf"
            conf.write_text(
                f"sentinel monitor mymaster 127.0.0.1 {self.master.port} 2\n"
                "sentinel down-after-milliseconds mymaster 1000\n"
                "sentinel failover-timeout mymaster 5000\n"
                "sentinel parallel-syncs mymaster 1\n"
            )
            self.sentinels.append(RedisProcess(config_file=conf, extra_args=["--sentinel"]).start())

    def _linked(self) -> bool:
        client = redis.Redis(port=self.replica.port, decode_responses=True)
        try:
            return bool(client.info("replication").get("master_link_status") == "up")
        finally:
            client.close()

    async def promoted(self) -> bool:
        """A sentinel names the replica as the master now."""
        client = aioredis.Redis(port=self.sentinels[0].port, decode_responses=True)
        try:
            addr = await client.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")
        except redis.exceptions.RedisError:
            return False
        finally:
            await client.aclose()
        return bool(addr) and int(addr[1]) == self.replica.port

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/mymaster/0"

    def cleanup(self) -> None:
        for proc in [*self.sentinels, self.replica, self.master]:
            proc.cleanup()


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    redis_server_binary()
    s = SentinelSet(tmp_path)
    yield s
    s.cleanup()


def test_sentinel_urls_are_validated() -> None:
    for bad in ("redis+sentinel://h:1", "redis+sentinel://h:x/m", "redis+sentinel://h:1/m/x"):
        with pytest.raises(ConfigError, match="redis.url"):
            load_settings(overrides={"redis.url": bad}, environ={})  # at start-up
        with pytest.raises(ConfigError):
            connect(RedisSettings.model_construct(url=bad))  # and at the connection


async def test_failover_is_followed(sentinels: SentinelSet, tmp_path: Path) -> None:
    store = RedisStore.from_settings(RedisSettings(url=sentinels.url, namespace=NS))
    reader = StatsReader(store.client, NS)
    async with Simulator(fleet(6, engines=("vllm",)), seed=11) as sim:
        await until(lambda: _ping(store), 30, "the master through the sentinels")
        await store.replace_registry({e["id"]: endpoint_from_dict(None, e) for e in sim.registry()})
        procs = [PollerProc(f"p{i}", sentinels.url, NS, tmp_path).start() for i in range(2)]
        try:

            async def fresh(since_ms: float = 0) -> bool:
                try:
                    view = await reader.snapshot()
                except StoreError:
                    return False
                return len(view.endpoints) == 6 and all(
                    e.state == "fresh" and e.stats is not None and e.stats.scraped_at_ms > since_ms
                    for e in view.endpoints.values()
                )

            await until(fresh, 60, "fresh through the master")  # two process starts
            sentinels.master.stop()  # the master dies; a sentinel promotes the replica
            loop = asyncio.get_running_loop()
            started = loop.time()
            await until(sentinels.promoted, 30, "a sentinel promoting the replica")
            promoted_ms = time.time() * 1000
            # written again after the promotion: only the new master can have taken that
            await until(lambda: fresh(promoted_ms), 30, "fresh again through the new master")
            assert loop.time() - started < 15  # the failover's own bound (1 s down-after)
            for p in procs:
                assert p.running()
        finally:
            for p in procs:
                p.cleanup()
            await store.close()


async def _ping(store: RedisStore) -> bool:
    try:
        return await store.ping()
    except StoreError:
        return False
