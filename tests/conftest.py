"""Fixtures every test folder shares, and the marking of tests that need a server.

Tests are marked from the fixtures they use (tests/support/markers.py says which), and the
running test is handed to that module, so that the helpers which start a server can refuse
to when the test lacks its marker.
"""

from __future__ import annotations

import os

# Before anything imports litellm: it would fetch its model cost map from the internet in
# a background thread (no network here), and log the failed retries into whatever output a
# test is reading.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis.asyncio as aioredis

from poller.store.store import RedisStore
from tests.support import markers
from tests.support.paths import DATA
from tests.support.redisproc import RedisCluster, RedisProcess


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with the servers its fixtures start, and what its markers imply."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        store_param = callspec.params.get("store") if callspec is not None else None
        needed = markers.markers_for(getattr(item, "fixturenames", []), store_param)
        for name in {m.name for m in item.iter_markers()}:
            needed.update(markers.IMPLIES.get(name, ()))
        for name in sorted(needed):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """The running test, set-up to tear-down, for ``markers.require``."""
    markers.enter(item)
    try:
        return (yield)
    finally:
        markers.leave()


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One real redis-server for tests that only need real semantics (flushed per test)."""
    server = RedisProcess().start()
    yield server
    server.cleanup()


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    """A redis-server of this test's own, to stop, restart or pause."""
    server = RedisProcess().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    cluster = RedisCluster().start()
    yield cluster
    cluster.cleanup()


@pytest.fixture
async def real_client(redis_server: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
async def fake_client() -> AsyncIterator[aioredis.Redis]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture(params=["fake", "real", "real-batched", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
    """The store on fakeredis, a real redis-server (with and without write batching) and a
    3-master Cluster: the same tests."""
    client: aioredis.Redis | aioredis.RedisCluster
    if request.param == "fake":
        client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    elif request.param == "cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        client = aioredis.RedisCluster.from_url(cluster.url, decode_responses=True)
        await client.flushall(target_nodes=aioredis.RedisCluster.PRIMARIES)
    else:
        server: RedisProcess = request.getfixturevalue("redis_server")
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        await client.flushall()
    batch_s = 0.005 if request.param.endswith("batched") else 0.0
    yield RedisStore(client, "test", write_batch_window_s=batch_s)
    await client.aclose()
