"""The routing benchmark's engines and its configuration.

Eight simulated vLLM engines of unequal size serve the benchmark's model: 2 fast (8 slots),
4 medium (4 slots), 2 slow (2 slots at half the speed); a ninth serves another model and
must never receive a request. Mid-run ``SLEEPER`` goes to sleep and ``FAILER`` starts
failing (HTTP 500 on every route), so the load is a share of what the other six serve.
No background load: every request on an engine is one the replicas sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FAILER", "MODEL", "OTHER_MODEL", "SLEEPER", "RoutingConfig", "engine_specs"]

MODEL = "bench/model-a"
OTHER_MODEL = "bench/model-b"
#: (id, running slots, tokens per second per running request, model)
ENGINES: tuple[tuple[str, int, float, str], ...] = (
    ("fast-0", 8, 50.0, MODEL),
    ("fast-1", 8, 50.0, MODEL),
    ("medium-0", 4, 50.0, MODEL),
    ("medium-1", 4, 50.0, MODEL),
    ("medium-2", 4, 50.0, MODEL),
    ("medium-3", 4, 50.0, MODEL),
    ("slow-0", 2, 25.0, MODEL),
    ("slow-1", 2, 25.0, MODEL),
    ("other-0", 4, 50.0, OTHER_MODEL),
)
SLEEPER = "medium-3"
FAILER = "slow-1"
#: The policies also measured at the other intervals (those present in the registry).
INTERVAL_POLICIES = ("picker", "picker-unshared")


@dataclass(frozen=True)
class RoutingConfig:
    #: Replica counts at the highest load; the lower loads run at ``low_load_replicas``.
    replicas: tuple[int, ...] = (1, 4, 8)
    loads: tuple[float, ...] = (0.7, 0.9)
    low_load_replicas: tuple[int, ...] = (4,)
    interval_s: float = 1.0
    #: Other poller intervals, for the picker at the highest load and most replicas.
    other_intervals_s: tuple[float, ...] = (0.5, 2.0)
    #: None: every registered policy.
    policies: tuple[str, ...] | None = None
    duration_s: float = 30.0
    mean_tokens: float = 20.0
    max_requests: int = 20_000
    seed: int = 1

    @classmethod
    def quick(cls) -> RoutingConfig:
        return cls(
            replicas=(2,),
            loads=(0.5,),
            low_load_replicas=(),
            other_intervals_s=(),
            duration_s=4.0,
            max_requests=400,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def engine_specs(style: str = "path") -> list[dict[str, Any]]:
    """The simulator's spec file: vLLM endpoints, no background load; path-style (one
    port for all), or a port each (``port``: what Envoy needs, which dials addresses)."""
    return [
        {
            "id": i,
            "engine": "vllm",
            "style": style,
            "capacity": slots,
            "speed_tps": speed,
            "model": model,
            "load": 0,
        }
        for i, slots, speed, model in ENGINES
    ]


def capacity_per_s(mean_tokens: float, exclude: tuple[str, ...] = (SLEEPER, FAILER)) -> float:
    """Requests per second the model's engines sustain, without the two that go away."""
    return sum(
        slots * speed / mean_tokens
        for i, slots, speed, model in ENGINES
        if model == MODEL and i not in exclude
    )


def candidates() -> list[str]:
    return [i for i, _, _, model in ENGINES if model == MODEL]


def cells(cfg: RoutingConfig, policies: list[str]) -> list[tuple[str, int, float, float]]:
    """(policy, replicas, load, interval) in run order, grouped by interval."""
    top = max(cfg.loads)
    out: list[tuple[str, int, float, float]] = []
    for load in sorted(cfg.loads, reverse=True):
        for replicas in cfg.replicas if load == top else cfg.low_load_replicas:
            out.extend((p, replicas, load, cfg.interval_s) for p in policies)
    chosen = [p for p in INTERVAL_POLICIES if p in policies]
    for interval in cfg.other_intervals_s:
        out.extend((p, max(cfg.replicas), top, interval) for p in chosen)
    return out
