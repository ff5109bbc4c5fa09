"""One pick: what it reads, how it judges, and the one loop that chooses.

A ``Pick`` is made per request from the index (routing/indexer.py), the model asked
for, the load model (routing/models.py: its score for this pick, its saturation rule,
its draw) and the caller's candidates. ``choose`` walks the saturation passes and the
LoRA tiers in order (docs/reader.md, "The picker"): the first tier with an endpoint that
may take the request gives the choice, by the load model's draw. Prefix affinity
(routing/affinity.py) reads the same ``Pick`` after ``choose``; ``ranked`` orders the
alternatives to a choice (the fallbacks a proxy tries on a retry).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container

from poller.reader.routing.draw import Bags, fewest, two_choices
from poller.reader.routing.index import TIERS, Bag, Index, ModelIndex, Slot
from poller.reader.routing.models import LoadModel, Score
from poller.reader.routing.options import WhenSaturated

__all__ = ["Pick"]


class Pick:
    """The state of one pick (built, read, dropped: never kept between picks)."""

    __slots__ = (
        "_saturated",
        "allowed",
        "candidates",
        "index",
        "judge_ms",
        "load",
        "models",
        "rng",
        "score",
        "when_saturated",
    )

    def __init__(
        self,
        index: Index,
        model: str | None,
        judge_ms: float,
        load: LoadModel,
        score: Score,
        rng: random.Random,
        when_saturated: WhenSaturated,
        candidates: list[str] | None = None,
    ) -> None:
        self.index = index
        self.models: ModelIndex = index.model(model)
        #: The Redis ms freshness is judged at.
        self.judge_ms = judge_ms
        self.load = load
        self.score = score
        self.rng = rng
        self.when_saturated = when_saturated
        #: The caller's candidates, in order (None: any endpoint).
        self.candidates = candidates
        #: The same as a set, for the checks of prefix affinity (None: any).
        self.allowed: Container[str] | None = None if candidates is None else set(candidates)
        self._saturated: Callable[[Slot], bool] | None = None

    @property
    def saturated(self) -> Callable[[Slot], bool]:
        """Whether an endpoint is saturated, for this pick (the load model's ``judge``,
        asked on first use: a pick that sheds nothing never asks)."""
        judged = self._saturated
        if judged is None:
            judged = self._saturated = self.load.judge(self.index)
        return judged

    def choose(self) -> str | None:
        """The endpoint for the request, or None: none may take it."""
        if self.candidates is not None:
            return self._among(self.candidates)
        load, models, rng, score, judge_ms = (
            self.load,
            self.models,
            self.rng,
            self.score,
            self.judge_ms,
        )
        shed = self.when_saturated == "none"
        bags_of, scan = models.bags, load.scan
        if load.page_rule:  # the index's bags are the model's: one bag a pass
            for full in (0, 1):
                if full and shed:
                    return None
                for tier in range(TIERS):
                    bag = bags_of[tier][full]
                    if not bag.items:
                        continue
                    if scan:
                        chosen = fewest(rng, ((bag, None),), judge_ms, models, score, True)
                    else:
                        chosen = two_choices(rng, bag, judge_ms, models, score)
                    if chosen is not None:
                        return chosen
            return None
        # The load alone chooses: a tier's two bags as one, saturated endpoints left out
        # only to shed (docs/reader.md, "The Router").
        keep = self._unsaturated() if shed else None
        for tier in range(TIERS):
            open_bag, saturated_bag = bags_of[tier]
            if not (open_bag.items or saturated_bag.items):
                continue  # no endpoint in this tier (a base model's 0 and 1)
            bags: Bags = ((open_bag, keep), (saturated_bag, keep))
            chosen = fewest(rng, bags, judge_ms, models, score, scan)
            if chosen is not None:
                return chosen
        return None

    def _unsaturated(self) -> Callable[[Slot], bool]:
        saturated = self.saturated
        return lambda slot: not saturated(slot)

    def vetoed(self, slot: Slot) -> bool:
        """Saturated in the sense that orders the choice (and bounds prefix affinity):
        always on the page's rule; with the load model's own, only when it sheds."""
        if self.load.page_rule or self.when_saturated == "none":
            return bool(self.saturated(slot))
        return False

    def _among(self, candidates: list[str]) -> str | None:
        """The same choice limited to ``candidates`` (a scan of them, not of the view)."""
        groups: dict[tuple[bool, int], Bag] = {}
        vetoed = self.vetoed
        for slot, tier in self.usable(candidates):
            groups.setdefault((vetoed(slot), tier), Bag()).add(slot)
        if not groups:
            return None
        full, tier = min(groups)
        if full and self.when_saturated == "none":
            return None
        bag = groups[full, tier]
        if self.load.scan:
            return fewest(self.rng, ((bag, None),), self.judge_ms, None, self.score)
        return two_choices(self.rng, bag, self.judge_ms, None, self.score)

    def usable(self, ids: list[str]) -> list[tuple[Slot, int]]:
        """The slots of ``ids`` (once each) that may take the request, with their tier."""
        slots, judge_ms = self.index.slots, self.judge_ms
        model, adapter = self.models.model, self.models.adapter
        out = []
        for endpoint_id in dict.fromkeys(ids):
            slot = slots.get(endpoint_id)
            if slot is None or slot.fresh_until_ms < judge_ms:
                continue
            tier = slot.tier(model, adapter)
            if tier is not None:
                out.append((slot, tier))
        return out

    def ranked(self, first: str, n: int) -> list[str]:
        """Up to ``n`` endpoints other than ``first`` that may take the request, best
        first by the same order as ``choose`` (saturation, tier, then load): the ones a
        proxy tries in turn when ``first`` refuses. Linear in the model's endpoints."""
        if n <= 0:
            return []
        ids = self.candidates if self.candidates is not None else list(self.models.where)
        vetoed, score = self.vetoed, self.score
        keyed = []
        for slot, tier in self.usable(ids):
            if slot.id == first:
                continue
            full = vetoed(slot)
            if full and self.when_saturated == "none":
                continue
            keyed.append(((full, tier, score(slot)), slot.id))
        keyed.sort()
        return [endpoint_id for _, endpoint_id in keyed[:n]]
