"""One huge engine page among normal ones: does it hold up everybody else?

Usage: python tests/bench/bench_big_page.py [--endpoints 200] [--window 20] [--json]

One ``poller run`` process (a redis-server of its own, never the shared one) scrapes N
endpoints serving the 61 KB vLLM page plus one serving a ~7.5 MB page of *wanted* lines
(100k ``vllm:lora_requests_info`` series under the 8 MiB body cap), at 1 s. Three
variants, each in a fresh poller:

- ``on the loop, no cap``: every body mapped on the event loop, no sample cap (how the
  poller worked before the cap and the thread);
- ``thread, no cap``: large bodies mapped in a worker thread, no sample cap;
- ``thread + cap`` (the default): a thread, and at most ``scrape.max_samples`` samples.

For each: p99 of the normal endpoints' lateness (gap between two hits at the engine minus
the interval), the poller's own p99 scheduler lateness (histogram bucket bound), lease
losses, membership changes, and what the big endpoint ended as. The engines run in a
separate process so their work does not share the poller's loop. Bounded: about
3 x (window + 20) s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from poller_lab.bench_fleet import _hist_quantile, percentile, sync_registry  # noqa: E402
from poller_lab.embedded import (  # noqa: E402
    Proc,
    free_port,
    poller_args,
    start_redis_server,
    wait_until,
)

PAGE = (ROOT / "tests" / "data" / "vllm-v1-synthetic-61k.txt").read_bytes()
NS = "bigpage"
VARIANTS = {
    "on the loop, no cap": {"thread_map_bytes": 1024**3, "max_samples": 10_000_000},
    "thread, no cap": {"max_samples": 10_000_000},
    "thread + cap": {},
}


def big_page(target_bytes: int = 7_500_000) -> bytes:
    lines = [PAGE]
    size, i = len(PAGE), 0
    while size < target_bytes:
        line = (
            f'vllm:lora_requests_info{{max_lora="8",running_lora_adapters="adapter-{i}",'
            f'waiting_lora_adapters=""}} 1.7{i % 10}e9\n'
        ).encode()
        lines.append(line)
        size += len(line)
        i += 1
    return b"".join(lines)


def serve_engines(port: int, ready: Any) -> None:
    """The engines: /<id>/metrics, and /hits with every hit's time (separate process)."""
    from aiohttp import web

    big = big_page()
    hits: dict[str, list[float]] = {}

    async def metrics(request: web.Request) -> web.Response:
        endpoint_id = request.match_info["id"]
        hits.setdefault(endpoint_id, []).append(time.monotonic())
        return web.Response(body=big if endpoint_id == "big" else PAGE)

    async def get_hits(_: web.Request) -> web.Response:
        return web.json_response(hits)

    async def reset(_: web.Request) -> web.Response:
        hits.clear()
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/{id}/metrics", metrics)
    app.router.add_get("/hits", get_hits)
    app.router.add_post("/reset", reset)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _get(url: str, data: bytes | None = None) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=10) as r:
        return json.loads(r.read() or b"{}")


def run_variant(
    name: str, overrides: dict[str, int], n: int, window_s: float, work: Path, redis_port: int
) -> dict[str, Any]:
    engines = f"http://127.0.0.1:{ENGINE_PORT}"
    client = redis.Redis(port=redis_port, decode_responses=True)
    client.flushall()
    entries = [{"id": f"e{i}", "url": f"{engines}/e{i}"} for i in range(n)]
    entries.append({"id": "big", "url": f"{engines}/big"})
    registry = work / "endpoints.json"
    registry.write_text(json.dumps({"endpoints": entries}))
    url = f"redis://127.0.0.1:{redis_port}/0"
    asyncio.run(sync_registry(url, NS, registry))
    health = free_port()
    env = {f"POLLER_SCRAPE__{k.upper()}": str(v) for k, v in overrides.items()}
    slug = "".join(c if c.isalnum() else "-" for c in name)
    proc = Proc(slug, poller_args(url, NS, "p0", 1.0, health), work / f"{slug}.log", env=env)
    try:

        def fresh() -> bool:
            return len(client.hkeys(f"{{{NS}}}:view:stats")) >= n

        wait_until(fresh, 60, "normal endpoints written")
        time.sleep(2)
        _get(f"{engines}/reset", b"")
        losses0 = _lease_losses(health)
        time.sleep(window_s)
        hits = _get(f"{engines}/hits")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{health}/metrics", timeout=10).read()
        text = metrics.decode()
        lateness = [
            gap - 1.0
            for endpoint_id, times in hits.items()
            if endpoint_id != "big"
            for gap in (b - a for a, b in zip(times, times[1:], strict=False))
        ]
        failure = client.hgetall(f"{{{NS}}}:failure:big")
        stats = client.hgetall(f"{{{NS}}}:stats:big")
        members_changed = proc.log.read_text().count("members changed")
        return {
            "variant": name,
            "normal_gap_lateness_p50_ms": round(percentile(lateness, 0.5) * 1000, 1),
            "normal_gap_lateness_p99_ms": round(percentile(lateness, 0.99) * 1000, 1),
            "normal_gap_lateness_max_ms": round(max(lateness) * 1000, 1) if lateness else None,
            "scheduler_lateness_p99_s_le": _hist_quantile(
                text, "poller_scheduler_lateness_seconds", 0.99
            ),
            "lease_losses": _lease_losses(health) - losses0,
            "membership_changes": members_changed - 1,  # the first is joining
            "big_endpoint": failure.get("reason") or ("stats" if stats else "nothing"),
        }
    finally:
        proc.stop()
        client.close()


def _lease_losses(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("poller_lease_losses_total "):
            return float(line.split()[1])
    return math.nan


ENGINE_PORT = 0


def main() -> None:
    global ENGINE_PORT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=200)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ENGINE_PORT = free_port()
    ready = mp.get_context("spawn").Event()
    server = mp.get_context("spawn").Process(
        target=serve_engines, args=(ENGINE_PORT, ready), daemon=True
    )
    server.start()
    ready.wait(30)
    with tempfile.TemporaryDirectory(prefix="bench-big-page-") as tmp:
        work = Path(tmp)
        redis_port = free_port()
        redis_proc = start_redis_server(work, redis_port)
        try:
            wait_until(lambda: bool(redis.Redis(port=redis_port).ping()), 10, "redis-server", 0.1)
            rows = [
                run_variant(name, overrides, args.endpoints, args.window, work, redis_port)
                for name, overrides in VARIANTS.items()
            ]
        finally:
            redis_proc.stop()
            server.terminate()
            server.join(5)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    keys = list(rows[0])
    print(f"{args.endpoints} endpoints at 1 s + one 7.5 MB page of wanted lines, {args.window:g} s")
    for key in keys[1:]:
        print(f"  {key:<30}" + "".join(f"{str(r[key]):>22}" for r in rows))
    print("  " + " " * 30 + "".join(f"{r['variant']:>22}" for r in rows))


if __name__ == "__main__":
    main()
