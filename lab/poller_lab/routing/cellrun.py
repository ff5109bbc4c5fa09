"""One policy on one cell of the real-process family: replica processes, a shared start,
their records, and what they add up to.

The replicas (replica.py) are given their arrivals; the outside client, when the fleet
has one, is one more replica process (policy ``outside``). Everything this module starts
is stopped by pid before it returns, on failure too.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from poller_lab.bench_fleet import percentile
from poller_lab.embedded import Proc, wait_until
from poller_lab.routing.fleets import Arrival, Arrivals
from poller_lab.routing.replica import REQUEST_TIMEOUT_S

__all__ = ["go", "replica_config", "run_replicas", "summarise_cell"]


def replica_config(
    base: Mapping[str, Any], index: int, arrivals: Sequence[Arrival], folder: Path
) -> dict[str, Any]:
    name = "outside" if base["policy"] == "outside" else f"replica-{index}"
    return {
        **base,
        "arrivals": [[a.at_s, a.tokens, i, a.target] for i, a in enumerate(arrivals)],
        "duration_s": max((a.at_s for a in arrivals), default=0.0) + 1,
        "max_requests": len(arrivals),
        "rate_per_s": 1.0,  # unused: the arrivals are given
        "ready": str(folder / f"ready-{name}"),
        "go": str(folder / "go"),
        "out": str(folder / f"out-{name}.json"),
        "name": name,
    }


def go(procs: Sequence[Proc], readies: Sequence[Path], folder: Path) -> float:
    """Wait until every replica is ready, then give them one start time (returned)."""

    def ready() -> bool:
        dead = [p for p in procs if not p.alive()]
        if dead:
            raise RuntimeError(f"a replica exited before starting: see {dead[0].log}")
        return all(r.exists() for r in readies)

    wait_until(ready, 60 + 10 * len(procs), "the replicas to be ready", 0.05)
    start = time.time() + 0.5
    tmp = folder / "go.tmp"
    tmp.write_text(repr(start))
    tmp.rename(folder / "go")  # atomic: a replica never reads half a number
    return start


def run_replicas(
    configs: Sequence[dict[str, Any]], folder: Path, timeout_s: float
) -> tuple[float, dict[str, list[dict[str, Any]]]]:
    """Start one process per config, start them together, wait for them to end; returns
    (the start in Unix seconds, records per replica name)."""
    procs = []
    try:
        for cfg in configs:
            path = folder / f"{cfg['name']}.json"
            path.write_text(json.dumps(cfg))
            args = [sys.executable, "-m", "poller_lab.routing.replica", str(path)]
            procs.append(Proc(cfg["name"], args, folder / f"{cfg['name']}.log"))
        start = go(procs, [Path(c["ready"]) for c in configs], folder)
        # A replica waits for its last requests up to their timeout and 10 s more
        # (replica.py); past that and a margin for a loaded machine, it is stuck.
        deadline = time.monotonic() + timeout_s + REQUEST_TIMEOUT_S + 40
        outs = [Path(c["out"]) for c in configs]

        def written() -> bool:
            # A replica writes its records before it shuts down: its file is the end.
            for proc, out in zip(procs, outs, strict=True):
                if not out.exists() and not proc.alive():
                    code = proc.popen.returncode
                    raise RuntimeError(f"replica failed (exit {code}): see {proc.log}")
            return all(out.exists() for out in outs)

        try:
            wait_until(written, deadline - time.monotonic(), "the replicas' records", 0.1)
        except TimeoutError:
            late = [p.log for p, out in zip(procs, outs, strict=True) if not out.exists()]
            raise TimeoutError(f"no records from {len(late)} replicas: see {late[0]}") from None
    finally:
        for p in procs:
            p.stop()
    return start, {c["name"]: json.loads(Path(c["out"]).read_text()) for c in configs}


def _q(values: Sequence[float], q: float, digits: int = 3) -> float | None:
    return round(percentile(values, q), digits) if values else None


def summarise_cell(
    records: Sequence[Mapping[str, Any]], start: float, warmup_s: float
) -> dict[str, Any]:
    """The figures of the gateways' requests sent after the warm-up: latency and time
    to first token of those answered 200, failures, where they went (and each engine's
    time-to-first-token p99: where the waits were), CPU per choice."""
    counted = [r for r in records if r["sent_at"] >= start + warmup_s]
    ok = [r for r in counted if r["status"] == 200]
    latency = [r["latency_s"] for r in ok]
    first = [r["first_s"] for r in ok if r["first_s"] is not None]
    cpu_us = [r["cpu_ns"] / 1000 for r in counted if r["cpu_ns"]]
    split = Counter(r["endpoint"] for r in counted)
    waits: dict[str, list[float]] = {}
    for r in ok:
        if r["first_s"] is not None:
            waits.setdefault(r["endpoint"], []).append(r["first_s"])
    seen = [r["seen"] for r in counted if "seen" in r]
    trace = {}
    if seen:
        # What the view showed at the picks: how often every candidate's page said KV
        # >= 0.8 (nothing "free" to the picker's rule), and the chosen page's KV then.
        trace = {
            "picks_seen": len(seen),
            "mean_saturated_pages": round(sum(x["saturated"] for x in seen) / len(seen), 2),
            "chosen_kv_ge_0.8": sum(1 for x in seen if (x["chosen"].get("kv") or 0) >= 0.8),
        }
    return {
        "requests": len(counted),
        "ok": len(ok),
        "failed": len(counted) - len(ok),
        "p50_s": _q(latency, 0.5),
        "p99_s": _q(latency, 0.99),
        "ttft_p50_s": _q(first, 0.5),
        "ttft_p99_s": _q(first, 0.99),
        "cpu_per_pick_p50_us": _q(cpu_us, 0.5, 1),
        "cpu_per_pick_p99_us": _q(cpu_us, 0.99, 1),
        "split": dict(sorted(split.items())),
        "ttft_p99_by_endpoint_s": {e: _q(w, 0.99) for e, w in sorted(waits.items())},
        "view_at_pick": trace,
    }


def gateway_records(per_replica: Mapping[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The records of the gateways' requests (the outside client's left out)."""
    return [r for name, rs in per_replica.items() if name != "outside" for r in rs]


def arrivals_for(arr: Arrivals) -> list[tuple[str, list[Arrival]]]:
    """(policy override or "", arrivals) per process: each gateway, then the outside."""
    out: list[tuple[str, list[Arrival]]] = [("", a) for a in arr.per_gateway]
    if arr.outside:
        out.append(("outside", arr.outside))
    return out
