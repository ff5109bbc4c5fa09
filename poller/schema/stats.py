"""What one scrape of one endpoint says, and its Redis hash form (schema v1).

``Signals`` is what an engine mapping extracts from a page (pure data, no timing).
``EndpointStats`` and ``Failure`` are what readers get back from the
``P:stats:<id>`` and ``P:failure:<id>`` hashes; the field names are the schema's.
Absent values (a metric the engine does not publish, or a NaN/sentinel) are simply
missing from the hash and ``None`` here: never a made-up number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from poller.util.text import digits

__all__ = [
    "FAILURE_FIELDS",
    "FAILURE_REASONS",
    "STATS_FIELDS",
    "EndpointStats",
    "Failure",
    "Signals",
    "format_counts",
    "format_number",
    "prefix_hit_rate",
    "stats_fields",
]

#: The failure reasons of the schema, in the order a scrape can meet them.
FAILURE_REASONS = (
    "config",
    "unreachable",
    "timeout",
    "auth",
    "http_status",
    "too_large",
    "parse",
    "contract",
)


@dataclass(frozen=True, slots=True)
class Signals:
    """The load signals one page yields; every fraction is 0..1, counts are requests."""

    engine: str
    running: int
    waiting: int
    kv_cache_usage: float | None = None
    #: The engine's own hit-rate gauge, used when it publishes no counters.
    prefix_cache_hit_rate: float | None = None
    #: Raw cumulative counters (tokens or blocks, as the engine counts them).
    prefix_cache_hits_total: float | None = None
    prefix_cache_queries_total: float | None = None
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    lora_max: int | None = None
    models: tuple[str, ...] = ()
    #: Requests queued in front of the engine (LMDeploy), already counted in ``waiting``.
    api_waiting: int | None = None
    #: vLLM sleep mode: True when none of the engines is awake; None where unsaid.
    sleeping: bool | None = None
    #: KV-cache capacity in tokens (blocks x tokens per block where the engine counts blocks).
    kv_capacity_tokens: int | None = None
    #: Waiting requests per reason the engine gives (vLLM); empty where unpublished.
    waiting_by_reason: dict[str, int] = field(default_factory=dict, hash=False)
    #: signal -> the metric name it was read from (for `poller check`).
    sources: dict[str, str] = field(default_factory=dict, compare=False)


def prefix_hit_rate(
    hits: float | None,
    queries: float | None,
    prev_hits: float | None,
    prev_queries: float | None,
    prev_rate: float | None,
) -> float | None:
    """Hit rate over the window since the previous scrape, from cumulative counters.

    With no previous sample the lifetime ratio is the best estimate. A counter that went
    down means the engine restarted: the window starts at zero. A window with no queries
    says nothing new, so the previous rate is kept.
    """
    if hits is None or queries is None:
        return None
    if prev_hits is None or prev_queries is None or queries < prev_queries or hits < prev_hits:
        d_hits, d_queries = hits, queries
    else:
        d_hits, d_queries = hits - prev_hits, queries - prev_queries
    if d_queries <= 0:
        return prev_rate if d_queries == 0 and prev_hits is not None else None
    return min(1.0, max(0.0, d_hits / d_queries))


def format_number(value: float) -> str:
    """Decimal string for Redis: integers without a fraction, others with repr precision."""
    if math.isfinite(value) and abs(value) < 2**53 and value == int(value):
        return str(int(value))
    return repr(float(value))


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v for v in value.split(",") if v) if value else ()


def _float(value: str | None) -> float | None:
    if value is None or value == "":
        return None
    number = float(value)
    if not math.isfinite(number):  # never written by a poller: engines' NaN is absent
        raise ValueError(f"expected a finite number, got {value[:20]!r}")
    return number


def _int(value: str | None) -> int | None:
    return None if value is None or value == "" else int(value)


def _counts(value: str | None) -> dict[str, int]:
    """``reason:count`` pairs joined by commas (the schema's map form)."""
    counts: dict[str, int] = {}
    for pair in _split(value):
        name, sep, count = pair.rpartition(":")
        if not sep or not name or not digits(count):
            raise ValueError(f"expected reason:count pairs, got {pair[:40]!r}")
        counts[name] = int(count)
    return counts


def format_counts(counts: dict[str, int]) -> str:
    """The map form of :func:`_counts`, in name order; names holding ``,`` or ``:`` cannot
    be written unambiguously and are left out (no engine uses them)."""
    return ",".join(f"{k}:{v}" for k, v in sorted(counts.items()) if "," not in k and ":" not in k)


def _bool(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"expected 0 or 1, got {value[:20]!r}")
    return value == "1"


# Plain dataclasses: readers parse them lazily, one endpoint at a time (see reader.py).


@dataclass(frozen=True, slots=True)
class EndpointStats:
    """The ``P:stats:<id>`` hash: the last good scrape of an endpoint."""

    engine: str
    running: int
    waiting: int
    #: Redis clock at the write, Unix ms.
    scraped_at_ms: int
    #: The scrape interval the poller used; readers derive freshness from it.
    interval_ms: int
    poller: str
    token: int
    seq: int
    #: How long the HTTP fetch and parse took on the poller, ms.
    scrape_ms: float = 0.0
    kv_cache_usage: float | None = None
    prefix_cache_hit_rate: float | None = None
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    lora_max: int | None = None
    models: tuple[str, ...] = ()
    prefix_cache_hits_total: float | None = None
    prefix_cache_queries_total: float | None = None
    api_waiting: int | None = None
    #: True: asleep (vLLM sleep mode), never to be routed to; None: the page does not say.
    sleeping: bool | None = None
    #: KV-cache capacity in tokens, the engine's size; None: the engine does not publish it.
    kv_capacity_tokens: int | None = None
    #: Waiting requests per reason the engine gives (vLLM); empty: not published.
    waiting_by_reason: dict[str, int] = field(default_factory=dict, hash=False)

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> EndpointStats:
        """Parse the hash; raises ValueError/KeyError on a malformed one."""
        return cls(
            engine=h["engine"],
            running=int(h["running"]),
            waiting=int(h["waiting"]),
            scraped_at_ms=int(h["scraped_at_ms"]),
            interval_ms=int(h.get("interval_ms") or 1000),
            poller=h.get("poller", ""),
            token=int(h.get("token") or 0),
            seq=int(h.get("seq") or 0),
            scrape_ms=float(h.get("scrape_ms") or 0.0),
            kv_cache_usage=_float(h.get("kv_cache_usage")),
            prefix_cache_hit_rate=_float(h.get("prefix_cache_hit_rate")),
            lora_running=_split(h.get("lora_running")),
            lora_waiting=_split(h.get("lora_waiting")),
            lora_max=_int(h.get("lora_max")),
            models=_split(h.get("models")),
            prefix_cache_hits_total=_float(h.get("prefix_cache_hits_total")),
            prefix_cache_queries_total=_float(h.get("prefix_cache_queries_total")),
            api_waiting=_int(h.get("api_waiting")),
            sleeping=_bool(h.get("sleeping")),
            kv_capacity_tokens=_int(h.get("kv_capacity_tokens")),
            waiting_by_reason=_counts(h.get("waiting_by_reason")),
        )

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class Failure:
    """The ``P:failure:<id>`` hash: the current failure of an endpoint."""

    reason: str
    since_ms: int
    at_ms: int
    count: int
    poller: str
    token: int
    detail: str = ""
    missing: tuple[str, ...] = ()

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> Failure:
        return cls(
            reason=h["reason"],
            since_ms=int(h.get("since_ms") or 0),
            at_ms=int(h.get("at_ms") or 0),
            count=int(h.get("count") or 0),
            poller=h.get("poller", ""),
            token=int(h.get("token") or 0),
            detail=h.get("detail", ""),
            missing=_split(h.get("missing")),
        )

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


#: Field names of each hash, in the order of the schema document (checked by a test).
STATS_FIELDS = tuple(EndpointStats.__slots__)
FAILURE_FIELDS = tuple(Failure.__slots__)


def stats_fields(
    signals: Signals,
    *,
    prefix_cache_hit_rate: float | None,
    scrape_ms: float,
    interval_ms: int,
) -> dict[str, str]:
    """The hash fields a fenced write sets (the script adds time, seq, poller, token)."""
    fields: dict[str, str] = {
        "engine": signals.engine,
        "running": str(signals.running),
        "waiting": str(signals.waiting),
        "scrape_ms": format_number(round(scrape_ms, 3)),
        "interval_ms": str(interval_ms),
    }
    optional: dict[str, float | None] = {
        "kv_cache_usage": signals.kv_cache_usage,
        "prefix_cache_hit_rate": prefix_cache_hit_rate,
        "prefix_cache_hits_total": signals.prefix_cache_hits_total,
        "prefix_cache_queries_total": signals.prefix_cache_queries_total,
        "lora_max": signals.lora_max,
        "api_waiting": signals.api_waiting,
        "sleeping": None if signals.sleeping is None else int(signals.sleeping),
        "kv_capacity_tokens": signals.kv_capacity_tokens,
    }
    for name, value in optional.items():
        if value is not None:
            fields[name] = format_number(value)
    for name, items in (
        ("lora_running", signals.lora_running),
        ("lora_waiting", signals.lora_waiting),
        ("models", signals.models),
    ):
        if items:
            fields[name] = ",".join(items)
    by_reason = format_counts(signals.waiting_by_reason)
    if by_reason:
        fields["waiting_by_reason"] = by_reason
    return fields
