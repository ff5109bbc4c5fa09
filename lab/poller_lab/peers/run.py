"""``poller bench --section peers``: the routers people run instead, on the family's cells.

The same processes as the real-process family (family_real.py: Redis, the simulator,
one ``poller run``), the same arrivals per cell; per cell the oracle and the policy
under test as there, then each peer (routers.py): its routers started in front of the
cell's engines, every gateway replica sending its requests to its router (one shared
router, or one each), the routers stopped by pid when the cell ends. Per row: p50/p99
latency and time to first token (streamed answers), failed requests, and the CPU per
request: each router process's user+sys over the cell against the under-test policy's
CPU per pick (thread time in its replica) and the Redis CPU per request of that cell.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from poller_lab.peers.install import install
from poller_lab.peers.routers import PEERS, Peer, peers_for, start_routers
from poller_lab.routing.family_real import Env, RealConfig, fleet_env, run_policy
from poller_lab.routing.fleets import FLEETS, RealCell
from poller_lab.routing.policies import UNDER_TEST

__all__ = ["PeersConfig", "default_cells", "run_peers"]


def default_cells() -> list[RealCell]:
    """The family's fleets at 90 % load with 8 gateways: where one router per gateway
    and a shared router both apply."""
    return [RealCell(name, 8, 0.9) for name in FLEETS]


@dataclass(frozen=True)
class PeersConfig:
    cells: tuple[RealCell, ...] = field(default_factory=lambda: tuple(default_cells()))
    peers: tuple[Peer, ...] = PEERS
    duration_s: float = 20.0
    warmup_s: float = 2.0
    interval_s: float = 1.0
    seed: int = 1

    @classmethod
    def quick(cls) -> PeersConfig:
        return cls(
            cells=(RealCell("six", 2, 0.7),),
            peers=(Peer("smg", "least_load"), Peer("vllm-router", "power_of_two")),
            duration_s=4.0,
            warmup_s=0.5,
        )

    def family(self) -> RealConfig:
        return RealConfig(
            cells=self.cells,
            duration_s=self.duration_s,
            warmup_s=self.warmup_s,
            interval_s=self.interval_s,
            policies=("oracle", UNDER_TEST),
            seed=self.seed,
        )

    def to_dict(self) -> dict[str, Any]:
        out = self.family().to_dict()
        out["peers"] = [p.name() for p in self.peers]
        return out


def _peer_row(env: Env, cell: RealCell, peer: Peer, venv: Path, cfg: RealConfig) -> dict[str, Any]:
    fleet = FLEETS[cell.fleet]
    count = cell.gateways if peer.per_gateway else 1
    folder = env.work / f"routers-{env.runs + 1}"
    folder.mkdir()
    workers = [env.urls[i] for i in fleet.ids()]
    routers = start_routers(peer, venv, workers, count, folder, fleet.model)
    try:
        routers.cpu_mark()
        urls = routers.urls
        row, records = run_policy(
            env, cell, "peer", cfg, lambda i: {"router_url": urls[i % len(urls)]}
        )
        cpu = routers.cpu_since_mark_s()
    finally:
        routers.stop()
    sent = sum(len(rs) for name, rs in records.items() if name != "outside")
    row["routers"] = count
    row["router_cpu_per_request_us"] = round(sum(cpu) / max(1, sent) * 1e6, 1)
    row["router_cpu_s"] = [round(c, 3) for c in cpu]
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 2)


HEADER = (
    f"{'cell':<18} {'policy':<32} {'R':>2} {'reqs':>5} {'p50 s':>6} {'p99 s':>6} "
    f"{'p50 x':>5} {'p99 x':>5} {'ttft p50':>8} {'ttft p99':>8} {'failed':>6} {'cpu/req us':>10}"
)


def format_row(row: dict[str, Any]) -> str:
    def num(key: str, digits: int = 3) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    return (
        f"{row['cell']:<18} {row['policy']:<32} {row.get('routers', '-'):>2} "
        f"{row['requests']:>5} {num('p50_s'):>6} {num('p99_s'):>6} {num('p50_x', 2):>5} "
        f"{num('p99_x', 2):>5} {num('ttft_p50_s'):>8} {num('ttft_p99_s'):>8} "
        f"{row['failed']:>6} {num('cpu_per_request_us', 1):>10}"
    )


def _venvs(peers: Sequence[Peer], work: Path, out: TextIO) -> dict[str, Path]:
    root = Path(os.environ.get("LAB_PEERS_DIR") or work / "peers")
    venvs = {}
    for package in dict.fromkeys(p.package for p in peers):
        out.write(f"peers: installing {package} (pinned) under {root} ...\n")
        out.flush()
        venvs[package] = install(package, root)
    return venvs


def run_peers(cfg: PeersConfig, redis_url: str | None, out: TextIO) -> dict[str, Any]:
    """Every cell: the oracle, the policy under test and every peer that applies."""
    started = time.monotonic()
    family = cfg.family()
    fleets = [FLEETS[n] for n in dict.fromkeys(c.fleet for c in cfg.cells)]
    rows: list[dict[str, Any]] = []
    with fleet_env(fleets, redis_url, cfg.interval_s, "poller-peers-") as env:
        venvs = _venvs(cfg.peers, env.work, out)
        out.write(f"peers: {len(cfg.cells)} cells, {cfg.duration_s:g} s each\n{HEADER}\n")
        out.flush()
        for cell in cfg.cells:
            oracle = run_policy(env, cell, "oracle", family)[0]
            results = [
                ("oracle", oracle),
                (UNDER_TEST, run_policy(env, cell, UNDER_TEST, family)[0]),
            ]
            for peer in peers_for(cell.gateways, cfg.peers):
                results.append(
                    (peer.name(), _peer_row(env, cell, peer, venvs[peer.package], family))
                )
            for name, r in results:
                row = {"cell": cell.name(), "policy": name, **r}
                row["p50_x"] = _ratio(r["p50_s"], oracle["p50_s"])
                row["p99_x"] = _ratio(r["p99_s"], oracle["p99_s"])
                if name == UNDER_TEST:
                    pick = r["cpu_per_pick_p50_us"] or 0.0
                    row["cpu_per_request_us"] = round(
                        pick + r.get("redis_cpu_per_request_us", 0.0), 1
                    )
                elif "router_cpu_per_request_us" in r:
                    row["cpu_per_request_us"] = r["router_cpu_per_request_us"]
                rows.append(row)
                out.write(format_row(row) + "\n")
                out.flush()
    return {
        "config": cfg.to_dict(),
        "versions": {p: v.name for p, v in venvs.items()},
        "rows": rows,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
