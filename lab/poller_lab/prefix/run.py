"""``poller bench --section prefix``: gateway processes route conversations on prefixes.

Real processes on loopback: an embedded Redis, the simulator serving ``fleet.ENGINES``
(engines with a prefix cache), one ``poller run``, and per (policy, gateway count) that
many gateway processes (gateway.py); for ``envoy-epp``, besides them, one Envoy in front
of as many ``poller epp`` replicas (the engines then get a port each: Envoy dials
addresses). The bench process drives the conversations through
the gateways (driver.py). A cell is one workload at one load: every engine's prefix cache
is emptied first (the gateways' placements must notice), the conversations start over
``duration_s`` seconds and run to their last turn (none sent later than ``tail_s`` after
that: ``turns_cut`` counts the turns left out); requests sent in the first
``warmup_s`` seconds are not counted, and the engines' prefix-cache counters and the
gateways' counters are read when the warm-up ends and when the cell does.

Load: the conversations start at ``load x C / (mean turns)`` per second, where ``C`` is
the fleet's capacity in requests per second at the workload's best achievable hit rate
(workload.py: one unbounded cache; every request holds a slot for its uncached prefill
and its decode). A policy that finds fewer cached blocks needs more than that capacity.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from poller.errors import ConfigError
from poller_lab.bench_fleet import sync_registry
from poller_lab.embedded import Proc, redis_for, start_pollers, start_sim, wait_until, workdir
from poller_lab.prefix import fleet
from poller_lab.prefix.driver import drive
from poller_lab.prefix.fleet import MODEL, POLICIES, PrefixConfig, uses_envoy
from poller_lab.prefix.report import HEADER, format_row, summarise, targets
from poller_lab.prefix.trace import folder as trace_folder
from poller_lab.prefix.workload import KINDS, capacity_per_s, conversations, start_times

__all__ = ["run_prefix"]

NS = "prefix"
#: Conversations the capacity of a workload is measured on.
_REFERENCE = 200


def _check(cfg: PrefixConfig) -> None:
    unknown = [p for p in cfg.policies if p not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown prefix policies {unknown}; known: {', '.join(POLICIES)}")
    bad = [w for w in cfg.workloads if w not in KINDS]
    if bad:
        raise ConfigError(f"unknown workloads {bad}; known: {', '.join(KINDS)}")
    if not cfg.warmup_s < cfg.duration_s:
        raise ConfigError("warmup_s must be shorter than duration_s")


def workload_capacity(cfg: PrefixConfig, workload: str) -> tuple[float, float]:
    """(requests per second at the best hit rate, mean turns per conversation)."""
    reference = conversations(workload, _REFERENCE, cfg.seed, cfg.shape)
    capacity = capacity_per_s(reference, fleet.slots(), fleet.PREFILL_TPS, fleet.SPEED_TPS)
    turns = sum(len(c.turns) for c in reference) / len(reference)
    return capacity, turns


class _Bench:
    def __init__(
        self,
        cfg: PrefixConfig,
        work: Path,
        redis_url: str,
        admin: str,
        capacity: dict[str, tuple[float, float]],
    ) -> None:
        self.cfg, self.work, self.redis_url, self.admin = cfg, work, redis_url, admin
        self.urls: dict[str, str] = {}
        self.group = 0
        self.capacity = capacity

    # --- gateways ----------------------------------------------------------------------

    def start_gateways(self, policy: str, count: int) -> tuple[list[Proc], list[str]]:
        self.group += 1
        folder = self.work / f"gateways-{self.group}"
        folder.mkdir()
        procs: list[Proc] = []
        envoy_url = None
        if uses_envoy((policy,)):
            from poller_lab.envoy import start_envoy_with_epps

            procs, envoy_url = start_envoy_with_epps(folder, self.redis_url, NS, count)
        for i in range(count):
            config = {
                "policy": policy,
                "seed": self.cfg.seed * 1000 + self.group * 10 + i,
                "model": MODEL,
                "candidates": fleet.candidates(),
                "urls": self.urls,
                "admin_url": self.admin,
                "redis_url": self.redis_url,
                "namespace": NS,
                "ready": str(folder / f"ready-{i}"),
                "envoy_url": envoy_url,
            }
            path = folder / f"gateway-{i}.json"
            path.write_text(json.dumps(config))
            args = [sys.executable, "-m", "poller_lab.prefix.gateway", str(path)]
            procs.append(Proc(f"gateway-{i}", args, folder / f"gateway-{i}.log"))
        try:
            ready = [folder / f"ready-{i}" for i in range(count)]

            def up() -> bool:
                dead = [p for p in procs if not p.alive()]  # the EPPs and Envoy too
                if dead:
                    raise RuntimeError(f"gateway exited before starting: see {dead[0].log}")
                return all(r.exists() for r in ready)

            wait_until(up, 60 + 10 * count, "the gateways to listen")
        except BaseException:
            for p in procs:
                p.stop()
            raise
        return procs, [f"http://127.0.0.1:{r.read_text()}" for r in ready]

    # --- one cell ----------------------------------------------------------------------

    async def _json(
        self, http: aiohttp.ClientSession, method: str, url: str, body: Any = None
    ) -> Any:
        async with http.request(method, url, json=body) as r:
            r.raise_for_status()
            return await r.json()

    async def _counters(self, http: aiohttp.ClientSession) -> dict[str, tuple[int, int]]:
        out = {}
        for endpoint_id in fleet.candidates():
            s = await self._json(
                http, "GET", f"{self.admin}/admin/endpoints/{endpoint_id}/snapshot"
            )
            out[endpoint_id] = (s["prefix_cache_hits"], s["prefix_cache_queries"])
        return out

    async def _gateway_stats(
        self, http: aiohttp.ClientSession, gateways: list[str]
    ) -> list[dict[str, Any]]:
        return [await self._json(http, "GET", g + "/stats?reset=1") for g in gateways]

    async def cell(self, gateways: list[str], workload: str, load: float) -> dict[str, Any]:
        cfg = self.cfg
        capacity, turns = self.capacity[workload]
        rate = load * capacity / turns
        n = min(cfg.max_conversations, max(1, math.ceil(rate * cfg.duration_s)))
        # The same conversations for every policy and gateway count of this cell.
        seed = cfg.seed * 100 + KINDS.index(workload) * 10 + round(load * 10)
        convs = conversations(workload, n, seed, cfg.shape)
        starts = start_times(n, rate, seed)
        async with aiohttp.ClientSession() as http:
            await self._json(http, "POST", self.admin + "/admin/prefix/reset", {})
            await self._json(http, "POST", self.admin + "/admin/queue/reset", {})
            await self._gateway_stats(http, gateways)
            t0 = time.monotonic()
            marks: dict[str, Any] = {}
            traced = trace_folder()
            if traced is not None:
                traced.mkdir(parents=True, exist_ok=True)
                with (traced / "cells.jsonl").open("a", encoding="utf-8") as f:
                    label = f"seed {cfg.seed}, {len(gateways)} gateways, {workload}, {load:g}"
                    mark = {"group": f"gateways-{self.group}", "t0": t0,
                            "warmup_s": cfg.warmup_s, "label": label}  # fmt: skip
                    f.write(json.dumps(mark) + "\n")

            async def at_warmup() -> None:
                await asyncio.sleep(max(0.0, t0 + cfg.warmup_s - time.monotonic()))
                marks["t"] = time.monotonic()
                marks["counters"] = await self._counters(http)
                stats = await self._gateway_stats(http, gateways)
                marks["placements"] = [s["placements"] for s in stats]

            warm = asyncio.create_task(at_warmup())
            records, cut = await drive(
                convs, starts, gateways, MODEL, t0, cfg.duration_s + cfg.tail_s
            )
            await warm
            end_t = time.monotonic()
            counters = await self._counters(http)
            stats = await self._gateway_stats(http, gateways)
            queues = await self._json(http, "GET", self.admin + "/admin/queue")
        row = summarise(
            records,
            cfg.warmup_s,
            (marks["counters"], counters),
            stats,
            (marks["placements"], [s["placements"] for s in stats]),
            max(1e-3, end_t - marks["t"]),
        )
        row["conversations"] = n
        row["turns_cut"] = cut
        row["conversations_per_s"] = round(rate, 3)
        row["largest_queue"] = max(q["peak_waiting"] for q in queues["endpoints"].values())
        return row


def _wait_fresh(redis_url: str, count: int, timeout_s: float = 60.0) -> None:
    from poller.reader import StatsReader

    async def fresh() -> int:
        reader = StatsReader.from_url(redis_url, NS)
        try:
            view = await reader.snapshot()
        finally:
            await reader.aclose()
        return sum(1 for e in view.endpoints.values() if e.state == "fresh")

    wait_until(lambda: asyncio.run(fresh()) >= count, timeout_s, "every engine fresh", 0.2)


def run_prefix(cfg: PrefixConfig, redis_url: str | None, out: TextIO) -> dict[str, Any]:
    """Run every cell, printing a row per cell to ``out`` as it goes; returns the report."""
    _check(cfg)
    cells = fleet.cells(cfg)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    capacity = {w: workload_capacity(cfg, w) for w in cfg.workloads}
    out.write(f"prefix: {len(cells)} cells, conversations starting over {cfg.duration_s:g} s "
              f"(the first {cfg.warmup_s:g} s not counted)\n")  # fmt: skip
    with workdir("poller-prefix-") as work, redis_for(work, redis_url) as (url, _):
        specs = work / "specs.json"
        # Envoy dials addresses: with a policy through it, every engine a port of its own.
        style = "port" if uses_envoy(cfg.policies) else "path"
        specs.write_text(json.dumps(fleet.engine_specs(style)))
        sim, admin, registry = start_sim(work, 1, "vllm", extra=["--spec-file", str(specs)])
        try:
            asyncio.run(sync_registry(url, NS, registry))
            bench = _Bench(cfg, work, url, admin, capacity)
            for workload, (per_s, turns) in capacity.items():
                out.write(f"  {workload}: capacity {per_s:.1f} requests/s at its best hit "
                          f"rate, {turns:.2f} turns per conversation\n")  # fmt: skip
            out.write(HEADER + "\n")
            out.flush()
            bench.urls = {e["id"]: e["url"] for e in json.loads(registry.read_text())}
            (poller, _), *_ = start_pollers(work, url, NS, ["prefix-0"], interval_s=cfg.interval_s)
            try:
                _wait_fresh(url, len(fleet.ENGINES))
                _run_cells(bench, cells, rows, out)
            finally:
                poller.stop()
        finally:
            sim.stop()
    lines = targets(rows, cfg.gateways)
    out.write("targets:\n" + "\n".join(lines) + "\n")
    out.flush()
    return {
        "config": cfg.to_dict(),
        "capacity_per_s": {w: round(c, 2) for w, (c, _) in capacity.items()},
        "load_rule": "conversations start at load x (requests/s the fleet serves at the "
        "workload's best achievable hit rate) / (mean turns per conversation)",
        "rows": rows,
        "targets": lines,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def _run_cells(
    bench: _Bench, cells: list[tuple[str, int, str, float]], rows: list[dict[str, Any]],
    out: TextIO,
) -> None:  # fmt: skip
    groups: dict[tuple[str, int], list[tuple[str, float]]] = {}
    for policy, gateways, workload, load in cells:
        groups.setdefault((policy, gateways), []).append((workload, load))
    for (policy, count), group in groups.items():
        procs, urls = bench.start_gateways(policy, count)
        try:
            for workload, load in group:
                if out.isatty():
                    out.write(f"  {policy}, {count} gateways, {workload}, load {load:g} ...\r")
                    out.flush()
                row = asyncio.run(bench.cell(urls, workload, load))
                row = {"policy": policy, "gateways": count, "workload": workload, "load": load,
                       **row}  # fmt: skip
                rows.append(row)
                out.write(format_row(row) + "\n")
                out.flush()
        finally:
            for p in procs:
                p.stop()
