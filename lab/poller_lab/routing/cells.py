"""The routing family's cells: engine mixes and the factors' levels, the documented
fractional design (``design()``), the factorial (``full_design()``) and the CI's
``quick_design()``; lab/poller_lab/routing/family.py runs them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["LEVELS", "MIXES", "Cell", "design", "full_design", "iter_design", "quick_design"]

#: (slots, speed) per engine: a request of size s takes s / speed seconds.
MIXES: dict[str, tuple[tuple[int, float], ...]] = {
    # Six engines of 8, 8, 4, 4, 2 and 2 slots (28), equal speed.
    "six": ((8, 1.0), (8, 1.0), (4, 1.0), (4, 1.0), (2, 1.0), (2, 1.0)),
    # Dominated by one large engine.
    "one-large": ((32, 1.0), (2, 1.0), (2, 1.0), (2, 1.0), (2, 1.0)),
    # Many one-slot engines.
    "one-slot": tuple((1, 1.0) for _ in range(16)),
    # Unequal speeds: the slow engines take twice as long (their size says nothing).
    "mixed-speed": ((8, 1.0), (8, 1.0), (4, 1.0), (4, 1.0), (4, 1.0), (2, 0.5), (2, 0.5)),
}


@dataclass(frozen=True)
class Cell:
    mix: str
    service: str  # "exp" or "lognormal"
    outside: float  # share of the load from outside the gateways
    lag_s: float
    gateways: int
    load: float
    interval_s: float

    def name(self) -> str:
        return (
            f"{self.mix} {self.service} out={self.outside:g} lag={self.lag_s:g} "
            f"R={self.gateways} load={self.load:g} int={self.interval_s:g}"
        )


LEVELS: dict[str, tuple[Any, ...]] = {
    "mix": tuple(MIXES),
    "service": ("exp", "lognormal"),
    "outside": (0.0, 0.3),
    "lag_s": (0.0, 1.0),
    "gateways": (1, 4, 8, 16),
    "load": (0.7, 0.9),
    "interval_s": (1.0, 2.0),
}


def full_design() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(*LEVELS.values())]


def design() -> list[Cell]:
    """The fractional design, every level of every factor:

    1. 16 runs crossing mix x gateways (4 x 4), with the five two-level factors set by a
       2^(5-1) half fraction (resolution V: interval = service x outside x lag x load),
       the 16 sign rows in standard order assigned along the 16 (mix, gateways) pairs;
    2. the targets: every mix at 90 % load and 8 gateways, both service times, 0 % and
       30 % outside (lag 1 s, interval 1 s);
    3. every mix at 90 % load with 1 and 16 gateways (exponential, no outside, lag 1 s,
       interval 1 s), for "16 gateways no worse than one".
    """
    cells: list[Cell] = []
    pairs = list(itertools.product(LEVELS["mix"], LEVELS["gateways"]))
    for i, (mix, gateways) in enumerate(pairs):
        a, b, c, d = ((i >> k) & 1 for k in range(4))
        e = a ^ b ^ c ^ d
        cells.append(
            Cell(mix, ("exp", "lognormal")[a], (0.0, 0.3)[b], (0.0, 1.0)[c], gateways,
                 (0.7, 0.9)[d], (1.0, 2.0)[e])
        )  # fmt: skip
    for mix in MIXES:
        for service, outside in itertools.product(("exp", "lognormal"), (0.0, 0.3)):
            cells.append(Cell(mix, service, outside, 1.0, 8, 0.9, 1.0))
        for gateways in (1, 16):
            cells.append(Cell(mix, "exp", 0.0, 1.0, gateways, 0.9, 1.0))
    return list(dict.fromkeys(cells))


def quick_design() -> list[Cell]:
    return [
        Cell("six", "exp", 0.0, 1.0, 4, 0.9, 1.0),
        Cell("one-slot", "lognormal", 0.3, 0.0, 2, 0.7, 2.0),
    ]


def iter_design(name: str) -> Iterator[Cell]:
    yield from {"quick": quick_design, "full": full_design}.get(name, design)()
