"""The routing family in real processes: its fleets, its cells, and their arrivals.

Every fleet is a set of simulated vLLM engines (one port each) serving a model of its
own, ``bench/<fleet>``, so one simulator and one poller hold every fleet at once and a
gateway's picks never leave its fleet. The engines' KV usage tracks occupancy
(``kv_usage="occupancy"``, 0.9 x running / slots: a busy vLLM's 0.8-1.0,
docs/simulator.md). A request's size is ``max_tokens``; an engine decodes ``SPEED_TPS``
tokens a second per running request at speed 1 (half that at 0.5), so a fleet's mean
service time on a speed-1 engine is ``mean_s``.

A cell is (fleet, gateways, load); its arrivals (``arrivals``) are drawn once from the
seed and the cell, so every policy of a cell serves the same arrival times, sizes,
gateways and outside targets.
"""

from __future__ import annotations

import fnmatch
import math
import random
from dataclasses import dataclass, field
from typing import Any

from poller.errors import ConfigError

__all__ = [
    "FLEETS",
    "SPEED_TPS",
    "Arrival",
    "Fleet",
    "RealCell",
    "arrivals",
    "design",
    "engine_specs",
    "every_cell",
    "quick_design",
    "select",
]

SPEED_TPS = 50.0
#: The lognormal's sigma for heavy-tailed sizes (its mean is the fleet's, its p99 about
#: 10x the median), and the Pareto's shape (a finite mean, an infinite variance).
LOGNORMAL_SIGMA = 1.0
PARETO_ALPHA = 1.8
SIZES = ("exp", "lognormal", "pareto")


@dataclass(frozen=True)
class Fleet:
    name: str
    #: (running slots, speed factor) per engine.
    engines: tuple[tuple[int, float], ...]
    #: Mean service time (s) of a request on a speed-1 engine.
    mean_s: float = 0.4
    sizes: str = "exp"
    #: Share of the load a client that is not a gateway sends straight to the engines,
    #: spread by capacity.
    outside: float = 0.0
    #: The engines' pages show them as they were this long before the scrape.
    lag_s: float = 0.0
    kv_usage: str = "occupancy"
    #: The KV usage of a full batch (``kv_fill`` of the simulator's spec).
    kv_fill: float = 0.9

    @property
    def model(self) -> str:
        return f"bench/{self.name}"

    def ids(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(len(self.engines))]

    def capacity_per_s(self) -> float:
        """Requests a second the fleet serves at full use."""
        return sum(slots * speed for slots, speed in self.engines) / self.mean_s

    def mean_tokens(self) -> float:
        return self.mean_s * SPEED_TPS


_SIX = ((8, 1.0), (8, 1.0), (4, 1.0), (4, 1.0), (2, 1.0), (2, 1.0))
FLEETS: dict[str, Fleet] = {
    f.name: f
    for f in (
        Fleet("six", _SIX),
        Fleet("one-slot", tuple((1, 1.0) for _ in range(16))),
        Fleet("one-large", ((32, 1.0), (2, 1.0), (2, 1.0), (2, 1.0), (2, 1.0)), mean_s=1.0),
        Fleet("mixed-speed", (*_SIX[:4], (4, 1.0), (2, 0.5), (2, 0.5))),
        Fleet("heavy-tail", _SIX, sizes="lognormal"),
        Fleet("outside", _SIX, outside=0.3),
        Fleet("lag", _SIX, lag_s=1.0),
        # A control, not in the design: the six engines with a KV gauge that never
        # reaches 0.8 (0.5 x running / slots); only the gauge differs from "six".
        Fleet("six-kv-half", _SIX, kv_fill=0.5),
    )
}
#: Fleets run only when a cell filter names them.
CONTROLS = ("six-kv-half",)


@dataclass(frozen=True)
class RealCell:
    fleet: str
    gateways: int
    load: float

    def name(self) -> str:
        return f"{self.fleet}:{self.gateways}:{self.load:g}"


def design() -> list[RealCell]:
    """Every fleet at 90 % load with 1 and 8 gateways and at 70 % with 8; 16 gateways at
    90 % on the six-engine and one-slot fleets (the most gateway processes this machine
    holds beside the engines)."""
    cells = []
    for name in (n for n in FLEETS if n not in CONTROLS):
        cells += [RealCell(name, 1, 0.9), RealCell(name, 8, 0.9), RealCell(name, 8, 0.7)]
    cells += [RealCell("six", 16, 0.9), RealCell("one-slot", 16, 0.9)]
    return cells


def every_cell() -> list[RealCell]:
    """The design and the controls' cells (1 and 8 gateways at 90 %): what ``--cells``
    chooses from."""
    return design() + [RealCell(n, g, 0.9) for n in CONTROLS for g in (1, 8)]


def quick_design() -> list[RealCell]:
    return [RealCell("six", 2, 0.7)]


def _named(pattern: str) -> list[RealCell]:
    """A cell outside the design named in full (``six:4:0.9``): a known fleet, 1-64
    gateways, a load in (0, 1.5]; otherwise none."""
    fleet, _, rest = pattern.partition(":")
    gateways, _, load = rest.partition(":")
    try:
        cell = RealCell(fleet, int(gateways), float(load))
    except ValueError:
        return []
    ok = fleet in FLEETS and 1 <= cell.gateways <= 64 and 0 < cell.load <= 1.5
    return [cell] if ok else []


def select(cells: list[RealCell], patterns: str | None) -> list[RealCell]:
    """The cells whose name (``fleet:gateways:load``) matches one of the comma-separated
    shell patterns, or that a pattern names in full (a known fleet at any number of
    gateways and load); a pattern that matches nothing is an error."""
    if not patterns:
        return cells
    chosen = []
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        found = [c for c in cells if fnmatch.fnmatchcase(c.name(), pattern)]
        if not found:
            found = _named(pattern)
        if not found:
            names = ", ".join(c.name() for c in cells)
            raise ConfigError(f"--cells {pattern!r} matches no cell; the cells: {names}")
        chosen += [c for c in found if c not in chosen]
    return chosen


def engine_specs(fleets: list[Fleet] | None = None) -> list[dict[str, Any]]:
    """The simulator's spec file: every engine of every fleet, a port each, no
    background load."""
    out = []
    for fleet in fleets if fleets is not None else list(FLEETS.values()):
        for endpoint_id, (slots, speed) in zip(fleet.ids(), fleet.engines, strict=True):
            out.append(
                {
                    "id": endpoint_id,
                    "engine": "vllm",
                    "style": "port",
                    "capacity": slots,
                    "speed_tps": SPEED_TPS * speed,
                    "model": fleet.model,
                    "load": 0,
                    "kv_usage": fleet.kv_usage,
                    "kv_fill": fleet.kv_fill,
                    "metrics_lag_s": fleet.lag_s,
                }
            )
    return out


@dataclass(frozen=True)
class Arrival:
    """One request: when (s from the start), its size, and who sends it: a gateway's
    index, or -1 for the outside client with the engine it sends to."""

    at_s: float
    tokens: int
    gateway: int
    target: str = ""


def _size(rng: random.Random, sizes: str, mean: float) -> int:
    if sizes == "exp":
        value = rng.expovariate(1 / mean)
    elif sizes == "lognormal":
        value = rng.lognormvariate(math.log(mean) - LOGNORMAL_SIGMA**2 / 2, LOGNORMAL_SIGMA)
    elif sizes == "pareto":
        scale = mean * (PARETO_ALPHA - 1) / PARETO_ALPHA
        value = scale * rng.paretovariate(PARETO_ALPHA)
    else:
        raise ConfigError(f"unknown sizes {sizes!r}; known: {', '.join(SIZES)}")
    return max(1, round(value))


@dataclass
class Arrivals:
    per_gateway: list[list[Arrival]]
    outside: list[Arrival] = field(default_factory=list)


def arrivals(cell: RealCell, duration_s: float, seed: int) -> Arrivals:
    """The cell's requests over ``duration_s``: Poisson at ``load`` x capacity, sizes
    from the fleet's distribution, each sent by a gateway drawn at random or (a share
    ``outside``) by the outside client to an engine drawn by capacity."""
    fleet = FLEETS[cell.fleet]
    rng = random.Random(f"{seed}:{cell.name()}")
    rate = cell.load * fleet.capacity_per_s()
    weights = [slots * speed for slots, speed in fleet.engines]
    ids = fleet.ids()
    out = Arrivals([[] for _ in range(cell.gateways)])
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        tokens = _size(rng, fleet.sizes, fleet.mean_tokens())
        outside = rng.random() < fleet.outside
        target = rng.choices(ids, weights)[0]
        gateway = rng.randrange(cell.gateways)
        if outside:
            out.outside.append(Arrival(t, tokens, -1, target))
        else:
            out.per_gateway[gateway].append(Arrival(t, tokens, gateway))
