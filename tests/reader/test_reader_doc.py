"""The worked gateway of docs/reader.md, run as written against a real redis-server."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import redis.asyncio as aioredis

from poller.schema.endpoint import Endpoint
from poller.store.store import RedisStore
from tests.support.paths import REPO
from tests.support.redisproc import RedisProcess

DOC = REPO / "docs" / "reader.md"
URLS = {
    name: f"http://127.0.0.1:{9100 + i}" for i, name in enumerate(["a", "b", "c", "asleep", "busy"])
}


def example(kind: str) -> str:
    """The code block that follows the doc's marker for ``kind``."""
    text = DOC.read_text("utf-8")
    marker = f"<!-- worked example ({kind}): run by tests/reader/test_reader_doc.py -->"
    found = re.search(re.escape(marker) + r"\s*```python\n(.*?)```", text, re.S)
    assert found, f"docs/reader.md lost its {kind} example"
    return found.group(1)


async def fleet(url: str) -> None:
    """The view a poller would write: a, b serve m1; c serves m2; one asleep, one full."""
    client = aioredis.Redis.from_url(url, decode_responses=True)
    store = RedisStore(client)
    try:
        await store.ensure_schema()
        await store.heartbeat("p1", 30_000)
        for name, endpoint_url in URLS.items():
            await store.put_endpoint(Endpoint(id=name, url=endpoint_url))
        leases = await store.acquire_leases("p1", list(URLS), 30_000)
        tokens = {lease.endpoint_id: lease.token for lease in leases}
        load = {
            "a": {"running": "2", "models": "m1"},
            "b": {"running": "1", "models": "m1"},
            "c": {"running": "0", "models": "m2"},
            "asleep": {"running": "0", "models": "m1", "sleeping": "1"},
            "busy": {"running": "0", "waiting": "9", "models": "m1"},
        }
        for name, fields in load.items():
            token = tokens[name]
            assert token is not None
            stats = {"engine": "vllm", "waiting": "0", "interval_ms": "10000", **fields}
            result = await store.write_stats(
                name, "p1", token, stats, lease_ttl_ms=30_000, stats_ttl_ms=30_000
            )
            assert result.accepted
    finally:
        await client.aclose()


REQUESTS = [{"model": "m1", "messages": [{"role": "user", "content": "hi " * 300}]}] * 6
REQUESTS += [{"model": "m2"}] * 2 + [{"model": "no/such-model"}]


def check(answers: list[tuple[int, Any]], sent: list[str]) -> None:
    assert [code for code, _ in answers] == [200] * 8 + [503]
    assert "no/such-model" in answers[-1][1]["error"]["message"]
    targets = sorted(target_of(url) for url in sent)
    # m1 only to a or b (never asleep, never the full one while others remain); m2 to c
    assert len(targets) == 8 and targets.count("c") == 2
    assert set(targets) - {"c"} <= {"a", "b"}
    assert all(url.endswith("/v1/chat/completions") for url in sent)


async def test_the_async_worked_example_runs(redis_server: RedisProcess) -> None:
    await _flush_and_fill(redis_server.url)
    namespace: dict[str, Any] = {}
    exec(compile(example("async"), str(DOC), "exec"), namespace)
    sent: list[str] = []
    routers: list[Any] = []
    handle = namespace["handle"]

    async def seen(router: Any, body: Any, send: Any) -> Any:  # the example's own handle
        routers.append(router)
        return await handle(router, body, send)

    namespace["handle"] = seen

    async def send(url: str, body: dict[str, str]) -> tuple[int, dict[str, str]]:
        sent.append(url)
        # the request is counted while it is served
        assert routers[-1].local.in_flight(target_of(url)) == 1
        await asyncio.sleep(0)
        return 200, {"model": body["model"]}

    answers = await namespace["gateway"](redis_server.url, REQUESTS, send)
    check(answers, sent)
    assert [target_of(url) for url in sent[6:]] == ["c", "c"]  # in order: the m2 requests
    assert routers[-1].local.total() == 0  # every ticket ended
    # The m1 requests carry one prompt: the first placed it, the rest followed it.
    assert len({target_of(url) for url in sent[:6]}) == 1
    assert "no endpoint can take 'no/such-model'" in answers[-1][1]["error"]["message"]
    assert "no registered endpoint serves" in answers[-1][1]["error"]["message"]


def target_of(url: str) -> str:
    return next(name for name, base in URLS.items() if url.startswith(base + "/"))


def test_the_threaded_worked_example_runs(redis_server: RedisProcess) -> None:
    asyncio.run(_flush_and_fill(redis_server.url))
    namespace: dict[str, Any] = {}
    exec(compile(example("threads"), str(DOC), "exec"), namespace)  # it stands alone
    sent: list[str] = []
    lock = threading.Lock()

    def send(url: str, body: dict[str, str]) -> tuple[int, dict[str, str]]:
        with lock:
            sent.append(url)
        return 200, {"model": body["model"]}

    answers = namespace["threaded_gateway"](redis_server.url, REQUESTS, send)
    check(answers, sent)


async def _flush_and_fill(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    await client.flushall()
    await client.aclose()
    await fleet(url)


def test_the_readme_s_gateway_runs_as_written(redis_server: RedisProcess) -> None:
    """README.md's gateway example, its Redis URL and model swapped for the test's: it
    runs (it is valid Python as shown) and picks an endpoint of the model."""
    text = (REPO / "README.md").read_text("utf-8")
    found = re.search(r"reader library:\s*```python\n(.*?)```", text, re.S)
    assert found, "README.md lost its gateway example"
    code = found.group(1)
    assert "redis://redis:6379/0" in code and "meta-llama/Llama-3.1-8B-Instruct" in code
    code = code.replace("redis://redis:6379/0", redis_server.url)
    code = code.replace("meta-llama/Llama-3.1-8B-Instruct", "m1")
    code = code.replace("...  # send", "picked.append(ticket.id)  # send")
    asyncio.run(_flush_and_fill(redis_server.url))
    picked: list[str] = []
    namespace: dict[str, Any] = {"picked": picked}
    exec(compile(code, "README.md", "exec"), namespace)
    asyncio.run(namespace["gateway"]())
    assert picked and picked[0] in ("a", "b")
