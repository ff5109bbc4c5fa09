"""One gateway replica of the routing benchmark (a process of its own).

    python -m poller_lab.routing.replica CONFIG.json

Once ready it writes the file ``ready`` and waits for the file ``go``, which holds the
shared start (Unix seconds). It sends open-loop Poisson requests (``rate_per_s`` for
``duration_s``, at most ``max_requests``) to the simulated engines, choosing each endpoint
with its policy, and writes one JSON record per request to ``out``: when it was sent (Unix
seconds), where, the status, the latency, and the CPU the choice took. Open loop: a slow
answer never delays the next request, as with real independent clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from poller_lab.routing.policies import POLICIES, Policy, PolicyContext, router_options

__all__ = ["main", "run_replica"]

#: A request still unanswered after this long is recorded as lost (status 0).
REQUEST_TIMEOUT_S = 120.0


async def _send(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        async with http.post(url, json=body) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        status = 0
    return status, time.monotonic() - t0


@contextlib.asynccontextmanager
async def _view(cfg: Mapping[str, Any], ctx: PolicyContext) -> AsyncIterator[None]:
    """The replica's Router for the policies that route on the view, kept current in
    the background."""
    from poller.reader import StatsReader

    definition = POLICIES[cfg["policy"]]
    options = router_options(definition, ctx.options)
    reader = StatsReader.from_url(cfg["redis_url"], cfg["namespace"])
    try:
        async with reader.router(options, rng=ctx.rng) as router:
            ctx.router = router
            yield
    finally:
        await reader.aclose()


async def run_replica(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    rng = random.Random(cfg["seed"])
    definition = POLICIES[cfg["policy"]]
    urls: dict[str, str] = cfg["urls"]
    records: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def true_queues() -> Mapping[str, Mapping[str, Any]]:
            async with http.get(cfg["admin_url"] + "/admin/queue") as response:
                answer: Mapping[str, Any] = await response.json()
            return answer["endpoints"]  # type: ignore[no-any-return]

        ctx = PolicyContext(
            model=cfg["model"],
            candidates=list(cfg["candidates"]),
            rng=rng,
            true_queues=true_queues,
            mean_tokens=cfg["mean_tokens"],
            options=dict(cfg.get("options", {})),
            urls=urls,
            redis_url=cfg["redis_url"],
            gateway_url=cfg.get("gateway_url"),
        )
        async with _view(cfg, ctx) if definition.uses_view else contextlib.nullcontext():
            policy = definition.factory(ctx)
            await _arrivals(cfg, rng, http, policy, ctx, urls, records)
    return records


async def _arrivals(
    cfg: Mapping[str, Any],
    rng: random.Random,
    http: aiohttp.ClientSession,
    policy: Policy,
    ctx: PolicyContext,
    urls: Mapping[str, str],
    records: list[dict[str, Any]],
) -> None:
    tasks: set[asyncio.Task[None]] = set()

    def request(index: int) -> dict[str, Any]:
        tokens = max(1, round(rng.expovariate(1 / cfg["mean_tokens"])))
        return {
            "model": ctx.model,
            "messages": [{"role": "user", "content": f"request {index} of {cfg['seed']}"}],
            "max_tokens": tokens,
        }

    async def one(index: int) -> None:
        send = getattr(policy, "send", None)
        if send is not None:  # a gateway of its own (LiteLLM's Router) chooses and sends
            sent_at = time.time()
            chosen, status, latency_s, cpu_ns = await send(request(index))
            record = {"sent_at": sent_at, "endpoint": chosen or "", "status": status}
            # None: the gateway refused it (no deployment), it went nowhere.
            record["fallback"] = chosen is None
            records.append({**record, "latency_s": latency_s, "cpu_ns": cpu_ns})
            return
        await policy.prepare()
        cpu0 = time.thread_time_ns()
        chosen = policy.choose()
        cpu_ns = time.thread_time_ns() - cpu0
        fallback = chosen is None
        endpoint_id = rng.choice(ctx.candidates) if chosen is None else chosen
        body = request(index)
        sent_at = time.time()
        policy.started(endpoint_id)
        status, latency_s = 0, 0.0
        try:  # ended however it ends (a cancelled run included), as a gateway must
            status, latency_s = await _send(http, urls[endpoint_id] + "/v1/chat/completions", body)
        finally:
            policy.finished(endpoint_id, ok=status == 200)
        records.append(
            {
                "sent_at": sent_at,
                "endpoint": endpoint_id,
                "status": status,
                "latency_s": latency_s,
                "cpu_ns": cpu_ns,
                "fallback": fallback,
            }
        )

    warm_up = getattr(policy, "warm_up", None)
    if warm_up is not None:  # first calls that import and build clients: before the start
        await warm_up()
    start_at = await asyncio.to_thread(_ready_then_go, cfg)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    due = 0.0
    for index in range(cfg["max_requests"]):
        due += rng.expovariate(cfg["rate_per_s"])
        if due >= cfg["duration_s"]:
            break
        await asyncio.sleep(max(0.0, t0 + due - time.monotonic()))
        task = asyncio.create_task(one(index))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 10)


def _ready_then_go(cfg: Mapping[str, Any]) -> float:
    """Say ready, then wait for the shared start: every replica's arrivals begin at the
    same moment, however long each took to import and connect on a loaded machine."""
    Path(cfg["ready"]).write_text("ready", encoding="utf-8")
    go = Path(cfg["go"])
    deadline = time.monotonic() + 600  # the orchestrator gave up long before
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no start signal")
        time.sleep(0.01)
    return float(go.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m poller_lab.routing.replica CONFIG.json\n")
        return 2
    cfg = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    records = asyncio.run(run_replica(cfg))
    Path(cfg["out"]).write_text(json.dumps(records), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
