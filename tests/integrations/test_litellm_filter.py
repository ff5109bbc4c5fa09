"""LoadAwareFilter's view source: lazy, configured from the poller's variables, failing
open (once in the log, every time in the counter) while the view cannot be read, and
routing on it again once it can."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tests.support.litellm_fleet import MODEL
from tests.support.procs import until
from tests.support.redisproc import RedisProcess

# isort: off
# litellm_fleet first: it sets LITELLM_LOCAL_MODEL_COST_MAP before litellm loads.
import poller.integrations.litellm as integration
import poller.integrations.litellm.source as source_module
from poller.integrations.litellm import LoadAwareFilter
from poller.reader.routing.options import RoutingOptions
from poller.store.store import RedisStore
from poller.schema.endpoint import Endpoint

# isort: on

NS = "lf"
LOG = "poller.integrations.litellm"


def deployments() -> list[dict[str, object]]:
    return [
        {
            "model_name": "chat",
            "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"http://h:{p}/v1"},
            "model_info": {"id": f"d{p}"},
        }
        for p in (1, 2)
    ]


async def publish(url: str, interval_ms: int = 60_000) -> None:
    """Endpoint h:1 eligible, h:2 asleep, as a poller would have written them (fresh for
    two intervals)."""
    client = aioredis.Redis.from_url(url, decode_responses=True)
    store = RedisStore(client, NS)
    await store.heartbeat("p1", 60_000)
    for port in (1, 2):
        await store.put_endpoint(Endpoint(id=f"e{port}", url=f"http://h:{port}"))
    for acquired in await store.acquire_leases("p1", ["e1", "e2"], 60_000):
        assert acquired.token is not None
        stats = {"engine": "vllm", "running": "0", "waiting": "0", "models": MODEL}
        stats |= {
            "interval_ms": str(interval_ms),
            "sleeping": "1" if acquired.endpoint_id == "e2" else "0",
        }
        written = await store.write_stats(
            acquired.endpoint_id, "p1", acquired.token, stats, lease_ttl_ms=60_000,
            stats_ttl_ms=120_000,
        )  # fmt: skip
        assert written.accepted
    await client.aclose()


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if r.name == LOG and text in r.getMessage())


@pytest.fixture
async def no_env(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    monkeypatch.delenv("POLLER_REDIS_URL", raising=False)
    monkeypatch.delenv("POLLER_NAMESPACE", raising=False)
    yield


async def test_the_module_instance_connects_only_when_used(
    no_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = integration.load_aware_filter.routing.source
    assert source.router is None  # nothing opened at import
    monkeypatch.setenv("POLLER_REDIS_URL", "redis://r:6379/2")
    monkeypatch.setenv("POLLER_NAMESPACE", "gw")
    assert source.settings() == ("redis://r:6379/2", "gw")


async def test_no_redis_url_fails_open_and_says_so_once(
    no_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    f = LoadAwareFilter()
    given = deployments()
    with caplog.at_level(logging.WARNING, LOG):
        for _ in range(3):
            assert await f.async_filter_deployments("chat", given, None) == given
    assert f.fail_open_total == 3
    assert warnings_of(caplog, "cannot be read (ValueError: no Redis URL") == 1
    assert "POLLER_REDIS_URL" in caplog.text


@pytest.mark.redis_server
async def test_redis_absent_then_present_then_lost(
    no_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisProcess()  # its port, nothing listening yet
    f = LoadAwareFilter(
        redis_url=server.url, namespace=NS, options=RoutingOptions(stale_grace_s=0.0)
    )
    given = deployments()
    try:
        with caplog.at_level(logging.INFO, LOG):
            assert await f.async_filter_deployments("chat", given, None) == given
            assert await f.async_filter_deployments("chat", given, None) == given
            assert f.fail_open_total == 2
            # Never reached yet: not "lost".
            assert warnings_of(caplog, "cannot be read (cannot reach Redis: no view read") == 1
            assert warnings_of(caplog, "lost Redis") == 0

            server.start()
            await publish(server.url)

            async def filtered() -> bool:
                kept = await f.async_filter_deployments("chat", given, None)
                return kept == given[:1]  # the asleep one dropped

            await until(filtered, 60, "the filter routing on the view")
            assert warnings_of(caplog, "readable again") == 1
            assert f.dropped_total >= 1

            server.stop()
            router = f.routing.source.router
            assert router is not None
            await until(lambda: not router.healthy, 60, "the reader noticing Redis is gone")
            lost = f.fail_open_total
            assert await f.async_filter_deployments("chat", given, None) == given
            assert f.fail_open_total == lost + 1
            assert warnings_of(caplog, "cannot be read (lost Redis: no answer for ") == 1
            assert warnings_of(caplog, "longer than stale_grace_s)") == 1
    finally:
        await f.aclose()
        server.cleanup()


@pytest.mark.redis_server
async def test_a_redis_of_another_schema_is_tried_again_after_a_while_not_per_request(
    no_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisProcess().start()
    admin = aioredis.Redis.from_url(server.url, decode_responses=True)
    await admin.set(f"{{{NS}}}:schema", "99")
    f = LoadAwareFilter(redis_url=server.url, namespace=NS)
    given = deployments()
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(18):
                assert await f.async_filter_deployments("chat", given, None) == given
            for _ in range(2):  # a new event loop per call, as a sync app runs one
                call = f.async_filter_deployments("chat", given, None)
                assert await asyncio.to_thread(asyncio.run, call) == given
            opened = sum(1 for r in caplog.records if "cannot read this Redis" in r.getMessage())
            assert opened == 1  # one reader opened, its ERROR said once
            assert warnings_of(caplog, "cannot be read (SchemaMismatch") == 1
            assert f.fail_open_total == 20
            # The failed open closed what it had opened: only our admin connection is left.
            clients = await admin.client_list()
            assert len(clients) == 1, clients
            # RETRY_OPEN_S later, it is opened again (the clock moved on by hand).
            source = f.routing.source
            assert source._failed is not None
            retry_at, why = source._failed
            source._failed = (retry_at - source_module.RETRY_OPEN_S, why)
            assert await f.async_filter_deployments("chat", given, None) == given
            opened = sum(1 for r in caplog.records if "cannot read this Redis" in r.getMessage())
            assert opened == 2
    finally:
        await f.aclose()
        await admin.aclose()
        server.cleanup()


async def test_no_current_numbers_for_any_endpoint_fails_open(
    no_env: None, own_redis: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The pollers stopped: every endpoint's numbers went stale. The view says nothing
    about them any more, so LiteLLM's list stands (the asleep one included)."""
    await publish(own_redis.url, interval_ms=10)  # stale 20 ms after the write
    f = LoadAwareFilter(redis_url=own_redis.url, namespace=NS)
    given = deployments()
    try:
        with caplog.at_level(logging.WARNING, LOG):
            cache = (await f.routing.source.open()).cache
            await until(lambda: cache.loaded, 60, "the first snapshot")
            await until(
                lambda: all((v := cache.get(e)) and v.state == "stale" for e in ("e1", "e2")),
                60,
                "the numbers going stale",
            )
            assert await f.async_filter_deployments("chat", given, None) == given
        assert f.fail_open_total == 1
        assert warnings_of(caplog, "cannot be read (no current numbers for e1, e2)") == 1
    finally:
        await f.aclose()


async def test_an_engine_naming_no_model_is_judged_without_one(
    no_env: None, own_redis: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """llama.cpp, TGI and trtllm-serve pages name no model: their endpoints list none in
    the view, and take the deployment's requests; one listing another model does not."""
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    store = RedisStore(client, NS)
    await store.heartbeat("p1", 60_000)
    for port in (1, 2):
        await store.put_endpoint(Endpoint(id=f"e{port}", url=f"http://h:{port}"))
    for acquired in await store.acquire_leases("p1", ["e1", "e2"], 60_000):
        assert acquired.token is not None
        stats = {"engine": "llamacpp", "running": "0", "waiting": "0", "interval_ms": "60000"}
        if acquired.endpoint_id == "e2":
            stats |= {"engine": "vllm", "models": "acme/x"}
        written = await store.write_stats(
            acquired.endpoint_id, "p1", acquired.token, stats, lease_ttl_ms=60_000,
            stats_ttl_ms=120_000,
        )  # fmt: skip
        assert written.accepted
    await client.aclose()
    f = LoadAwareFilter(redis_url=own_redis.url, namespace=NS)
    given = deployments()
    try:
        with caplog.at_level(logging.WARNING, LOG):
            cache = (await f.routing.source.open()).cache
            await until(lambda: cache.loaded, 60, "the first snapshot")
            for _ in range(3):
                assert await f.async_filter_deployments("chat", given, None) == given[:1]
        assert [r.getMessage() for r in caplog.records if r.name == LOG] == [
            f"LiteLLM deployment d2 of model group 'chat' (endpoint e2) dropped: serves "
            f"another model (lists acme/x, not {MODEL})"
        ]
    finally:
        await f.aclose()
