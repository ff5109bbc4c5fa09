"""What one prefix cell's requests add up to, the targets, and the table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from poller_lab.bench_fleet import format_columns, header, percentile

__all__ = ["HEADER", "format_row", "summarise", "targets"]


def _q(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q), 3) if values else None


def _delta(end: Mapping[str, float], start: Mapping[str, float], word: str) -> float | None:
    keys = [k for k in end if word in k]
    if not keys:
        return None
    return sum(end[k] - start.get(k, 0) for k in keys)


def summarise(
    records: Sequence[Mapping[str, Any]],
    warmup_s: float,
    counters: tuple[Mapping[str, tuple[int, int]], Mapping[str, tuple[int, int]]],
    gateway_stats: Sequence[Mapping[str, Any]],
    placements: tuple[Sequence[Mapping[str, float]], Sequence[Mapping[str, float]]],
    window_s: float,
) -> dict[str, Any]:
    """One cell's figures over the requests sent after ``warmup_s``.

    ``counters``: each engine's (prefix hits, queries) at the warm-up's end and at the
    cell's; ``gateway_stats``: each gateway's ``/stats`` over the same window;
    ``placements``: each gateway's placement counters at both ends; ``window_s``: its
    length in seconds.
    """
    measured = [r for r in records if r["sent_s"] >= warmup_s]
    ok = [r for r in measured if r["status"] == 200]
    start, end = counters
    hits = sum(end[i][0] - start.get(i, (0, 0))[0] for i in end)
    queries = sum(end[i][1] - start.get(i, (0, 0))[1] for i in end)
    cpu_us = [ns / 1000 for g in gateway_stats for ns in g["cpu_ns"]]
    replicas = max(1, len(gateway_stats))
    before, after = placements
    commands = bytes_ = None
    if after and all(after):
        pairs = zip(after, before, strict=True)
        deltas = [(_delta(a, b, "command"), _delta(a, b, "byte")) for a, b in pairs]
        if all(c is not None for c, _ in deltas):
            commands = sum(c or 0 for c, _ in deltas)
        if all(b is not None for _, b in deltas):
            bytes_ = sum(b or 0 for _, b in deltas)
    per_endpoint: dict[str, int] = {}
    for r in ok:
        per_endpoint[r["endpoint"]] = per_endpoint.get(r["endpoint"], 0) + 1
    return {
        "requests": len(measured),
        "ok": len(ok),
        "errors": len(measured) - len(ok),
        "ttft_p50_s": _q([r["ttft_s"] for r in ok if r["ttft_s"] is not None], 0.5),
        "ttft_p99_s": _q([r["ttft_s"] for r in ok if r["ttft_s"] is not None], 0.99),
        "p50_s": _q([r["latency_s"] for r in ok], 0.5),
        "p99_s": _q([r["latency_s"] for r in ok], 0.99),
        "hit_rate": round(hits / queries, 3) if queries else None,
        "fallbacks": sum(g["fallbacks"] for g in gateway_stats),
        "pick_cpu_p50_us": _q(cpu_us, 0.5),
        "pick_cpu_p99_us": _q(cpu_us, 0.99),
        "redis_commands_per_s_per_replica": None
        if commands is None
        else round(commands / window_s / replicas, 1),
        "redis_bytes_per_replica": None if bytes_ is None else round(bytes_ / replicas),
        "per_endpoint": dict(sorted(per_endpoint.items())),
    }


#: (column title, width, key)
_COLUMNS = (
    ("policy", 13, "policy"),
    ("G", 2, "gateways"),
    ("workload", 12, "workload"),
    ("load", 4, "load"),
    ("reqs", 5, "requests"),
    ("hit", 5, "hit_rate"),
    ("ttft p50", 8, "ttft_p50_s"),
    ("ttft p99", 8, "ttft_p99_s"),
    ("p50 s", 6, "p50_s"),
    ("p99 s", 6, "p99_s"),
    ("err", 4, "errors"),
    ("cut", 4, "turns_cut"),
    ("cmd/s", 6, "redis_commands_per_s_per_replica"),
    ("bytes", 8, "redis_bytes_per_replica"),
    ("cpu us", 6, "pick_cpu_p99_us"),
)
HEADER = header(_COLUMNS)


def format_row(row: Mapping[str, Any]) -> str:
    return format_columns(row, _COLUMNS)


def _find(rows: Sequence[Mapping[str, Any]], **match: Any) -> Mapping[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _line(what: str, value: float | None, bound: float | None, le: bool = True) -> str:
    if value is None or bound is None:
        return f"  not measured  {what}"
    met = value <= bound if le else value >= bound
    sign = "<=" if le else ">="
    return f"  {'met' if met else 'MISSED':<12}  {what}: {value:g} {sign} {bound:g}"


def _times(a: Mapping[str, Any] | None, key: str, factor: float) -> float | None:
    value = None if a is None else a.get(key)
    return None if value is None else round(value * factor, 3)


def targets(rows: Sequence[Mapping[str, Any]], gateways: Sequence[int]) -> list[str]:
    """The issue's targets as met/MISSED lines (``not measured`` when a cell is missing),
    at the most gateways against the fewest."""
    many, one = max(gateways), min(gateways)
    loads = sorted({r["load"] for r in rows})
    lines = []
    for load in loads:
        heavy = {"workload": "prefix-heavy", "load": load}
        shared = _find(rows, policy="prefix-shared", gateways=many, **heavy)
        # Against the fewest gateways only when the run has fewer than the most.
        fewest = None if one == many else _find(rows, policy="prefix-shared", gateways=one, **heavy)
        oracle = _find(rows, policy="oracle", gateways=many, **heavy)
        picker = _find(rows, policy="picker", gateways=many, **heavy)
        own = _find(rows, policy="prefix-own", gateways=many, **heavy)
        hit = None if shared is None else shared.get("hit_rate")
        tag = f"prefix-heavy, {many} gateways, load {load:g}"
        lines += [
            _line(f"{tag}: shared hit rate vs 0.95x {one} gateway's",
                  hit, _times(fewest, "hit_rate", 0.95), le=False),
            _line(f"{tag}: shared hit rate vs 0.9x the oracle's",
                  hit, _times(oracle, "hit_rate", 0.9), le=False),
            _line(f"{tag}: shared TTFT p50 vs 0.3x the load-only picker's",
                  None if shared is None else shared.get("ttft_p50_s"),
                  _times(picker, "ttft_p50_s", 0.3)),
            _line(f"{tag}: shared request p99 vs the load-only picker's",
                  None if shared is None else shared.get("p99_s"), _times(picker, "p99_s", 1.0)),
            _line(f"{tag}: own placements' hit rate (beside shared) vs the anchors' 0.66",
                  None if own is None else own.get("hit_rate"), 0.66, le=False),
        ]  # fmt: skip
        if any(r["policy"] == "envoy-epp" for r in rows):
            lines += _envoy_lines(rows, load, many, one, shared)
        for g in gateways:
            none = {"workload": "no-prefix", "load": load, "gateways": g}
            mine, base = (
                _find(rows, policy="prefix-shared", **none),
                _find(rows, policy="picker", **none),
            )
            for key in ("ttft_p50_s", "ttft_p99_s", "p50_s", "p99_s"):
                lines.append(
                    _line(f"no-prefix, {g} gateways, load {load:g}: shared {key} vs 1.05x picker's",
                          None if mine is None else mine.get(key), _times(base, key, 1.05))
                )  # fmt: skip
    cpu = [r["pick_cpu_p99_us"] for r in rows
           if r["policy"] == "prefix-shared" and r.get("pick_cpu_p99_us") is not None]  # fmt: skip
    lines.append(
        _line("prefix pick CPU p99 (us, prompts of 4,000+ characters), worst cell",
              max(cpu) if cpu else None, 50.0)
    )  # fmt: skip
    return lines


def _envoy_lines(
    rows: Sequence[Mapping[str, Any]],
    load: float,
    many: int,
    one: int,
    shared: Mapping[str, Any] | None,
) -> list[str]:
    """Through Envoy: the most EPP replicas' hit rate against the fewest's, and against
    the library's Router sharing placements at as many gateways (``shared``)."""
    heavy = {"workload": "prefix-heavy", "load": load}
    epp = _find(rows, policy="envoy-epp", gateways=many, **heavy)
    fewest = None if one == many else _find(rows, policy="envoy-epp", gateways=one, **heavy)
    hit = None if epp is None else epp.get("hit_rate")
    tag = f"prefix-heavy, {many} EPP replicas, load {load:g}"
    return [
        _line(f"{tag}: envoy-epp hit rate vs 0.95x {one} replica's",
              hit, _times(fewest, "hit_rate", 0.95), le=False),
        _line(f"{tag}: envoy-epp hit rate vs 0.95x prefix-shared's at {many} gateways",
              hit, _times(shared, "hit_rate", 0.95), le=False),
    ]  # fmt: skip
