"""The prefix benchmark's engines, its configuration and its cells.

Six simulated vLLM engines of unequal size serve the benchmark's model: 2 large (8 slots),
2 medium (4), 2 small (2); each decodes 50 tokens per second per running request,
prefills 4,000 uncached prompt tokens per second, and keeps 256 KV blocks (4,096 tokens)
per slot, which is also its prefix cache. No background load: every request and every
prefix-cache counter on an engine is the gateways'.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from poller_lab.prefix.workload import KINDS, Shape

__all__ = [
    "DEFAULT_POLICIES",
    "ENGINES",
    "MODEL",
    "POLICIES",
    "PrefixConfig",
    "cells",
    "engine_specs",
    "uses_envoy",
]

MODEL = "bench/model-a"
#: (id, running slots)
ENGINES: tuple[tuple[str, int], ...] = (
    ("large-0", 8),
    ("large-1", 8),
    ("medium-0", 4),
    ("medium-1", 4),
    ("small-0", 2),
    ("small-1", 2),
)
SPEED_TPS = 50.0
PREFILL_TPS = 4000.0
BLOCKS_PER_SLOT = 256
#: The policies, in the report's order (policies.py describes them).
POLICIES = ("round-robin", "picker", "prefix-own", "prefix-shared", "envoy-epp", "oracle")
#: Those a run without ``--policy`` measures: ``envoy-epp`` needs Envoy and the ``epp``
#: extra, and runs when named.
DEFAULT_POLICIES = tuple(p for p in POLICIES if p != "envoy-epp")


@dataclass(frozen=True)
class PrefixConfig:
    gateways: tuple[int, ...] = (1, 8)
    workloads: tuple[str, ...] = KINDS
    loads: tuple[float, ...] = (0.7, 0.9)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    #: Seconds during which conversations start; each then runs to its last turn.
    duration_s: float = 30.0
    #: Requests sent before this many seconds into a cell (cold caches) are not counted.
    warmup_s: float = 8.0
    #: No turn is sent later than this many seconds after ``duration_s`` (bounds a cell).
    tail_s: float = 60.0
    shape: Shape = field(default_factory=Shape)
    max_conversations: int = 2000
    interval_s: float = 1.0
    seed: int = 1

    @classmethod
    def quick(cls) -> PrefixConfig:
        return cls(
            gateways=(2,),
            loads=(0.7,),
            duration_s=5.0,
            warmup_s=1.0,
            tail_s=30.0,
            shape=Shape(min_turns=2, max_turns=3, think_s=0.5, answer_tokens=16.0),
            max_conversations=60,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["shape"] = {k: getattr(self.shape, k) for k in self.shape.__dataclass_fields__}
        return out


def uses_envoy(policies: tuple[str, ...]) -> bool:
    return "envoy-epp" in policies


def engine_specs(style: str = "path") -> list[dict[str, Any]]:
    """The simulator's spec file: vLLM endpoints with a prefix cache, path-style (one
    port for all) or a port each (``port``: what Envoy needs, which dials addresses)."""
    return [
        {
            "id": i,
            "engine": "vllm",
            "style": style,
            "capacity": slots,
            "speed_tps": SPEED_TPS,
            "prefill_tps": PREFILL_TPS,
            "kv_blocks": BLOCKS_PER_SLOT * slots,
            "model": MODEL,
            "load": 0,
        }
        for i, slots in ENGINES
    ]


def slots() -> int:
    return sum(s for _, s in ENGINES)


def candidates() -> list[str]:
    return [i for i, _ in ENGINES]


def cells(cfg: PrefixConfig) -> list[tuple[str, int, str, float]]:
    """(policy, gateways, workload, load) in run order: one set of gateway processes per
    (policy, gateways), serving every workload and load in turn."""
    return [
        (policy, gateways, workload, load)
        for policy, gateways in itertools.product(cfg.policies, cfg.gateways)
        for workload, load in itertools.product(cfg.workloads, cfg.loads)
    ]
