"""CPU per fenced write through WriteBatcher: redis-py's Pipeline against the hiredis-packed
send, at batches of 2 and 8 writes (a real redis-server of its own on a free port).

Usage: python tests/bench/bench_batch.py
"""

from __future__ import annotations

import asyncio
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # a script run from a checkout

import redis.asyncio as aioredis  # noqa: E402

from poller.store.store import RedisStore  # noqa: E402
from tests.support.redisproc import RedisProcess  # noqa: E402

FIELDS = {
    "engine": "vllm",
    "running": "3",
    "waiting": "1",
    "scrape_ms": "1.234",
    "interval_ms": "1000",
    "kv_cache_usage": "0.42",
    "prefix_cache_hit_rate": "0.5",
    "prefix_cache_hits_total": "12345",
    "prefix_cache_queries_total": "23456",
    "models": "meta-llama/Llama-3.1-8B-Instruct",
}
ROUNDS = 60


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main(url: str) -> None:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    store = RedisStore(client, "bench", write_batch_window_s=0.005)
    assert store._batcher is not None
    acquired = await store.acquire_leases("p1", [f"e{i}" for i in range(8)], 60_000)
    for packed in (False, True, False, True):
        store._batcher._packed = packed
        for size in (2, 8):
            group, writes, start = acquired[:size], 0, cpu_s()
            for _ in range(ROUNDS):
                await asyncio.gather(
                    *(
                        store.write_stats(
                            a.endpoint_id,
                            "p1",
                            a.token or 0,
                            FIELDS,
                            lease_ttl_ms=60_000,
                            stats_ttl_ms=5_000,
                        )
                        for a in group
                    )
                )
                writes += size
            how = "hiredis-packed" if packed else "redis-py Pipeline"
            print(f"{how:>18}, batch {size}: {(cpu_s() - start) / writes * 1e6:.0f} us CPU/write")
    await client.aclose()


if __name__ == "__main__":
    server = RedisProcess().start()
    try:
        asyncio.run(main(server.url))
    finally:
        server.stop()
        server.cleanup()
