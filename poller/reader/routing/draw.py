"""The draws: endpoints drawn from the index's bags in proportion to their weight, the
better of two, or the least loaded of a few (routing/pick.py chooses which)."""

from __future__ import annotations

import random
from collections.abc import Callable

from poller.reader.routing.index import INF, Bag, ModelIndex, Slot

__all__ = ["SCAN_MAX", "Bags", "fewest", "least", "two_choices"]

#: Draws before a pick stops sampling and lists the bag (most slots expired).
_DRAWS = 24
#: With the fleet's shared counts, a bag up to this size is scanned whole (the least
#: loaded wins, as an oracle would choose); a larger one takes the better of two draws.
SCAN_MAX = 32

#: Bags to choose from as one, each with the test its slots must pass (None: all do).
Bags = tuple[tuple[Bag, Callable[[Slot], bool] | None], ...]


def fewest(
    rng: random.Random,
    bags: Bags,
    judge_ms: float,
    models: ModelIndex | None,
    score: Callable[[Slot], tuple[float, float]],
    scan: bool = True,
) -> str | None:
    """The least loaded live slot of ``bags`` (each with the test its slots must
    pass, None: all do) when they hold up to ``SCAN_MAX`` slots and ``scan``, else the
    better of two weighted draws from them (no list of them built: a pick stays O(1))."""
    total, wmax = 0, 0.0
    for bag, _ in bags:
        total += len(bag.items)
        if bag.wmax > wmax:
            wmax = bag.wmax
    if scan and total <= SCAN_MAX:
        items = [s for bag, keep in bags for s in bag.items if keep is None or keep(s)]
        return least(rng, items, judge_ms, score)
    first = _draw_among(rng, bags, total, wmax, judge_ms, models, None)
    if first is None:
        return None
    second = _draw_among(rng, bags, total, wmax, judge_ms, models, first)
    return first.id if second is None or score(first) <= score(second) else second.id


def _draw_among(
    rng: random.Random,
    bags: Bags,
    total: int,
    wmax: float,
    judge_ms: float,
    models: ModelIndex | None,
    other: Slot | None,
) -> Slot | None:
    """``_draw`` over several bags as one (``total`` slots, weights up to ``wmax``): a
    slot other than ``other`` that passes its bag's test, in proportion to its
    weight; expired ones are dropped."""
    rand = rng.random
    for _ in range(_DRAWS):
        k = int(rand() * total)
        for pair in bags:
            if k < len(pair[0].items):
                break
            k -= len(pair[0].items)
        else:
            return None  # every bag empty
        bag, keep = pair
        slot = bag.items[k]
        if slot.fresh_until_ms < judge_ms:
            if models is not None:
                models.drop(slot.id)  # its next stats write brings it back
            else:
                bag.remove(slot.id)
            total = sum(len(bag.items) for bag, _ in bags)
            continue
        if slot is other or (keep is not None and not keep(slot)):
            continue
        if slot.weight < wmax and rand() * wmax >= slot.weight:
            continue
        return slot
    live = [
        s
        for bag, keep in bags
        for s in bag.items
        if s.fresh_until_ms >= judge_ms and s is not other and (keep is None or keep(s))
    ]
    if not live:
        return None
    return rng.choices(live, [s.weight for s in live])[0]


def least(
    rng: random.Random,
    items: list[Slot],
    judge_ms: float,
    score: Callable[[Slot], tuple[float, float]],
) -> str | None:
    """The least loaded live slot of ``items`` (a scan from a random start, so ties
    spread)."""
    n = len(items)
    if n == 0:
        return None
    start = int(rng.random() * n)
    best: Slot | None = None
    best_score = (INF, INF)
    for i in range(n):
        slot = items[(start + i) % n]
        if slot.fresh_until_ms < judge_ms:
            continue
        value = score(slot)
        if value < best_score:
            best, best_score = slot, value
    return None if best is None else best.id


def two_choices(
    rng: random.Random,
    bag: Bag,
    judge_ms: float,
    models: ModelIndex | None,
    score: Callable[[Slot], tuple[float, float]],
) -> str | None:
    """The less loaded of two slots drawn from ``bag`` (the first on a tie, the only
    one if the bag holds one live slot), or None: no live slot in it."""
    first = _draw(rng, bag, judge_ms, models, None)
    if first is None:
        return None
    second = _draw(rng, bag, judge_ms, models, first)
    return first.id if second is None or score(first) <= score(second) else second.id


def _draw(
    rng: random.Random, bag: Bag, judge_ms: float, models: ModelIndex | None, other: Slot | None
) -> Slot | None:
    """One slot of ``bag`` other than ``other``, in proportion to its weight
    (rejection sampling against the bag's largest weight); expired ones are dropped."""
    rand = rng.random
    items = bag.items
    for _ in range(_DRAWS):
        n = len(items)
        if n == 0 or (n == 1 and items[0] is other):
            return None
        slot = items[int(rand() * n)]
        if slot.fresh_until_ms < judge_ms:
            if models is not None:
                models.drop(slot.id)  # its next stats write brings it back
            else:
                bag.remove(slot.id)
            continue
        if slot is other or (slot.weight < bag.wmax and rand() * bag.wmax >= slot.weight):
            continue
        return slot
    live = [e for e in items if e.fresh_until_ms >= judge_ms and e is not other]
    if not live:
        return None
    return rng.choices(live, [e.weight for e in live])[0]
