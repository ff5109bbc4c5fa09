"""Time what LoadAwareStrategy adds to a LiteLLM request, against a private redis-server.

Usage: python tests/bench/bench_litellm.py [--deployments 8] [--picks 20000] [--json]

A real ``litellm.Router`` with N deployments of one group, one per endpoint; the
endpoints registered and scraped-looking (``RedisStore.write_stats``) in a redis-server of
its own, read through a poller ``Router`` (``reader.router()``). Per request the strategy
adds, on top of LiteLLM's own healthy list (which any strategy gets): the choice
(deployments to endpoints, the Router's pick, whose ticket opens the request's count),
holding the ticket for its attempt, and ending it in the success callback. This times
exactly those, each request separately (``perf_counter_ns``; the thread's CPU clock is
a syscall of ~17 us in some sandboxes, more than what it would measure), and LiteLLM's
``simple_shuffle`` on the same list for scale.
Timings come from whatever machine runs it, often shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

MODEL = "bench/model-a"


def _q(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] / 1000


async def _publish(url: str, n: int) -> None:
    import redis.asyncio as aioredis

    from poller.schema.endpoint import Endpoint
    from poller.store.store import RedisStore

    client = aioredis.Redis.from_url(url, decode_responses=True)
    store = RedisStore(client, "bench")
    await store.heartbeat("p1", 600_000)
    ids = [f"e{i}" for i in range(n)]
    for i, endpoint_id in enumerate(ids):
        await store.put_endpoint(Endpoint(id=endpoint_id, url=f"http://10.0.0.{i + 1}:8000"))
    rng = random.Random(1)
    for acquired in await store.acquire_leases("p1", ids, 600_000):
        assert acquired.token is not None
        stats = {"engine": "vllm", "running": str(rng.randrange(8)), "models": MODEL}
        stats |= {"waiting": str(rng.randrange(3)), "kv_cache_usage": f"{rng.random() / 2:.3f}"}
        stats |= {"interval_ms": "600000", "kv_capacity_tokens": str(rng.choice([4, 8]) * 8192)}
        await store.write_stats(
            acquired.endpoint_id, "p1", acquired.token, stats, lease_ttl_ms=600_000,
            stats_ttl_ms=1_200_000,
        )  # fmt: skip
    await client.aclose()


async def _measure(url: str, n: int, picks: int) -> dict[str, Any]:
    import litellm
    from litellm.router_strategy.simple_shuffle import simple_shuffle

    from poller.integrations.litellm import LoadAwareStrategy
    from poller.reader import StatsReader

    model_list = [
        {
            "model_name": "chat",
            "litellm_params": {
                "model": f"openai/{MODEL}",
                "api_base": f"http://10.0.0.{i + 1}:8000/v1",  # matched by URL, never called
                "api_key": "-",
            },
        }
        for i in range(n)
    ]
    router = litellm.Router(model_list=model_list)
    healthy = router.get_model_list(model_name="chat")
    reader = StatsReader.from_url(url, "bench")
    async with reader.router(rng=random.Random(2)) as gateway:
        strategy = LoadAwareStrategy(router, poller_router=gateway, rng=random.Random(2))
        assert await strategy.routing.router() is gateway
        added: list[int] = []
        shuffle: list[int] = []
        chosen: dict[str, int] = {}
        for i in range(picks):
            kwargs = {"litellm_trace_id": f"t{i}", "stream": False}
            t0 = time.perf_counter_ns()
            deployment, ticket = strategy.choose(gateway, "chat", healthy, kwargs)
            assert deployment is not None
            strategy._opened(deployment, kwargs, ticket)
            t1 = time.perf_counter_ns()
            ended = {
                "litellm_trace_id": f"t{i}",
                "litellm_params": {"model_info": deployment["model_info"]},
            }
            t2 = time.perf_counter_ns()
            strategy._ended(ended)
            t3 = time.perf_counter_ns()
            added.append(t1 - t0 + t3 - t2)
            t4 = time.perf_counter_ns()
            simple_shuffle(router.get_model_from_alias, healthy, "chat", kwargs)
            shuffle.append(time.perf_counter_ns() - t4)
            key = str(deployment["litellm_params"]["api_base"])
            chosen[key] = chosen.get(key, 0) + 1
        assert strategy.tickets.in_flight() == 0
    await reader.aclose()
    return {
        "deployments": n,
        "picks": picks,
        "added_p50_us": _q(added, 0.5),
        "added_p99_us": _q(added, 0.99),
        "added_max_us": max(added) / 1000,
        "simple_shuffle_p50_us": _q(shuffle, 0.5),
        "simple_shuffle_p99_us": _q(shuffle, 0.99),
        "endpoints_chosen": len(chosen),
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deployments", type=int, default=8)
    p.add_argument("--picks", type=int, default=20_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from poller_lab.embedded import embedded_redis

    with tempfile.TemporaryDirectory() as tmp, embedded_redis(Path(tmp)) as (url, _):
        asyncio.run(_publish(url, args.deployments))
        result = asyncio.run(_measure(url, args.deployments, args.picks))
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        for key, value in result.items():
            print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
