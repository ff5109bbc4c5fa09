"""The prefix workload (lab/poller_lab/prefix/) through the peers, at 1 and 8 replicas.

The prefix bench's engines, conversations and load rule, with two changes the routers
need: the engines have a port each (a router takes engine base URLs) and their KV usage
is ``occupancy`` (the blocks running requests hold, as vLLM's; ``kv_usage="cached"``
runs the variant whose gauge also counts idle cached blocks). Per (policy, replicas):
the prefix bench's own gateways for ``oracle`` and ``prefix-shared`` (the picker with
the prompt and the placements shared through Redis: the README's gateway), or a peer's
routers, one or one per replica; the driver spreads each conversation's turns over
them by a hash, as the prefix bench does. Per row: the fleet's hit rate (the engines'
counters), TTFT and latency p50/p99, failed requests and, for a peer, its routers' CPU
per request.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from poller_lab.bench_fleet import sync_registry
from poller_lab.embedded import redis_for, start_pollers, start_sim, workdir
from poller_lab.peers.install import install
from poller_lab.peers.routers import Peer, start_routers
from poller_lab.prefix import fleet
from poller_lab.prefix.fleet import MODEL, PrefixConfig
from poller_lab.prefix.run import _Bench, _wait_fresh, workload_capacity

__all__ = ["PREFIX_PEERS", "PrefixPeersConfig", "run_prefix_peers"]

NS = "prefix"
PREFIX_PEERS: tuple[Peer, ...] = (
    Peer("smg", "cache_aware"),
    Peer("smg", "cache_aware", per_gateway=True),
    Peer("smg", "cache_aware", per_gateway=True, mesh=True),
    Peer("vllm-router", "cache_aware"),
    Peer("vllm-router", "cache_aware", per_gateway=True),
)


@dataclass(frozen=True)
class PrefixPeersConfig:
    replicas: tuple[int, ...] = (1, 8)
    workload: str = "prefix-heavy"
    load: float = 0.7
    kv_usage: str = "occupancy"
    policies: tuple[str, ...] = ("oracle", "prefix-shared")
    peers: tuple[Peer, ...] = PREFIX_PEERS
    prefix: PrefixConfig = PrefixConfig()

    @classmethod
    def quick(cls) -> PrefixPeersConfig:
        return cls(
            replicas=(2,),
            peers=(Peer("smg", "cache_aware"),),
            prefix=PrefixConfig.quick(),
        )


class _Routers(_Bench):
    """The prefix bench's cell, through gateways that serve no ``/stats``: routers."""

    routers = False

    async def _gateway_stats(
        self, http: aiohttp.ClientSession, gateways: list[str]
    ) -> list[dict[str, Any]]:
        if not self.routers:
            return await super()._gateway_stats(http, gateways)
        return [{"requests": 0, "fallbacks": 0, "errors": 0, "cpu_ns": [], "placements": {}}
                for _ in gateways]  # fmt: skip


def _specs(kv_usage: str) -> list[dict[str, Any]]:
    return [{**s, "style": "port", "kv_usage": kv_usage} for s in fleet.engine_specs()]


def _row(name: str, replicas: int, cell: dict[str, Any]) -> dict[str, Any]:
    keep = ("requests", "ok", "errors", "hit_rate", "ttft_p50_s", "ttft_p99_s", "p50_s",
            "p99_s", "pick_cpu_p50_us", "conversations", "turns_cut")  # fmt: skip
    return {"policy": name, "replicas": replicas, **{k: cell.get(k) for k in keep}}


HEADER = (
    f"{'policy':<32} {'R':>2} {'reqs':>5} {'hit':>6} {'ttft p50':>8} {'ttft p99':>8} "
    f"{'p50 s':>6} {'p99 s':>6} {'failed':>6} {'cpu/req us':>10}"
)


def format_row(row: dict[str, Any]) -> str:
    def num(key: str, digits: int = 3) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    return (
        f"{row['policy']:<32} {row['replicas']:>2} {row['requests']:>5} {num('hit_rate'):>6} "
        f"{num('ttft_p50_s'):>8} {num('ttft_p99_s'):>8} {num('p50_s'):>6} {num('p99_s'):>6} "
        f"{row['errors']:>6} {num('cpu_per_request_us', 1):>10}"
    )


def run_prefix_peers(cfg: PrefixPeersConfig, redis_url: str | None, out: TextIO) -> dict[str, Any]:
    started = time.monotonic()
    pcfg = replace(cfg.prefix, gateways=cfg.replicas, workloads=(cfg.workload,),
                   loads=(cfg.load,))  # fmt: skip
    capacity = {cfg.workload: workload_capacity(pcfg, cfg.workload)}
    rows: list[dict[str, Any]] = []
    with workdir("poller-peers-prefix-") as work, redis_for(work, redis_url) as (url, _):
        root = Path(os.environ.get("LAB_PEERS_DIR") or work / "peers")
        venvs = {p.package: install(p.package, root) for p in cfg.peers}
        specs = work / "specs.json"
        specs.write_text(json.dumps(_specs(cfg.kv_usage)))
        sim, admin, registry = start_sim(work, 1, "vllm", extra=["--spec-file", str(specs)])
        try:
            asyncio.run(sync_registry(url, NS, registry))
            bench = _Routers(pcfg, work, url, admin, capacity)
            bench.urls = {e["id"]: e["url"] for e in json.loads(registry.read_text())}
            (poller, _), *_ = start_pollers(work, url, NS, ["prefix-0"], interval_s=1.0)
            try:
                _wait_fresh(url, len(fleet.ENGINES))
                out.write(f"prefix through the peers: {cfg.workload}, load {cfg.load:g}, "
                          f"KV usage {cfg.kv_usage}\n{HEADER}\n")  # fmt: skip
                for replicas in cfg.replicas:
                    rows += _replicas(bench, cfg, replicas, venvs, work, out)
            finally:
                poller.stop()
        finally:
            sim.stop()
    return {
        "config": {
            "replicas": cfg.replicas,
            "workload": cfg.workload,
            "load": cfg.load,
            "kv_usage": cfg.kv_usage,
            "peers": [p.name() for p in cfg.peers],
            "prefix": pcfg.to_dict(),
        },  # fmt: skip
        "rows": rows,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def _replicas(
    bench: _Routers,
    cfg: PrefixPeersConfig,
    replicas: int,
    venvs: dict[str, Path],
    work: Path,
    out: TextIO,
) -> list[dict[str, Any]]:
    rows = []
    for policy in cfg.policies:
        bench.routers = False
        procs, urls = bench.start_gateways(policy, replicas)
        try:
            cell = asyncio.run(bench.cell(urls, cfg.workload, cfg.load))
        finally:
            for p in procs:
                p.stop()
        row = _row(policy, replicas, cell)
        row["cpu_per_request_us"] = row["pick_cpu_p50_us"]
        rows.append(row)
        out.write(format_row(row) + "\n")
        out.flush()
    chosen: Sequence[Peer] = [p for p in cfg.peers if replicas > 1 or not p.per_gateway]
    for peer in chosen:
        bench.routers = True
        folder = work / f"routers-{peer.name().replace('/', '-')}-{replicas}"
        folder.mkdir()
        engines = [bench.urls[i] for i in fleet.candidates()]
        count = replicas if peer.per_gateway else 1
        routers = start_routers(peer, venvs[peer.package], engines, count, folder, MODEL)
        try:
            routers.cpu_mark()
            # The driver sends to the gateway a hash names: give it one address per
            # replica, each its router (or all the one router).
            urls = [routers.urls[i % count] for i in range(replicas)]
            cell = asyncio.run(bench.cell(urls, cfg.workload, cfg.load))
            cpu = routers.cpu_since_mark_s()
        finally:
            routers.stop()
        row = _row(peer.name(), replicas, cell)
        row["routers"] = count
        row["cpu_per_request_us"] = round(sum(cpu) / max(1, cell["requests"]) * 1e6, 1)
        rows.append(row)
        out.write(format_row(row) + "\n")
        out.flush()
    return rows
