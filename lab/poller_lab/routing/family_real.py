"""``poller bench --section routing``: the routing family on real processes.

Loopback only: an embedded Redis, one simulator serving every fleet's engines
(fleets.py), one ``poller run`` at the interval, and per (cell, policy) the cell's
gateway replica processes (replica.py), plus the outside client where the fleet has one.
Every policy of a cell serves the cell's arrivals (the same times, sizes and senders);
requests sent in the first ``warmup_s`` are not counted. A row per cell: each policy's
p50/p99 latency and time to first token, the under-test policy's and the naive
policy's ratios to the oracle's. The worst cell (the under-test policy's p99 ratio) is
the headline.

Policies: ``oracle`` (every engine's true queue read per request, least expected time
to finish), ``UNDER_TEST`` (policies.py: the README's gateway) and ``naive`` (least own +
shared in flight per slot, naive.py); on request (``--policy``) any other, ``envoy-epp``
among them: the gateways send through one Envoy in front of a ``poller epp`` each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from poller.errors import ConfigError
from poller_lab.bench_fleet import sync_registry
from poller_lab.embedded import (
    Proc,
    process_cpu_s,
    redis_for,
    start_pollers,
    start_sim,
    wait_until,
    workdir,
)
from poller_lab.routing.cellrun import (
    arrivals_for,
    gateway_records,
    replica_config,
    run_replicas,
    summarise_cell,
)
from poller_lab.routing.fleets import FLEETS, Fleet, RealCell, arrivals, design
from poller_lab.routing.policies import POLICIES, UNDER_TEST

__all__ = ["Env", "RealConfig", "fleet_env", "run_policy", "run_real_family"]

NS = "routing-family"
DEFAULT_POLICIES = ("oracle", UNDER_TEST, "naive")


@dataclass(frozen=True)
class RealConfig:
    cells: tuple[RealCell, ...] = field(default_factory=lambda: tuple(design()))
    #: Seconds of arrivals per cell and policy; the first ``warmup_s`` are not counted.
    duration_s: float = 20.0
    warmup_s: float = 2.0
    interval_s: float = 1.0
    policies: tuple[str, ...] = DEFAULT_POLICIES
    seed: int = 1

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["cells"] = [c.name() for c in self.cells]
        return out


@dataclass
class Env:
    """The processes and addresses the cells share."""

    work: Path
    redis_url: str
    admin: str
    urls: dict[str, str]
    redis: Proc | None
    runs: int = 0

    def folder(self) -> Path:
        self.runs += 1
        path = self.work / f"run-{self.runs}"
        path.mkdir()
        return path


def _wait_fresh(redis_url: str, ids: Sequence[str], timeout_s: float = 60.0) -> None:
    from poller.reader import StatsReader

    async def fresh() -> bool:
        reader = StatsReader.from_url(redis_url, NS)
        try:
            view = await reader.snapshot()
        finally:
            await reader.aclose()
        return all(i in view.endpoints and view.endpoints[i].state == "fresh" for i in ids)

    wait_until(lambda: asyncio.run(fresh()), timeout_s, "every engine fresh", 0.2)


@contextlib.contextmanager
def fleet_env(
    fleets: Sequence[Fleet], redis_url: str | None, interval_s: float, prefix: str
) -> Iterator[Env]:
    """Redis, the simulator serving ``fleets`` and one poller, until the block ends."""
    from poller_lab.routing.fleets import engine_specs

    with workdir(prefix) as work, redis_for(work, redis_url) as (url, redis):
        specs = work / "specs.json"
        specs.write_text(json.dumps(engine_specs(list(fleets))))
        sim, admin, registry = start_sim(work, 1, "vllm", extra=["--spec-file", str(specs)])
        try:
            asyncio.run(sync_registry(url, NS, registry))
            urls = {e["id"]: e["url"] for e in json.loads(registry.read_text())}
            (poller, _), *_ = start_pollers(work, url, NS, ["family-0"], interval_s=interval_s)
            try:
                _wait_fresh(url, list(urls))
                yield Env(work, url, admin, urls, redis)
            finally:
                poller.stop()
        finally:
            sim.stop()


@contextlib.contextmanager
def _envoy(env: Env, replicas: int) -> Iterator[str]:
    """One Envoy (deploy/envoy/envoy.yaml) in front of a ``poller epp`` per gateway
    replica, all active, until the block ends; yields the URL the replicas send to. They
    send as to a peer's router: streamed, the engine named by its ``x-sim-endpoint``."""
    from poller_lab.envoy import start_envoy_with_epps

    folder = env.work / f"envoy-{env.runs + 1}"
    folder.mkdir()
    procs, url = start_envoy_with_epps(folder, env.redis_url, NS, replicas)
    try:
        yield url
    finally:
        for proc in procs:
            proc.stop()


def _reset_queues(admin: str) -> None:
    from poller_lab.embedded import http_json

    http_json(admin + "/admin/queue/reset", {})


def run_policy(
    env: Env,
    cell: RealCell,
    policy: str,
    cfg: RealConfig,
    per_replica: Callable[[int], dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """One policy on one cell: (its summary, every process's records);
    ``per_replica(index)`` adds to a gateway replica's config (a peer's router URL)."""
    if policy in POLICIES and POLICIES[policy].uses_envoy:
        with _envoy(env, cell.gateways) as url:
            return run_policy(env, cell, "peer", cfg, lambda _: {"router_url": url})
    fleet = FLEETS[cell.fleet]
    folder = env.folder()
    arr = arrivals(cell, cfg.duration_s, cfg.seed)
    base = {
        "policy": policy,
        "model": fleet.model,
        "candidates": fleet.ids(),
        "urls": {i: env.urls[i] for i in fleet.ids()},
        "admin_url": env.admin,
        "redis_url": env.redis_url,
        "namespace": NS,
        "mean_tokens": fleet.mean_tokens(),
        "stream": True,
        "options": {},
    }
    if policy == "naive":
        slots = dict(zip(fleet.ids(), (s for s, _ in fleet.engines), strict=True))
        base["options"] = {"slots": slots, "key": f"bench:naive:{folder.name}"}
    configs = []
    for index, (override, sent) in enumerate(arrivals_for(arr)):
        seed = cfg.seed * 100_000 + env.runs * 100 + index
        own = {"seed": seed, **(per_replica(index) if per_replica and not override else {})}
        if override:
            own["policy"] = override
        configs.append(replica_config({**base, **own}, index, sent, folder))
    _reset_queues(env.admin)
    redis_cpu0 = process_cpu_s(env.redis.pid) if env.redis is not None else None
    start, records = run_replicas(configs, folder, cfg.duration_s)
    row = summarise_cell(gateway_records(records), start, cfg.warmup_s)
    if redis_cpu0 is not None and env.redis is not None:
        used = process_cpu_s(env.redis.pid) - redis_cpu0
        row["redis_cpu_per_request_us"] = round(used / max(1, row["requests"]) * 1e6, 1)
    return row, records


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 2)


def cell_row(cell: RealCell, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One cell's row: each policy's figures and each one's ratios to the oracle's."""
    fleet = FLEETS[cell.fleet]
    row: dict[str, Any] = {
        "cell": cell.name(),
        "fleet": cell.fleet,
        "gateways": cell.gateways,
        "load": cell.load,
        "outside": fleet.outside,
        "lag_s": fleet.lag_s,
        "sizes": fleet.sizes,
        "policies": results,
    }
    oracle = results.get("oracle")
    if oracle is not None:
        for name, r in results.items():
            if name != "oracle":
                row[f"{name}_p50_x"] = _ratio(r["p50_s"], oracle["p50_s"])
                row[f"{name}_p99_x"] = _ratio(r["p99_s"], oracle["p99_s"])
    return row


def _check(cfg: RealConfig) -> None:
    unknown = [p for p in cfg.policies if p not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown routing policies {unknown}; registered: {', '.join(POLICIES)}")
    if not 0 <= cfg.warmup_s < cfg.duration_s:
        raise ConfigError("the warm-up must be shorter than the cell (--duration)")


HEADER = (
    f"{'cell':<22} {'reqs':>5} {'oracle p50/p99':>14} {'picker p50/p99':>14} {'x p50/p99':>11} "
    f"{'naive p50/p99':>14} {'x p50/p99':>11} {'failed':>6} {'ttft p99 o/p':>13}"
)


def format_row(row: dict[str, Any]) -> str:
    def pair(name: str, a: str = "p50_s", b: str = "p99_s") -> str:
        r = row["policies"].get(name)
        if r is None or r[a] is None or r[b] is None:
            return "-"
        return f"{r[a]:.2f}/{r[b]:.2f}"

    def x(name: str) -> str:
        a, b = row.get(f"{name}_p50_x"), row.get(f"{name}_p99_x")
        return "-" if a is None or b is None else f"{a:.2f}/{b:.2f}"

    failed = sum(r["failed"] for r in row["policies"].values())
    reqs = max(r["requests"] for r in row["policies"].values())
    ttft = "-"
    o, p = row["policies"].get("oracle"), row["policies"].get(UNDER_TEST)
    if o and p and o["ttft_p99_s"] is not None and p["ttft_p99_s"] is not None:
        ttft = f"{o['ttft_p99_s']:.2f}/{p['ttft_p99_s']:.2f}"
    others = "".join(
        f"  {name} {pair(name)} x {x(name)}"
        for name in row["policies"]
        if name not in ("oracle", UNDER_TEST, "naive")
    )
    return (
        f"{row['cell']:<22} {reqs:>5} {pair('oracle'):>14} {pair(UNDER_TEST):>14} "
        f"{x(UNDER_TEST):>11} {pair('naive'):>14} {x('naive'):>11} {failed:>6} {ttft:>13}" + others
    )


def headline(rows: Sequence[dict[str, Any]], policy: str = UNDER_TEST) -> dict[str, Any] | None:
    """The cell where ``policy`` is furthest from the oracle at p99 (then p50)."""
    scored = [r for r in rows if r.get(f"{policy}_p99_x") is not None]
    if not scored:
        return None
    worst = max(scored, key=lambda r: (r[f"{policy}_p99_x"], r[f"{policy}_p50_x"] or 0.0))
    return {
        "cell": worst["cell"],
        "p50_x": worst[f"{policy}_p50_x"],
        "p99_x": worst[f"{policy}_p99_x"],
        "worst_p50_cell": max(scored, key=lambda r: r[f"{policy}_p50_x"] or 0.0)["cell"],
    }


def run_real_family(cfg: RealConfig, redis_url: str | None, out: TextIO) -> dict[str, Any]:
    """Every cell under every policy, a row per cell to ``out`` as it ends."""
    _check(cfg)
    started = time.monotonic()
    fleets = [FLEETS[n] for n in dict.fromkeys(c.fleet for c in cfg.cells)]
    rows = []
    out.write(f"routing, real processes: {len(cfg.cells)} cells x {len(cfg.policies)} "
              f"policies, {cfg.duration_s:g} s each (the first {cfg.warmup_s:g} s not "
              f"counted), seed {cfg.seed}\n{HEADER}\n")  # fmt: skip
    out.flush()
    with fleet_env(fleets, redis_url, cfg.interval_s, "poller-routing-family-") as env:
        for cell in cfg.cells:
            results = {p: run_policy(env, cell, p, cfg)[0] for p in cfg.policies}
            row = cell_row(cell, results)
            rows.append(row)
            out.write(format_row(row) + "\n")
            out.flush()
    top = headline(rows)
    if top is not None:
        out.write(f"worst cell ({UNDER_TEST} against the oracle): {top['cell']}, "
                  f"p50 {top['p50_x']}x, p99 {top['p99_x']}x\n")  # fmt: skip
    return {
        "config": cfg.to_dict(),
        "rows": rows,
        "headline": top,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
