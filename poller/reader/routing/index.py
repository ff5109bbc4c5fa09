"""The picker's index of a view: who may take a request, per model, kept current.

A pick must not scan the view (1,000 endpoints cost ~0.5 ms to walk in Python; a pick
has ~20 us). The index classifies each endpoint once per change of its records and keeps,
per model asked for, the eligible endpoints in bags by LoRA tier and saturation;
a pick draws two of them. Freshness runs out without any change: each slot carries the
Redis time its stats stop being fresh, and a draw that meets an expired slot drops it
(its next stats write brings it back).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable

from poller.reader.view.records import EndpointView
from poller.schema.stats import EndpointStats

__all__ = ["TIERS", "Bag", "Index", "ModelIndex", "Slot"]

INF = math.inf
#: LoRA tiers in the Gateway API Inference Extension's order: the adapter is
#: running, waiting to load, could load into a free slot, or would need a slot freed.
TIERS = 4
#: Relative capacity is clamped to this range: a wrong figure must not take all traffic.
WEIGHT_MIN, WEIGHT_MAX = 0.05, 20.0


class Slot:
    """One eligible endpoint in the picker's index: the numbers its last stats said
    (read from the cache's decoded ``EndpointView``, never decoded again) and what this
    index makes of them (weight, saturation)."""

    __slots__ = (
        "capacity",
        "fresh_until_ms",
        "full",
        "id",
        "kv",
        "lora_free",
        "lora_running",
        "lora_waiting",
        "models",
        "prefix_hits",
        "prefix_queries",
        "requests",
        "running",
        "saturated",
        "scraped_at_ms",
        "waiting",
        "weight",
    )

    def __init__(self, endpoint_id: str, stats: EndpointStats, fresh_until_ms: float) -> None:
        self.id = endpoint_id
        #: The page's running and waiting requests, as of its scrape.
        self.running, self.waiting = stats.running, stats.waiting
        self.requests = stats.running + stats.waiting
        self.kv = stats.kv_cache_usage
        capacity = stats.kv_capacity_tokens
        self.capacity = capacity if capacity is not None and capacity > 0 else None
        self.weight = 1.0  # set by the index, relative to the fleet's median capacity
        self.scraped_at_ms = stats.scraped_at_ms
        self.fresh_until_ms = fresh_until_ms
        #: Saturated by the page's own rule (waiting or KV usage at their bounds).
        self.saturated = False
        #: The page's KV usage at its bound (``max_kv_cache_usage``).
        self.full = False
        self.models = stats.models
        self.lora_running = stats.lora_running
        self.lora_waiting = stats.lora_waiting
        lora_max = stats.lora_max
        self.lora_free = lora_max is not None and len(stats.lora_running) < lora_max
        #: The prefix-cache counters (going back: the engine's cache was reset).
        self.prefix_queries = stats.prefix_cache_queries_total
        self.prefix_hits = stats.prefix_cache_hits_total

    def tier(self, model: str | None, adapter: bool) -> int | None:
        """This endpoint's LoRA tier for ``model`` (lower is better), None if it does
        not serve it. ``adapter``: the model is a LoRA adapter somewhere in the fleet; for
        a base model, every endpoint listing it is one tier (no slot is needed)."""
        if model is None:
            return 2
        if model in self.lora_running:
            return 0
        if model in self.lora_waiting:
            return 1
        if model in self.models:
            return (2 if self.lora_free else 3) if adapter else 2
        return None

    def __repr__(self) -> str:
        return f"Slot({self.id!r}, requests={self.requests}, weight={self.weight:.2f})"


class Bag:
    """Entries with O(1) add, remove and uniform draw (swap-remove over a list)."""

    __slots__ = ("items", "pos", "wmax")

    def __init__(self) -> None:
        self.items: list[Slot] = []
        self.pos: dict[str, int] = {}
        self.wmax = 0.0  # an upper bound of the weights: rejection sampling needs no more

    def add(self, slot: Slot) -> None:
        self.pos[slot.id] = len(self.items)
        self.items.append(slot)
        if slot.weight > self.wmax:
            self.wmax = slot.weight

    def remove(self, endpoint_id: str) -> None:
        at = self.pos.pop(endpoint_id, None)
        if at is None:
            return
        last = self.items.pop()
        if at < len(self.items):
            self.items[at] = last
            self.pos[last.id] = at


class ModelIndex:
    """The eligible endpoints for one model: a (not saturated, saturated) bag per tier."""

    __slots__ = ("adapter", "bags", "model", "where")

    def __init__(self, model: str | None, slots: Iterable[Slot]) -> None:
        self.model = model
        listed = list(slots)
        self.adapter = model is not None and any(
            model in e.lora_running or model in e.lora_waiting for e in listed
        )
        self.bags = [(Bag(), Bag()) for _ in range(TIERS)]
        self.where: dict[str, Bag] = {}  # endpoint id -> the bag holding it
        for slot in listed:
            self.put(slot)

    def put(self, slot: Slot) -> bool:
        """File ``slot`` (already dropped from the bags); False when the model turned out
        to be an adapter, which changes the tiers of the others: rebuild then."""
        tier = slot.tier(self.model, self.adapter)
        if tier is None:
            return True
        if tier < 2 and not self.adapter:
            return False
        bag = self.where[slot.id] = self.bags[tier][slot.saturated]
        bag.add(slot)
        return True

    def drop(self, endpoint_id: str) -> None:
        bag = self.where.pop(endpoint_id, None)
        if bag is not None:
            bag.remove(endpoint_id)


class Index:
    """Every eligible endpoint of one view and the per-model bags built from them.

    ``fresh_until`` says until when (Redis ms) an endpoint may be used, or None when it
    may not (failing, stale, no stats): the source (cache or view) decides.
    """

    def __init__(
        self,
        views: Iterable[EndpointView],
        fresh_until: Callable[[EndpointView], float | None],
        max_waiting: int,
        max_kv_cache_usage: float,
        max_models: int = 64,
    ) -> None:
        self._fresh_until = fresh_until
        self._max_waiting = max_waiting
        self._max_kv = max_kv_cache_usage
        self._max_models = max_models
        self.version = -1  # the cache version the index reflects (set by its owner)
        self.picked_ms = -INF  # Redis ms of the last pick on it (set by its owner)
        self.slots: dict[str, Slot] = {}
        for view in views:
            slot = self._slot(view)
            if slot is not None:
                self.slots[slot.id] = slot
        #: Requests (running + waiting) the view shows on the eligible endpoints.
        self.requests = sum(e.requests for e in self.slots.values())
        capacities = [e.capacity for e in self.slots.values() if e.capacity is not None]
        #: The fleet's median capacity: the unit of weights, and what unknown counts as.
        self.median_capacity = statistics.median(capacities) if capacities else None
        kvs = [e.kv for e in self.slots.values() if e.kv is not None]
        #: What an unknown KV usage scores as: the fleet's median (0 when none is known,
        #: where it cannot decide anything: every endpoint is equally unknown).
        self.median_kv = statistics.median(kvs) if kvs else 0.0
        for slot in self.slots.values():
            self._weigh(slot)
        self.models: dict[str | None, ModelIndex] = {}

    def _slot(self, view: EndpointView) -> Slot | None:
        stats = view.stats
        if stats is None or stats.sleeping:
            return None
        fresh_until = self._fresh_until(view)
        if fresh_until is None:
            return None
        slot = Slot(view.id, stats, fresh_until)
        kv = slot.kv
        slot.full = kv is not None and kv >= self._max_kv
        slot.saturated = stats.waiting >= self._max_waiting or slot.full
        return slot

    def _weigh(self, slot: Slot) -> None:
        median = self.median_capacity
        if slot.capacity is None or median is None:
            slot.weight = 1.0
        else:
            slot.weight = min(WEIGHT_MAX, max(WEIGHT_MIN, slot.capacity / median))
        if slot.kv is None:
            slot.kv = self.median_kv

    def model(self, model: str | None) -> ModelIndex:
        index = self.models.get(model)
        if index is None:
            if len(self.models) >= self._max_models:
                self.models.clear()  # many one-off models: start over, never grow unbounded
            index = self.models[model] = ModelIndex(model, self.slots.values())
        return index

    def update(self, endpoint_id: str, view: EndpointView | None) -> None:
        """The endpoint's records changed (``view`` None: it left the registry)."""
        slot = None if view is None else self._slot(view)
        old = self.slots.pop(endpoint_id, None)
        if old is not None:
            self.requests -= old.requests
        if slot is not None:
            self._weigh(slot)
            self.slots[endpoint_id] = slot
            self.requests += slot.requests
        for name, index in list(self.models.items()):
            index.drop(endpoint_id)
            if slot is not None and not index.put(slot):
                del self.models[name]  # rebuilt on the next pick of that model
