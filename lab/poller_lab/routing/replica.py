"""One gateway replica of the routing benchmark (a process of its own).

    python -m poller_lab.routing.replica CONFIG.json

Once ready it writes the file ``ready`` and waits for the file ``go``, which holds the
shared start (Unix seconds). It sends open-loop requests to the simulated engines,
choosing each endpoint with its policy: the ``arrivals`` given (``[at_s, tokens, index,
target]`` each, the same for every policy of a cell), or else Poisson requests
(``rate_per_s`` for ``duration_s``, at most ``max_requests``). It writes one JSON record
per request to ``out``: when it was sent (Unix seconds), where, the status, the latency,
the time to the first chunk (``stream``: the engine's first token; else the whole
answer), and the CPU the choice took. Open loop: a slow answer never delays the next
request, as with real independent clients.

Two policies are not choices: ``outside`` sends each arrival to its ``target`` (a client
that is not a gateway), ``peer`` sends every request to ``router_url`` (another router,
which chooses; the engine that served it names itself in ``x-sim-endpoint``).
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
from typing import Any, NamedTuple

import aiohttp

from poller_lab.routing.policies import POLICIES, Policy, PolicyContext, router_options

__all__ = ["Answer", "main", "run_replica", "send"]

#: A request still unanswered after this long is recorded as lost (status 0).
REQUEST_TIMEOUT_S = 120.0


class Answer(NamedTuple):
    status: int  # 0: no answer (connection failed or timed out)
    latency_s: float
    first_s: float | None  # until the first chunk of the body
    endpoint: str  # the engine that served it, when it says (``x-sim-endpoint``)


async def send(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    t0 = time.monotonic()
    first_s = None
    endpoint = ""
    try:
        async with http.post(url, json=body) as response:
            endpoint = response.headers.get("x-sim-endpoint", "")
            async for chunk in response.content.iter_any():
                if chunk and first_s is None:
                    first_s = time.monotonic() - t0
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        status = 0
    return Answer(status, time.monotonic() - t0, first_s, endpoint)


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
    # The outside client and a peer's gateway choose nothing: a blind policy stands in.
    name = cfg["policy"]
    definition = POLICIES["random" if name in ("outside", "peer") else name]
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
            # Written before the view and the connections close: the bench reads the
            # file as soon as it is there, so a slow shutdown delays nothing.
            _write(Path(cfg["out"]), records)
    return records


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records), encoding="utf-8")
    tmp.rename(path)  # atomic: the bench never reads half a file


def _schedule(cfg: Mapping[str, Any], rng: random.Random) -> list[tuple[float, int, int, str]]:
    """(due s from the start, max_tokens, index, target) of every request to send."""
    given = cfg.get("arrivals")
    if given is not None:
        return [(float(a[0]), int(a[1]), int(a[2]), str(a[3])) for a in given]
    out = []
    due = 0.0
    for index in range(cfg["max_requests"]):
        due += rng.expovariate(cfg["rate_per_s"])
        if due >= cfg["duration_s"]:
            break
        out.append((due, max(1, round(rng.expovariate(1 / cfg["mean_tokens"]))), index, ""))
    return out


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
    stream = bool(cfg.get("stream", False))
    schedule = _schedule(cfg, rng)

    def request(index: int, tokens: int) -> dict[str, Any]:
        body = {
            "model": ctx.model,
            "messages": [{"role": "user", "content": f"request {index} of {cfg['seed']}"}],
            "max_tokens": tokens,
        }
        return {**body, "stream": True} if stream else body

    def record(sent_at: float, endpoint: str, answer: Answer, cpu_ns: int, fallback: bool) -> None:
        records.append(
            {
                "sent_at": sent_at,
                "endpoint": endpoint,
                "status": answer.status,
                "latency_s": answer.latency_s,
                "first_s": answer.first_s,
                "cpu_ns": cpu_ns,
                "fallback": fallback,
            }
        )

    async def one(index: int, tokens: int, target: str) -> None:
        body = request(index, tokens)
        if cfg["policy"] in ("outside", "peer"):
            peer = cfg["policy"] == "peer"
            url = cfg["router_url"] if peer else urls[target]
            sent_at = time.time()
            answer = await send(http, url + "/v1/chat/completions", body)
            record(sent_at, answer.endpoint if peer else target, answer, 0, False)
            return
        sender = getattr(policy, "send", None)
        if sender is not None:  # a gateway of its own (LiteLLM's Router) chooses and sends
            sent_at = time.time()
            chosen, status, latency_s, cpu_ns = await sender(body)
            # None: the gateway refused it (no deployment), it went nowhere.
            answer = Answer(status, latency_s, None, chosen or "")
            record(sent_at, chosen or "", answer, cpu_ns, chosen is None)
            return
        await policy.prepare()
        cpu0 = time.thread_time_ns()
        chosen = policy.choose()
        cpu_ns = time.thread_time_ns() - cpu0
        endpoint_id = rng.choice(ctx.candidates) if chosen is None else chosen
        sent_at = time.time()
        policy.started(endpoint_id)
        answer = Answer(0, 0.0, None, endpoint_id)
        try:  # ended however it ends (a cancelled run included), as a gateway must
            answer = await send(http, urls[endpoint_id] + "/v1/chat/completions", body)
        finally:
            policy.finished(endpoint_id, ok=answer.status == 200)
        record(sent_at, endpoint_id, answer, cpu_ns, chosen is None)
        if ctx.router is not None:
            records[-1]["seen"] = _seen(ctx, endpoint_id)

    warm_up = getattr(policy, "warm_up", None)
    if warm_up is not None:  # first calls that import and build clients: before the start
        await warm_up()
    start_at = await asyncio.to_thread(_ready_then_go, cfg)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    for due, tokens, index, target in schedule:
        await asyncio.sleep(max(0.0, t0 + due - time.monotonic()))
        task = asyncio.create_task(one(index, tokens, target))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 10)


#: A page's KV usage at or above this reads as a full engine (smg's default leaves such
#: engines out; the Router weighs no page's KV usage against its exact counts); the
#: trace counts the pages that said so.
_KV_SATURATED = 0.8


def _seen(ctx: PolicyContext, chosen: str) -> dict[str, Any]:
    """What the view showed at this pick, for the trace: the chosen engine's page (KV
    usage, running, waiting, age) and how many candidates' pages said KV >= 0.8."""
    assert ctx.router is not None
    saturated = 0
    mine: dict[str, Any] = {}
    for endpoint_id in ctx.candidates:
        e = ctx.router.get(endpoint_id)
        if e is None or e.stats is None:
            continue
        s = e.stats
        kv = s.kv_cache_usage
        saturated += kv is not None and kv >= _KV_SATURATED
        if endpoint_id == chosen:
            mine = {"kv": kv, "running": s.running, "waiting": s.waiting, "age_ms": e.age_ms}
    return {"chosen": mine, "saturated": saturated}


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
    asyncio.run(run_replica(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
