"""Readers check ``P:schema``: a Redis holding another version is named, never read on."""

from __future__ import annotations

import json
import logging

import pytest
import redis
import redis.asyncio as aioredis
from click.testing import CliRunner

from poller.cli import cli
from poller.errors import SchemaMismatch
from poller.reader import StatsReader, SyncStatsReader, ViewCache
from poller.schema.keys import Keys
from tests.support.redisproc import RedisProcess

NS = "schemacheck"
KEYS = Keys(NS)


@pytest.fixture
def holding(redis_server: RedisProcess):  # type: ignore[no-untyped-def]
    """Set what ``P:schema`` holds (None: absent) in a flushed Redis, with one endpoint."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    client.hset(KEYS.endpoints, "a", json.dumps({"url": "http://10.0.0.1:8000"}))

    def hold(version: str | None) -> None:
        if version is None:
            client.delete(KEYS.schema)
        else:
            client.set(KEYS.schema, version)

    yield hold
    client.close()


async def test_a_reader_refuses_another_schema_naming_both_versions(
    redis_server: RedisProcess, holding
) -> None:  # type: ignore[no-untyped-def]
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    reader = StatsReader(client, NS)
    try:
        for version in (None, "1"):  # absent (no poller yet) or ours: read on
            holding(version)
            assert list((await reader.snapshot()).endpoints) == ["a"]
            assert (await reader.get("a")) is not None
            assert await reader.live_pollers() == []
        holding("2")
        for call in (reader.snapshot(), reader.get("a"), reader.live_pollers()):
            with pytest.raises(SchemaMismatch) as caught:
                await call
            assert "Redis holds schema 2, this reader reads 1" in str(caught.value)
            assert (caught.value.found, caught.value.expected) == ("2", "1")
        with pytest.raises(SchemaMismatch, match="holds schema 2"):
            async with reader.router():
                pytest.fail("a cached reader of another schema must not start")
    finally:
        await client.aclose()


def test_the_sync_reader_refuses_too(redis_server: RedisProcess, holding) -> None:  # type: ignore[no-untyped-def]
    reader = SyncStatsReader(redis.Redis.from_url(redis_server.url, decode_responses=True), NS)
    try:
        holding("2")
        for call in (reader.snapshot, lambda: reader.get("a"), reader.live_pollers):
            with pytest.raises(SchemaMismatch, match="Redis holds schema 2, this reader reads 1"):
                call()
        with pytest.raises(SchemaMismatch, match="holds schema 2"):
            with reader.router():
                pytest.fail("a cached reader of another schema must not start")
        holding("1")
        with reader.router() as router:
            cache = router.cache
            assert cache.healthy and cache.ids() == ["a"]
    finally:
        reader.close()


async def test_a_running_cache_that_meets_another_schema_says_so_and_stops_being_fresh(
    redis_server: RedisProcess, holding, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    from poller.reader.view.decode import build_view
    from poller.reader.view.follow import FollowProtocol

    holding("1")
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        view = await StatsReader(client, NS).snapshot()
    finally:
        await client.aclose()
    proto = FollowProtocol(ViewCache())
    proto.loaded(view, 0.0)
    reply = [1, 0, "1", 0, [], [], [], "epoch", "2"]
    with pytest.raises(SchemaMismatch) as caught:
        build_view(reply)
    with caplog.at_level(logging.ERROR, logger="poller.reader.view.follow"):
        proto.lost(caught.value)
    assert not proto.cache.healthy and proto.error is caught.value
    assert "cannot read this Redis" in caplog.text and "holds schema 2" in caplog.text


def test_poller_status_says_so(redis_server: RedisProcess, holding) -> None:  # type: ignore[no-untyped-def]
    env = {"POLLER_REDIS_URL": redis_server.url, "POLLER_NAMESPACE": NS}
    holding("1")
    ok = CliRunner().invoke(cli, ["status", "--json"], env=env)
    assert ok.exit_code == 0 and json.loads(ok.output)["schema"] == 1
    holding("2")
    table = CliRunner().invoke(cli, ["status"], env=env)
    assert table.exit_code == 1
    assert "Redis holds schema 2, this reader reads 1" in table.output
    as_json = CliRunner().invoke(cli, ["status", "--json"], env=env)
    assert as_json.exit_code == 1
    report = json.loads(as_json.stdout)
    assert report["error"] == "schema_mismatch"
    assert (report["schema"], report["reader_schema"]) == ("2", "1")
    assert '"schema": 1' not in as_json.stdout
