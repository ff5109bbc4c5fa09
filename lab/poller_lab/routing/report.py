"""What one routing cell's requests add up to, and the table they are printed in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from poller_lab.bench_fleet import format_columns, header, percentile

__all__ = ["HEADER", "format_row", "summarise"]


def _q(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def summarise(
    records: Sequence[Mapping[str, Any]],
    candidates: Sequence[str],
    shown_at: Mapping[str, float | None],
    events_at: Mapping[str, float],
    peak_waiting: int,
) -> dict[str, Any]:
    """One cell's figures.

    ``events_at``: endpoint -> Unix time it went to sleep or started failing;
    ``shown_at``: when the view first showed it so (None: not within the cell). A request
    sent to it after that counts in ``after_view``; ``after_view_max_s`` is how long after
    the view showed it the last one was sent.
    """
    ok = [r["latency_s"] for r in records if r["status"] == 200]
    serving = set(candidates)
    after = [
        r["sent_at"] - shown
        for r in records
        if (shown := shown_at.get(r["endpoint"])) is not None and r["sent_at"] > shown
    ]
    cpu_us = [r["cpu_ns"] / 1000 for r in records]
    delays = {
        k: None if (shown := shown_at.get(k)) is None else round(shown - at, 3)
        for k, at in events_at.items()
    }
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(1 for r in records if r["status"] not in (0, 200)),
        "unanswered": sum(1 for r in records if r["status"] == 0),
        # An empty endpoint: the gateway refused the request (sent nowhere).
        "wrong_model": sum(1 for r in records if r["endpoint"] and r["endpoint"] not in serving),
        "status_404": sum(1 for r in records if r["status"] == 404),
        "fallbacks": sum(1 for r in records if r["fallback"]),
        "p50_s": _r(_q(ok, 0.5)),
        "p99_s": _r(_q(ok, 0.99)),
        "max_s": _r(max(ok) if ok else None),
        "after_view": len(after),
        "after_view_max_s": _r(max(after) if after else None),
        "view_showed_after_s": delays,
        "largest_queue": peak_waiting,
        "cpu_per_pick_mean_us": _r(sum(cpu_us) / len(cpu_us) if cpu_us else None, 1),
        "cpu_per_pick_p50_us": _r(_q(cpu_us, 0.5), 1),
        "cpu_per_pick_p99_us": _r(_q(cpu_us, 0.99), 1),
    }


#: (column title, width, key)
_COLUMNS = (
    ("policy", 18, "policy"),
    ("R", 2, "replicas"),
    ("load", 4, "load"),
    ("int s", 5, "interval_s"),
    ("reqs", 5, "requests"),
    ("p50 s", 6, "p50_s"),
    ("p99 s", 6, "p99_s"),
    ("max s", 6, "max_s"),
    ("errors", 6, "errors"),
    ("after view", 10, "after_view"),
    ("late s", 6, "after_view_max_s"),
    ("wrong", 5, "wrong_model"),
    ("queue", 5, "largest_queue"),
    ("cpu us", 6, "cpu_per_pick_p50_us"),
)
HEADER = header(_COLUMNS)


def format_row(row: Mapping[str, Any]) -> str:
    return format_columns(row, _COLUMNS)
