"""``poller bench --section routing --single-fleet``: gateway replicas route real
requests on the view, one fleet.

Real processes on loopback: an embedded Redis, the simulator serving ``fleet.ENGINES``, one
``poller run`` at the interval under test, and per cell R replica processes
(``replica.py``) sending open-loop Poisson requests at a share of the fleet's capacity.
Mid-run ``SLEEPER`` is put to sleep and ``FAILER`` starts failing; a monitor here reads
the view every 50 ms to learn when it showed each, so requests sent to them afterwards
can be counted. Between cells both are healed and the view is waited for.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from poller.errors import ConfigError
from poller_lab.bench_fleet import sync_registry
from poller_lab.embedded import (
    Proc,
    redis_for,
    start_pollers,
    start_sim,
    wait_until,
    workdir,
)
from poller_lab.routing import fleet
from poller_lab.routing.fleet import FAILER, SLEEPER, RoutingConfig
from poller_lab.routing.policies import POLICIES
from poller_lab.routing.replica import REQUEST_TIMEOUT_S
from poller_lab.routing.report import HEADER, format_row, summarise

__all__ = ["run_routing"]

NS = "routing"
_MONITOR_S = 0.05
_NONE: tuple[str, bool | None, str] = ("", None, "")


class _Bench:
    """The processes and addresses shared by the cells."""

    def __init__(self, cfg: RoutingConfig, work: Path, redis_url: str, admin: str) -> None:
        self.cfg, self.work, self.redis_url, self.admin = cfg, work, redis_url, admin
        self.urls: dict[str, str] = {}
        self.cell = 0
        self.gateway_url: str | None = None

    async def _admin(self, http: aiohttp.ClientSession, path: str, body: Any = None) -> Any:
        async with http.post(self.admin + path, json=body if body is not None else {}) as r:
            r.raise_for_status()
            return await r.json()

    async def _view(self) -> dict[str, tuple[str, bool | None, str]]:
        """id -> (state, sleeping, the current failure's reason or "")."""
        from poller.reader import StatsReader

        reader = StatsReader.from_url(self.redis_url, NS)
        try:
            view = await reader.snapshot()
        finally:
            await reader.aclose()
        return {
            i: (
                e.state,
                e.stats.sleeping if e.stats is not None else None,
                e.failure.reason if e.failure is not None else "",
            )
            for i, e in view.endpoints.items()
        }

    async def heal(self, http: aiohttp.ClientSession, timeout_s: float = 60.0) -> None:
        """Wake the sleeper, stop the failure, and wait until the view shows all fresh."""
        await self._admin(http, f"/admin/endpoints/{SLEEPER}/wake_up")
        await self._admin(http, f"/admin/endpoints/{FAILER}/fault", {"mode": "ok"})
        deadline = time.monotonic() + timeout_s
        while True:
            view = await self._view()
            if len(view) == len(fleet.ENGINES) and all(
                state == "fresh" and not sleeping for state, sleeping, _ in view.values()
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the view never showed every engine fresh and awake: {view}")
            await asyncio.sleep(0.1)

    async def monitor(
        self,
        shown: dict[str, float | None],
        events: dict[str, float],
        until: Callable[[], bool],
    ) -> None:
        """Record when the view first shows the sleeper asleep and the failer failing
        with the fault's HTTP 500 (``http_status``): on a loaded machine a scrape can time
        out before the fault is set, and that is not the view seeing the fault."""
        while not until() and None in shown.values():
            view = await self._view()
            now = time.time()
            if SLEEPER in events and shown[SLEEPER] is None and view.get(SLEEPER, _NONE)[1]:
                shown[SLEEPER] = now
            state, _, reason = view.get(FAILER, _NONE)
            if FAILER in events and shown[FAILER] is None and state == "failing":
                if reason == "http_status":
                    shown[FAILER] = now
            await asyncio.sleep(_MONITOR_S)

    async def cell_run(self, policy: str, replicas: int, load: float) -> dict[str, Any]:
        cfg = self.cfg
        self.cell += 1
        cell_dir = self.work / f"cell-{self.cell}"
        cell_dir.mkdir()
        rate = load * fleet.capacity_per_s(cfg.mean_tokens) / replicas
        gateway: list[Proc] = []
        async with aiohttp.ClientSession() as http:
            await self.heal(http)
            await self._admin(http, "/admin/queue/reset")
            if POLICIES[policy].uses_envoy:
                gateway = await asyncio.to_thread(self._gateway, replicas, cell_dir)
            procs = [self._start(policy, i, rate, cell_dir) for i in range(replicas)]
            try:
                shown: dict[str, float | None] = {SLEEPER: None, FAILER: None}
                events: dict[str, float] = {}
                start = await self._go(procs, cell_dir)
                await _at(start + 0.4 * cfg.duration_s)
                events[SLEEPER] = time.time()
                await self._admin(http, f"/admin/endpoints/{SLEEPER}/sleep", {"level": 1})
                done = asyncio.Event()
                watch = asyncio.create_task(self.monitor(shown, events, done.is_set))
                await _at(start + 0.6 * cfg.duration_s)
                events[FAILER] = time.time()
                await self._admin(http, f"/admin/endpoints/{FAILER}/fault", {"mode": "http500"})
                await _exited(procs, cfg.duration_s + REQUEST_TIMEOUT_S + 30)
                done.set()
                await watch
                queues = await self._get(http, "/admin/queue")
            finally:
                for p in procs + gateway:
                    p.stop()
        records = []
        for i in range(replicas):
            records.extend(json.loads((cell_dir / f"out-{i}.json").read_text()))
        peak = max(q["peak_waiting"] for q in queues["endpoints"].values())
        return summarise(records, fleet.candidates(), shown, events, peak)

    async def _get(self, http: aiohttp.ClientSession, path: str) -> Any:
        async with http.get(self.admin + path) as r:
            r.raise_for_status()
            return await r.json()

    def _gateway(self, replicas: int, cell_dir: Path) -> list[Proc]:
        """An Envoy in front of one ``poller epp`` per replica (all active), ready.
        ``gateway_url`` is where replicas send."""
        from poller_lab.envoy import start_envoy_with_epps

        procs, self.gateway_url = start_envoy_with_epps(cell_dir, self.redis_url, NS, replicas)
        return procs

    def _start(self, policy: str, index: int, rate: float, cell_dir: Path) -> Proc:
        cfg = self.cfg
        replica = {
            "policy": policy,
            "seed": cfg.seed * 100_000 + self.cell * 100 + index,
            "model": fleet.MODEL,
            "candidates": fleet.candidates(),
            "urls": self.urls,
            "admin_url": self.admin,
            "redis_url": self.redis_url,
            "namespace": NS,
            "rate_per_s": rate,
            "duration_s": cfg.duration_s,
            "max_requests": cfg.max_requests,
            "mean_tokens": cfg.mean_tokens,
            "gateway_url": self.gateway_url if POLICIES[policy].uses_envoy else None,
            "ready": str(cell_dir / f"ready-{index}"),
            "go": str(cell_dir / "go"),
            "out": str(cell_dir / f"out-{index}.json"),
        }
        path = cell_dir / f"replica-{index}.json"
        path.write_text(json.dumps(replica))
        args = [sys.executable, "-m", "poller_lab.routing.replica", str(path)]
        return Proc(f"replica-{index}", args, cell_dir / f"replica-{index}.log")

    async def _go(self, procs: list[Proc], cell_dir: Path) -> float:
        """Wait until every replica is ready, then give them one start time (returned)."""
        deadline = time.monotonic() + 60 + 10 * len(procs)
        while not all((cell_dir / f"ready-{i}").exists() for i in range(len(procs))):
            dead = [p for p in procs if not p.alive()]
            if dead:
                raise RuntimeError(f"replica exited before starting: see {dead[0].log}")
            if time.monotonic() > deadline:
                raise TimeoutError("replicas not ready after their start-up allowance")
            await asyncio.sleep(0.05)
        start = time.time() + 0.5
        tmp = cell_dir / "go.tmp"
        tmp.write_text(repr(start))
        tmp.rename(cell_dir / "go")  # atomic: a replica never reads half a number
        return start


async def _at(unix_s: float) -> None:
    await asyncio.sleep(max(0.0, unix_s - time.time()))


async def _exited(procs: list[Proc], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.alive() for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas still running after {timeout_s:g}s")
        await asyncio.sleep(0.1)
    failed = [p for p in procs if p.popen.returncode != 0]
    if failed:
        raise RuntimeError(f"replica failed (exit {failed[0].popen.returncode}): {failed[0].log}")


def _progress(out: TextIO, done: int, total: int, policy: str, r: int, load: float) -> None:
    """On a terminal, which cell runs now (overwritten by its row when it ends)."""
    if out.isatty():
        out.write(f"  [{done + 1}/{total}] {policy}, {r} replicas, load {load:g} ...\r")
        out.flush()


def _policies(cfg: RoutingConfig) -> list[str]:
    names = list(cfg.policies) if cfg.policies else [n for n, d in POLICIES.items() if d.default]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown routing policies {unknown}; registered: {', '.join(POLICIES)}")
    return names


def run_routing(cfg: RoutingConfig, redis_url: str | None, out: TextIO) -> dict[str, Any]:
    """Run every cell, printing a row per cell to ``out`` as it goes; returns the report."""
    policies = _policies(cfg)
    cells = fleet.cells(cfg, policies)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    out.write(f"routing: {len(cells)} cells of {cfg.duration_s:g} s\n{HEADER}\n")
    out.flush()
    with workdir("poller-routing-") as work, redis_for(work, redis_url) as (url, _):
        specs = work / "specs.json"
        # Envoy dials addresses: with a policy through it, every engine a port of its own.
        style = "port" if any(POLICIES[p].uses_envoy for p in policies) else "path"
        specs.write_text(json.dumps(fleet.engine_specs(style)))
        sim, admin, registry = start_sim(work, 1, "vllm", extra=["--spec-file", str(specs)])
        try:
            asyncio.run(sync_registry(url, NS, registry))
            bench = _Bench(cfg, work, url, admin)
            bench.urls = {e["id"]: e["url"] for e in json.loads(registry.read_text())}
            for interval, group in itertools.groupby(cells, key=lambda c: c[3]):
                (poller, _), *_ = start_pollers(
                    work, url, NS, [f"routing-{interval:g}"], interval_s=interval
                )
                try:
                    wait_until(poller.alive, 5, "poller start")
                    for policy, replicas, load, _ in group:
                        _progress(out, len(rows), len(cells), policy, replicas, load)
                        row = asyncio.run(bench.cell_run(policy, replicas, load))
                        row = {"policy": policy, "replicas": replicas, "load": load,
                               "interval_s": interval, **row}  # fmt: skip
                        rows.append(row)
                        out.write(format_row(row) + "\n")  # longer than the progress line
                        out.flush()
                finally:
                    poller.stop()
        finally:
            sim.stop()
    return {
        "config": cfg.to_dict(),
        "capacity_per_s": round(fleet.capacity_per_s(cfg.mean_tokens), 2),
        "sleeper": SLEEPER,
        "failer": FAILER,
        "policies": policies,
        "rows": rows,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
