"""Simulated engines, a real poller and Redis, set up for the LiteLLM integration tests.

Six vLLM endpoints (by default) serve one model: three ordinary ones, one saturated (capacity 1, its
queue filled by requests of the test's own that hold their slot for 1,000 s), one
failing (HTTP 500 on every path) and one asleep (vLLM sleep mode). The simulator runs
as a process of its own (LiteLLM's work in the test's event loop must not delay its
answers), a ``poller run`` process scrapes it into a redis-server of the test's own, and
``fleet()`` yields once the view shows all of it (a test using it is marked
``redis_server``); ``litellm_proxy()`` starts a real LiteLLM proxy process (marked
``litellm_proxy``: tests/support/markers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from poller.reader import Router, StatsReader
from poller.schema.endpoint import Endpoint
from poller.store.store import RedisStore
from poller_lab.embedded import Proc, start_sim
from tests.support.markers import require
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess

# Before any import of litellm: its start-up would fetch a cost map from the internet,
# and its requests look up a Hugging Face tokenizer for a model name it does not know
# (an offline machine waits for each lookup to time out).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NS = "lt"
OK = ("ok-a", "ok-b", "ok-c")
BAD = ("saturated", "failing", "asleep")
SPEED_TPS = 1000.0
#: max_tokens of the requests that keep the saturated endpoint's queue full (1,000 s).
HOLD_TOKENS = 1_000_000
HELD = 7  # one running, six waiting: saturated at the default max_waiting of 5
#: Freshness is not what these tests are about: a loaded machine may scrape late.
STALE_AFTER_MS = 120_000
#: The poller's interval; its scrape timeout is half of it (a loaded machine is slow).
INTERVAL_S = 4.0


@dataclass
class Fleet:
    admin: str  # the simulator's admin API
    registry: dict[str, str]  # endpoint id -> url
    redis: RedisProcess
    router: Router  # the gateway's poller Router, opened once the fleet is up
    ok: tuple[str, ...] = OK
    bad: tuple[str, str, str] = BAD  # saturated, failing, asleep

    @property
    def redis_url(self) -> str:
        return self.redis.url

    def api_base(self, endpoint_id: str) -> str:
        return self.registry[endpoint_id] + "/v1"

    async def queues(self) -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False) as http:
            reply = await http.get(self.admin + "/admin/queue")
            return dict(reply.json()["endpoints"])

    async def served(self) -> dict[str, int]:
        """Per endpoint: requests in its slots or queue now, and finished ones."""
        q = await self.queues()
        return {e: int(q[e]["running"]) + int(q[e]["waiting"]) for e in q}

    def shown(self) -> bool:
        """Does the view show every endpoint as the fleet set it up?"""
        views = {e: self.router.get(e) for e in (*self.ok, *self.bad)}
        for e in self.ok:
            v = views[e]
            if v is None or v.state != "fresh" or v.stats is None or v.stats.sleeping:
                return False
        sat, failing, asleep = (views[e] for e in self.bad)
        return (
            sat is not None
            and sat.stats is not None
            and sat.state == "fresh"
            and sat.stats.waiting >= HELD - 1
            and failing is not None
            and failing.state == "failing"
            and asleep is not None
            and asleep.stats is not None
            and asleep.stats.sleeping is True
        )


def specs(ok: tuple[str, ...], bad: tuple[str, str, str]) -> list[dict[str, Any]]:
    return [
        {
            "id": e,
            "engine": "vllm",
            "capacity": 1 if e == bad[0] else 8,
            "load": 0.0,
            "model": MODEL,
            "speed_tps": SPEED_TPS,
        }
        for e in (*ok, *bad)
    ]


@contextlib.asynccontextmanager
async def fleet(
    workdir: Path, ok: tuple[str, ...] = OK, bad: tuple[str, str, str] = BAD
) -> AsyncIterator[Fleet]:
    saturated, failing, asleep = bad
    redis = RedisProcess().start()
    sim, admin, _ = start_sim(workdir, 0, "vllm", cpu=None)
    held: list[asyncio.Task[httpx.Response]] = []
    try:
        async with httpx.AsyncClient(timeout=None, trust_env=False) as http:
            (await http.post(admin + "/admin/endpoints", json=specs(ok, bad))).raise_for_status()
            registry = (await http.get(admin + "/admin/registry")).json()
            client = aioredis.Redis.from_url(redis.url, decode_responses=True)
            store = RedisStore(client, NS)
            for entry in registry:
                await store.put_endpoint(Endpoint(**entry))
            await client.aclose()
            at = admin + "/admin/endpoints/"
            (await http.post(at + asleep + "/sleep", json={})).raise_for_status()
            (await http.post(at + failing + "/fault", json={"mode": "http500"})).raise_for_status()
            urls = {entry["id"]: entry["url"] for entry in registry}
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hold"}]}
            body["max_tokens"] = HOLD_TOKENS
            url = urls[saturated] + "/v1/chat/completions"
            held = [asyncio.create_task(http.post(url, json=body)) for _ in range(HELD)]
            poller = PollerProc("p0", redis.url, NS, workdir, interval_s=INTERVAL_S).start()
            try:
                async with (
                    StatsReader.from_url(redis.url, NS, stale_after_ms=STALE_AFTER_MS) as reader,
                    reader.router() as router,
                ):
                    f = Fleet(admin, urls, redis, router, ok, bad)
                    await until(f.shown, 90, "the view showing the fleet's states")
                    yield f
            finally:
                poller.cleanup()
                for task in held:
                    task.cancel()
                await asyncio.gather(*held, return_exceptions=True)
    finally:
        sim.stop()
        redis.cleanup()


def litellm_proxy(config: Path, port: int, log: Path, env: dict[str, str]) -> Proc:
    """A real LiteLLM proxy (this environment's ``litellm`` command) on ``port``, logging
    to ``log``; the caller stops it."""
    require("litellm_proxy", "a LiteLLM proxy")
    litellm_cli = str(Path(sys.executable).parent / "litellm")
    return Proc(
        "litellm-proxy", [litellm_cli, "--config", str(config), "--port", str(port)], log, env=env
    )
