"""Time the operator's page rendering (``poller.service.web.render``) for fleet sizes.

Usage: python tests/bench/bench_page.py [--endpoints 100,1000,5000]

Builds ``View.to_dict()``-shaped views (5% failing with a detail, 2% unknown, the rest
fresh with full vLLM stats and two LoRA adapters) and times ``render_page`` unsorted and
sorted by a numeric column, plus the page's size. This is the CPU a poller spends per page
request beside the snapshot read (the page renders in a worker thread, so it does not hold
the event loop; it still takes the GIL). Each timed loop stops after 2 s. Numbers come from
whatever machine runs it: compare runs on one machine.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from poller.service.web.render import Fleet, parse_query, render_page

BUDGET_S = 2.0


def make_view(n: int) -> dict[str, Any]:
    endpoints = []
    for i in range(n):
        state = "failing" if i % 20 == 0 else "unknown" if i % 50 == 1 else "fresh"
        stats = None
        if state != "unknown":
            stats = {
                "engine": "vllm",
                "running": i % 97,
                "waiting": i % 13,
                "kv_cache_usage": (i % 100) / 100,
                "prefix_cache_hit_rate": (i % 71) / 71,
                "lora_running": ["sql-adapter", "chat-adapter"],
                "lora_waiting": [],
                "lora_max": 4,
                "models": ["meta-llama/Llama-3.1-8B-Instruct"],
            }
        failure = None
        if state == "failing":
            failure = {"reason": "timeout", "detail": "no answer in 1 s", "since_ms": 900_000}
        endpoints.append(
            {
                "id": f"vllm-{i:05d}",
                "state": state,
                "engine": "vllm",
                "age_ms": 350,
                "owner": f"poller-{i % 3}",
                "token": i,
                "stats": stats,
                "failure": failure,
            }
        )
    return {
        "schema": 1,
        "now_ms": 1_000_000,
        "rev": 1,
        "pollers": ["poller-0", "poller-1", "poller-2"],
        "counts": {"fresh": 0, "stale": 0, "failing": 0, "unknown": 0},
        "endpoints": endpoints,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", default="100,1000,5000")
    sizes = [int(n) for n in parser.parse_args().endpoints.split(",")]
    fleet = Fleet("poller-0", "0", 2000, schema="1", expiries={"poller-0": 1_001_500})
    print(f"{'endpoints':>9}  {'query':<26} {'ms/render':>9}  {'KiB':>6}")
    for n in sizes:
        view = make_view(n)
        for query in ("", "sort=waiting&order=desc", "state=failing"):
            q = parse_query(query)
            runs, started = 0, time.perf_counter()
            while runs < 1000 and time.perf_counter() - started < BUDGET_S:
                html = render_page(view, fleet, q)
                runs += 1
            ms = (time.perf_counter() - started) / runs * 1000
            print(f"{n:>9}  {query or '(all, by id)':<26} {ms:>9.2f}  {len(html) / 1024:>6.0f}")


if __name__ == "__main__":
    main()
