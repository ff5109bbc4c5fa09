"""The figures as the operator's page and ``poller status`` both show them: one age
format, the engine an endpoint is registered with, its labels, its state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from poller.reader.view import View

__all__ = [
    "fmt_age",
    "labels_text",
    "lora_text",
    "models_text",
    "pct",
    "stat",
    "registry_engine",
    "shown_state",
    "with_entries",
]


def fmt_age(ms: float | None) -> str:
    """An age in one format everywhere (this page, ``poller status``): ``12.3s`` under a
    minute, ``4m05s`` under an hour, ``2h03m`` beyond."""
    if ms is None:
        return "-"
    ms = int(ms)
    if ms < 60_000:
        return f"{ms // 100 / 10:.1f}s"  # truncated: 59.99 s is not yet "60.0s"
    if ms < 3_600_000:
        return f"{ms // 60_000}m{(ms // 1000) % 60:02d}s"
    return f"{ms // 3_600_000}h{(ms // 60_000) % 60:02d}m"


def pct(value: Any) -> str:
    return "-" if value is None else f"{float(value) * 100:.1f}"


def with_entries(view: View) -> dict[str, Any]:
    """``view.to_dict()`` with each endpoint's registry ``url``, ``labels`` and
    ``registry_engine`` (None: the pollers' default engine), so the page and ``poller
    status`` say which engine an endpoint is even when it has never been read."""
    out = view.to_dict()
    for row in out["endpoints"]:
        entry = view.endpoints[row["id"]].entry
        row["url"] = None if entry is None else entry.url
        row["labels"] = {} if entry is None else dict(entry.labels)
        row["registry_engine"] = None if entry is None else entry.engine
    return out


def registry_engine(endpoint: Mapping[str, Any]) -> str:
    """The engine to show: the registry's, else the one the stats were read with, else
    ``default`` (the entry names none: the pollers' scrape.default_engine)."""
    if endpoint.get("url") is None and not endpoint.get("engine"):
        return "-"  # no readable entry and no stats: nothing is known
    return str(endpoint.get("registry_engine") or endpoint.get("engine") or "default")


def labels_text(labels: Mapping[str, Any] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items())) or "-"


def shown_state(endpoint: Mapping[str, Any]) -> str:
    """The reader's state, or ``sleeping`` for fresh stats that say the engine sleeps."""
    stats = endpoint.get("stats") or {}
    if endpoint["state"] == "fresh" and str(stats.get("sleeping", "")) in ("1", "True"):
        return "sleeping"
    return str(endpoint["state"])


def stat(endpoint: Mapping[str, Any], name: str) -> Any:
    stats = endpoint.get("stats")
    return None if not stats else stats.get(name)


def lora_text(endpoint: Mapping[str, Any]) -> str:
    stats = endpoint.get("stats") or {}
    if stats.get("lora_max") is None and not stats.get("lora_running"):
        return "-"
    running = ", ".join(str(a) for a in stats.get("lora_running") or ()) or "none"
    waiting = stats.get("lora_waiting") or ()
    text = running + (f" (waiting: {', '.join(str(a) for a in waiting)})" if waiting else "")
    return text + (f" / max {stats['lora_max']}" if stats.get("lora_max") is not None else "")


def models_text(models: Sequence[str] | None, shown: int = 3) -> str:
    """The stats' model names (what a pick for a model matches: docs/schema.md) as one
    cell: the first ``shown``, then how many more."""
    names = list(models or ())
    if not names:
        return "-"
    text = ", ".join(names[:shown])
    return text + (f" (+{len(names) - shown} more)" if len(names) > shown else "")
