"""``poller bench --section epp``: what ``poller epp`` adds to Envoy, and what it costs.

Real processes on loopback: an embedded Redis, ``poller sim`` (fast engines: no
background load, answers of one token at 1,000 tokens/s), one ``poller run``, one
``poller epp`` and Envoy (``--concurrency 1``) on deploy/envoy/envoy.yaml. Three
gateways in front of the same engines:

- ``envoy``: Envoy alone (the ext_proc filter removed); the client names the engine in
  ``x-gateway-destination-endpoint`` itself, round robin: the same path minus the EPP;
- ``epp``: the shipped modes (request body BUFFERED, response headers, no response body);
- ``epp-duplex``: the reference configuration's (FULL_DUPLEX_STREAMED both ways).

Latency: open-loop requests at each rate (evenly spaced) for ``duration_s``, time to
the whole answer, p50 and p99, and the EPP's added time over Envoy alone. Cost: a
closed loop of ``concurrency`` clients for ``duration_s``, the EPP process's CPU (user +
system, /proc) per request, and the requests per second one core sustains at that
cost; the same with streamed answers, and per response chunk the EPP saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import aiohttp

from poller_lab.bench_fleet import percentile, sync_registry
from poller_lab.embedded import (
    Proc,
    free_port,
    process_cpu_s,
    redis_for,
    start_pollers,
    start_sim,
    wait_until,
    workdir,
)
from poller_lab.envoy import admin_get, render, start_envoy, start_epp

__all__ = ["EppBenchConfig", "run_epp_bench"]

NS = "epp-bench"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_DUPLEX = {
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "response_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_trailer_mode": "SEND",
}


@dataclass(frozen=True)
class EppBenchConfig:
    rates: tuple[int, ...] = (50, 100, 200)
    duration_s: float = 10.0
    concurrency: int = 16
    engines: int = 4
    stream_tokens: int = 32

    @classmethod
    def quick(cls) -> EppBenchConfig:
        return cls(rates=(50, 200), duration_s=3.0, concurrency=8)


def _body(stream: bool, tokens: int = 1) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": tokens,
            "stream": stream,
        }  # fmt: skip
    ).encode()


class _Gateway:
    def __init__(self, name: str, url: str, addresses: list[str] | None, epp: Proc | None):
        self.name, self.url, self.addresses, self.epp = name, url, addresses, epp
        self._next = 0

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.addresses:  # Envoy alone: the client names the engine, round robin
            self._next += 1
            headers["x-gateway-destination-endpoint"] = self.addresses[
                self._next % len(self.addresses)
            ]
        return headers


async def _one(http: aiohttp.ClientSession, gw: _Gateway, body: bytes) -> tuple[float, int]:
    t0 = time.perf_counter()
    async with http.post(gw.url + "/v1/chat/completions", data=body, headers=gw.headers()) as r:
        await r.read()
        status = r.status
    return time.perf_counter() - t0, status


async def _open_loop(gw: _Gateway, rate: int, duration_s: float) -> dict[str, Any]:
    body = _body(False)
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for _ in range(20):  # warm the connections
            await _one(http, gw, body)
        tasks = []
        start = time.perf_counter()
        n = int(rate * duration_s)
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(http, gw, body)))
        for latency, status in await asyncio.gather(*tasks):
            if status == 200:
                latencies.append(latency)
            else:
                errors += 1
    latencies.sort()
    return {
        "rate": rate,
        "requests": n,
        "errors": errors,
        "p50_ms": round(1000 * percentile(latencies, 0.5), 2),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2),
    }


async def _closed_loop(gw: _Gateway, body: bytes, clients: int, duration_s: float) -> int:
    done = 0
    stop_at = time.perf_counter() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                _, status = await _one(http, gw, body)
                done += status == 200

        await asyncio.gather(*(client() for _ in range(clients)))
    return done


def _chunks(metrics_port: int) -> float:
    text = admin_get_metrics(metrics_port)
    for line in text.splitlines():
        if line.startswith("epp_response_chunks_total "):
            return float(line.split()[1])
    return 0.0


def admin_get_metrics(port: int) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()  # type: ignore[no-any-return]
    except OSError:
        return ""


def _cost(gw: _Gateway, cfg: EppBenchConfig, stream: bool, metrics_port: int) -> dict[str, Any]:
    assert gw.epp is not None
    body = _body(stream, cfg.stream_tokens if stream else 1)
    chunks0, cpu0, t0 = _chunks(metrics_port), process_cpu_s(gw.epp.pid), time.monotonic()
    done = asyncio.run(_closed_loop(gw, body, cfg.concurrency, cfg.duration_s))
    cpu_s, wall_s = process_cpu_s(gw.epp.pid) - cpu0, time.monotonic() - t0
    chunks = _chunks(metrics_port) - chunks0
    per = 1000 * cpu_s / done if done else None
    return {
        "requests": done,
        "requests_per_s": round(done / wall_s, 1),
        "epp_cpu_ms_per_request": None if per is None else round(per, 3),
        "requests_per_core_s": None if not per else int(1000 / per),
        "chunks_per_request": round(chunks / done, 2) if done else None,
    }


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_epp_bench(cfg: EppBenchConfig, redis_url: str | None, out: TextIO) -> dict[str, Any]:
    started = time.monotonic()

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    load_before = _loadavg()
    with workdir("poller-epp-bench-") as work, redis_for(work, redis_url) as (url, _):
        specs = [{"id": f"e-{i}", "engine": "vllm", "style": "port", "load": 0,
                  "speed_tps": 1000.0} for i in range(cfg.engines)]  # fmt: skip
        (work / "specs.json").write_text(json.dumps(specs))
        sim, _, registry = start_sim(
            work, 1, "vllm", extra=["--spec-file", str(work / "specs.json")]
        )
        procs: list[Proc] = [sim]
        try:
            asyncio.run(sync_registry(url, NS, registry))
            addresses = [e["url"].removeprefix("http://") for e in json.loads(registry.read_text())]
            (poller, _), *_ = start_pollers(work, url, NS, ["epp-bench"], interval_s=1.0)
            procs.append(poller)
            metrics_port = free_port()
            epp, grpc, health = start_epp(work, url, NS, "epp", "--metrics-port", str(metrics_port))
            procs.append(epp)
            gateways = []
            for name, epps, modes in (
                ("envoy", [], None),
                ("epp", [(grpc, health)], None),
                ("epp-duplex", [(grpc, health)], _DUPLEX),
            ):
                port, admin = free_port(), free_port()
                config = render(listen_port=port, admin_port=admin, epps=epps, modes=modes)
                procs.append(start_envoy(work, config, name))
                if epps:
                    wait_until(lambda a=admin: "health_flags::healthy" in admin_get(a, "/clusters"),
                               60, "the EPP healthy")  # fmt: skip
                gw = _Gateway(name, f"http://127.0.0.1:{port}", None if epps else addresses,
                              epp if epps else None)  # fmt: skip
                gateways.append(gw)
            # Every engine answering through the EPP: the view is fresh.
            wait_until(lambda: asyncio.run(_closed_loop(gateways[1], _body(False), 1, 0.2)) > 0,
                       60, "a request routed by the EPP")  # fmt: skip
            latency: list[dict[str, Any]] = []
            for rate in cfg.rates:
                for gw in gateways:
                    row = {"gateway": gw.name, **asyncio.run(_open_loop(gw, rate, cfg.duration_s))}
                    latency.append(row)
                    say(f"  {gw.name:<11} {rate:>4}/s  p50 {row['p50_ms']:>7} ms  "
                        f"p99 {row['p99_ms']:>7} ms  errors {row['errors']}")  # fmt: skip
            added = []
            for rate in cfg.rates:
                base = next(r for r in latency if r["gateway"] == "envoy" and r["rate"] == rate)
                for gw in gateways[1:]:
                    row = next(r for r in latency if r["gateway"] == gw.name and r["rate"] == rate)
                    added.append({"gateway": gw.name, "rate": rate,
                                  "p50_ms": round(row["p50_ms"] - base["p50_ms"], 2),
                                  "p99_ms": round(row["p99_ms"] - base["p99_ms"], 2)})  # fmt: skip
            cost = {}
            for gw in gateways[1:]:
                for stream in (False, True):
                    key = f"{gw.name}{'-streamed' if stream else ''}"
                    cost[key] = _cost(gw, cfg, stream, metrics_port)
                    say(f"  cost {key:<20} {cost[key]}")
            per_chunk = None
            duplex, plain = cost.get("epp-duplex-streamed"), cost.get("epp-streamed")
            if duplex and plain and duplex["chunks_per_request"]:
                extra = duplex["epp_cpu_ms_per_request"] - plain["epp_cpu_ms_per_request"]
                per_chunk = round(extra / duplex["chunks_per_request"], 3)
        finally:
            for proc in reversed(procs):
                proc.stop()
    return {
        "config": asdict(cfg),
        "latency": latency,
        "added": added,
        "cost": cost,
        "duplex_cpu_ms_per_chunk": per_chunk,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "cpus": os.cpu_count(),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
