"""Where a request goes: a picker for many gateway replicas reading numbers a second old.

Least-loaded on shared, stale numbers herds: every replica sees the same minimum and
sends it everything until the next scrape (Mitzenmacher, "How useful is old
information?", IEEE TPDS 11(1), 2000). The better of two random candidates does not, and
the requests this replica itself started since an endpoint's scrape (``LocalLoad``)
correct its numbers where they are oldest.
"""

from __future__ import annotations

import math
import random
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from poller.errors import ConfigError
from poller.reader.affinity import agreeing, prefer
from poller.reader.cache import ViewCache
from poller.reader.draws import SCAN_MAX, Bags, Draws
from poller.reader.index import INF, TIERS, Bag, Index, ModelIndex, Slot
from poller.reader.indexes import Indexes
from poller.reader.load import LocalLoad, clamp
from poller.reader.placements import Placements
from poller.reader.prefix import block_ids
from poller.reader.scores import (
    fleet_of,
    fleet_score,
    is_full,
    neutral,
    not_full,
    view_load,
)
from poller.reader.share import FleetLoad
from poller.reader.view import EndpointView, View
from poller.util.text import is_number

__all__ = ["SCAN_MAX", "Picker", "WhenSaturated", "check_arguments"]

WhenSaturated = Literal["least_loaded", "none"]
#: The most this replica's recent requests are scaled up by (its share of the fleet's).
SCALE_MAX = 64.0
#: Prefix affinity's bound: an endpoint holding the prompt's prefix takes the request
#: while its load is at most this factor x the load-only choice's + the slack.
PREFIX_LOAD_FACTOR = 1.5
PREFIX_LOAD_SLACK = 2.0


class Picker(Draws, Indexes):
    """Chooses an endpoint for each request; one per gateway replica (it keeps an index
    of each view it is given, and its own random source).

    - **Eligible**: fresh (stale, failing and unknown endpoints are not), not asleep
      (vLLM sleep mode), and with ``model``: listing it, or running or waiting to load it
      as a LoRA adapter. Nothing eligible: None, never an endpoint of another model.
    - **Saturated** (``waiting >= max_waiting`` or ``kv_cache_usage >=
      max_kv_cache_usage``, the Gateway API Inference Extension's 5 and 0.8): skipped
      while any other is eligible. When all are, ``when_saturated="least_loaded"`` (the
      default) chooses among them by the same rule below, ``"none"`` returns None.
    - **LoRA affinity**, in the Inference Extension's order: endpoints running the
      adapter, then waiting to load it, then listing it with a free adapter slot
      (``lora_max``), then the rest listing it. A base model is one tier.
    - **Spread**: two candidates drawn at random, each in proportion to its capacity
      (``kv_capacity_tokens`` relative to the fleet's median; unknown counts as the
      median); the one with the lower load wins. Load = (running + waiting + 1, the
      request being placed, + s x this replica's requests in flight started after the
      endpoint's ``scraped_at_ms``, from ``local``) / relative capacity: what the
      endpoint would hold per unit of capacity with this request. ``s`` is 1 / this
      replica's share of the fleet's requests (the view's running + waiting over its
      own in flight, 1..64): the other replicas sent about as many since the scrape,
      which no view can show yet (``scale_local=False``: s = 1). The load is multiplied
      by ``local.slowness(id)``: how long this replica's requests there took lately,
      relative to its requests anywhere (an engine slower than its size says, or a
      queue grown since the scrape; ``use_latency=False``: 1; on the fleet's shared
      counts its failures, and its speed where the others' counts are read, not heard:
      docs/reader.md). Ties go to the lower KV usage; an engine that publishes none
      (TGI, llama.cpp) counts as the fleet's median KV, never 0 %.
    - **Prefix affinity** (``prompt`` given): the endpoint holding the longest prefix
      of the prompt, by the placements this replica and, through the cache, the others
      recorded (not shared: a hash the replicas agree by), takes the request instead
      when its load is at most ``prefix_load_factor`` x the chosen one's +
      ``prefix_load_slack`` (affinity.py; docs/reader.md, "Prefix affinity"); the choice
      is recorded. Without ``prompt`` nothing of it runs.
    - **Redis lost** (a cache or a view with ``healthy`` False): the last numbers, as
      fresh as they were when Redis last answered, are used for ``stale_grace_s``
      (default 5 s: a Sentinel failover) after that answer, then None.

    Pass the ``ViewCache`` itself for speed: the picker keeps its index current from the
    cache's change log as each change is applied (``ViewCache.follow``: in the reader's
    task, not in a pick; a pick costs a few microseconds at any fleet size). A ``View``
    gets an index built on first pick (linear in its size) and kept while it is the one
    given; a bare mapping, which may change in place, at every pick. ``rng``: a
    ``random.Random`` of the caller's (seeded in tests).

    Threads may share one picker: a pick holds the picker's lock (a few microseconds).
    """

    def __init__(
        self,
        max_waiting: int = 5,
        max_kv_cache_usage: float = 0.8,
        when_saturated: WhenSaturated = "least_loaded",
        stale_grace_s: float = 5.0,
        rng: random.Random | None = None,
        *,
        scale_local: bool = True,
        use_latency: bool = True,
        share: bool = True,
        prefix_load_factor: float = PREFIX_LOAD_FACTOR,
        prefix_load_slack: float = PREFIX_LOAD_SLACK,
    ) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ConfigError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        if not (is_number(max_kv_cache_usage) and 0.0 < max_kv_cache_usage <= 1.0):
            raise ConfigError(f"max_kv_cache_usage must be in (0, 1], got {max_kv_cache_usage!r}")
        if when_saturated not in ("least_loaded", "none"):
            raise ConfigError(
                f"when_saturated must be 'least_loaded' or 'none', got {when_saturated!r}"
            )
        if not (is_number(stale_grace_s) and stale_grace_s >= 0.0 and math.isfinite(stale_grace_s)):
            raise ConfigError(f"stale_grace_s must be >= 0 seconds, got {stale_grace_s!r}")
        for name, value, least in (
            ("prefix_load_factor", prefix_load_factor, 1.0),
            ("prefix_load_slack", prefix_load_slack, 0.0),
        ):
            if not (is_number(value) and value >= least and math.isfinite(value)):
                raise ConfigError(f"{name} must be a number >= {least:g}, got {value!r}")
        self.max_waiting = max_waiting
        self.max_kv_cache_usage = max_kv_cache_usage
        self.when_saturated: WhenSaturated = when_saturated
        self.stale_grace_s = stale_grace_s
        self.rng = rng if rng is not None else random.Random()
        self.scale_local = scale_local
        self.use_latency = use_latency
        self.share = share
        self.prefix_load_factor = float(prefix_load_factor)
        self.prefix_load_slack = float(prefix_load_slack)
        self.placements = Placements()  # of picks on views no cache made (a cache has its own)
        self._caches = weakref.WeakKeyDictionary()
        self._last = None
        self._view = None
        self._view_index = None
        self._lock = threading.Lock()

    def pick(
        self,
        view: View | ViewCache | Mapping[str, EndpointView],
        model: str | None = None,
        *,
        prompt: str | None = None,
        candidates: Iterable[str] | None = None,
        local: LocalLoad | None = None,
    ) -> str | None:
        """The endpoint id for one request, or None when no endpoint may take it.

        ``prompt``: the text the engine will prefill (``prompt_of(messages)`` for a chat
        request), for prefix affinity; ``candidates`` limits the choice to those ids
        (unknown ids are ignored); ``local`` is this replica's ``LocalLoad`` (see the
        class doc). An argument of the wrong type (a model that is not a string,
        ``candidates`` given as one string) raises ``TypeError``."""
        check_arguments(view, model, candidates, local)
        if prompt is None:
            with self._lock:
                return self._pick(view, model, candidates, local, None)
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str or None, got {type(prompt).__name__}")
        ids = block_ids(prompt, model)  # outside the lock: the pick's longest part
        if candidates is not None:
            candidates = list(candidates)
        with self._lock:
            return self._pick(view, model, candidates, local, ids)

    def _pick(
        self,
        view: View | ViewCache | Mapping[str, EndpointView],
        model: str | None,
        candidates: Iterable[str] | None,
        local: LocalLoad | None,
        ids: list[int] | None,
    ) -> str | None:
        found = self._from_cache(view) if isinstance(view, ViewCache) else self._source(view)
        if found is None:
            return None
        index, judge_ms, offset_ms = found
        fleet = None if local is None or not self.share else fleet_of(view, local)
        if fleet is not None and local is not None:
            score = fleet_score(local, fleet, latency=self.use_latency)
            chosen = self._shared(index, judge_ms, model, candidates, score)
        else:
            if local is not None and offset_ms is None:
                # A view without a clock offset is taken as read just now.
                # A bare mapping has no clock: every request in flight counts.
                offset_ms = view.now_ms - local.now() * 1000 if isinstance(view, View) else INF
            score = self._scorer(index, local, offset_ms)
            chosen = self._load_only(index, judge_ms, model, candidates, score)
        if ids is None or chosen is None:
            return chosen
        return self._with_prefix(
            view, index, model, candidates, local, fleet, offset_ms, score, judge_ms, ids, chosen
        )

    def _with_prefix(
        self,
        view: View | ViewCache | Mapping[str, EndpointView],
        index: Index,
        model: str | None,
        candidates: Iterable[str] | None,
        local: LocalLoad | None,
        fleet: FleetLoad | None,
        offset_ms: float | None,
        score: Callable[[Slot], tuple[float, float]],
        judge_ms: float,
        ids: list[int],
        chosen: str,
    ) -> str:
        """The prefix step (affinity.py) after the load-only pick ``chosen``, for the
        prompt of block ids ``ids``; the choice is recorded in the placements."""
        table = self._placements_of(view)
        held = table.lookup(ids)
        if any(held[0]):  # something holds a block of it (a placement's value is never 0)
            if self.use_latency and local is not None:
                # The bound compares counts per capacity, without the speed factor: under
                # affinity this replica's request times mostly tell queues the counts show
                # already, and the least loaded reference's are the lowest of several.
                score = (
                    fleet_score(local, fleet, speed=False)
                    if fleet is not None
                    else self._scorer(index, local, offset_ms, latency=False)
                )
            chosen = prefer(
                table,
                ids,
                held,
                index,
                index.model(model),
                chosen,
                score,
                judge_ms,
                by_kv=fleet is not None,
                factor=self.prefix_load_factor,
                slack=self.prefix_load_slack,
                allowed=None if candidates is None else set(candidates),
                agree=agreeing(table, fleet),
            )
        slot = index.slots.get(chosen)
        if slot is not None:
            table.observe(chosen, slot.prefix_queries, slot.prefix_hits, slot.scraped_at_ms)
        capacity = None if slot is None else slot.capacity  # unknown: as every replica takes it
        table.record(chosen, ids, capacity, held)
        return chosen

    def _placements_of(self, view: object) -> Placements:
        cache = view if isinstance(view, ViewCache) else getattr(view, "cache", None)
        return cache.placements if isinstance(cache, ViewCache) else self.placements

    def _load_only(
        self,
        index: Index,
        judge_ms: float,
        model: str | None,
        candidates: Iterable[str] | None,
        score: Callable[[Slot], tuple[float, float]],
    ) -> str | None:
        """The pick on the pages and this replica's own requests (class doc)."""
        models = index.model(model)
        if candidates is not None:
            return self._among(models, index, candidates, judge_ms, score)
        for saturated in (False, True):
            if saturated and self.when_saturated == "none":
                return None
            for tier in range(TIERS):
                bag = models.bags[tier][saturated]
                if bag.items:
                    chosen = self._two_choices(bag, judge_ms, models, score)
                    if chosen is not None:
                        return chosen
        return None

    # --- with the fleet's shared counts ------------------------------------------------

    def _shared(
        self,
        index: Index,
        judge_ms: float,
        model: str | None,
        candidates: Iterable[str] | None,
        score: Callable[[Slot], tuple[float, float]],
    ) -> str | None:
        """The pick on the fleet's estimate (``fleet_score``, scores.py). A page's ``waiting`` no
        longer saturates an endpoint (the estimate knows its queue better than a page a
        second old); its KV usage still does."""
        models = index.model(model)
        if candidates is not None:
            return self._among(models, index, candidates, judge_ms, score, by_kv=True)
        for full in (False, True):
            if full and self.when_saturated == "none":
                return None
            for tier in range(TIERS):
                open_bag, saturated_bag = models.bags[tier]
                if not (open_bag.items or saturated_bag.items):
                    continue  # no endpoint in this tier (a base model's 0 and 1)
                if full:
                    bags: Bags = ((saturated_bag, is_full),)
                else:  # saturated by its waiting only: open on the fleet's estimate
                    bags = ((open_bag, None), (saturated_bag, not_full))
                chosen = self._fewest(bags, judge_ms, models, score)
                if chosen is not None:
                    return chosen
        return None

    # --- choosing -----------------------------------------------------------------------

    def _scorer(
        self,
        index: Index,
        local: LocalLoad | None,
        offset_ms: float | None,
        *,
        latency: bool = True,
    ) -> Callable[[Slot], tuple[float, float]]:
        """The load of an endpoint for this pick: (requests per unit of capacity, KV);
        ``latency`` False: without the slowness."""
        if local is None or offset_ms is None:
            return view_load
        scale = 1.0
        if self.scale_local:
            # This replica's share of the fleet's requests, from the view's total and
            # ours in flight: with R equal replicas ours are ~1/R of what was sent.
            scale = clamp((index.requests + 1) / (local.total() + 1), 1.0, SCALE_MAX)
        since, offset_s = local.since, offset_ms / 1000
        slowness = local.slowness if self.use_latency and latency else neutral
        now = local.now()

        def load(slot: Slot) -> tuple[float, float]:
            recent = since(slot.id, slot.scraped_at_ms / 1000 - offset_s)
            requests = slot.requests + 1 + scale * recent
            return requests / slot.weight * slowness(slot.id, now), slot.kv or 0.0

        return load

    def _among(
        self,
        models: ModelIndex,
        index: Index,
        candidates: Iterable[str],
        judge_ms: float,
        score: Callable[[Slot], tuple[float, float]],
        *,
        by_kv: bool = False,
    ) -> str | None:
        """The same choice limited to ``candidates`` (a scan of them, not of the view);
        ``by_kv``: the fleet's estimate, saturated by KV usage only, the least loaded."""
        groups: dict[tuple[bool, int], Bag] = {}
        for endpoint_id in dict.fromkeys(candidates):
            slot = index.slots.get(endpoint_id)
            if slot is None or slot.fresh_until_ms < judge_ms:
                continue
            tier = slot.tier(models.model, models.adapter)
            if tier is not None:
                saturated = slot.full if by_kv else slot.saturated
                groups.setdefault((saturated, tier), Bag()).add(slot)
        if not groups:
            return None
        saturated, tier = min(groups)
        if saturated and self.when_saturated == "none":
            return None
        if by_kv:
            return self._fewest(((groups[saturated, tier], None),), judge_ms, None, score)
        return self._two_choices(groups[saturated, tier], judge_ms, None, score)


#: What ``pick`` takes as its view (a tuple made once: ``A | B`` would build a union at
#: every call).
_VIEW_TYPES = (ViewCache, View, Mapping)


def check_arguments(view: object, model: object, candidates: object, local: object) -> None:
    """``TypeError`` for an argument ``pick`` cannot mean: the call is wrong, and a None
    would read as "no endpoint may take it"."""
    if not isinstance(view, _VIEW_TYPES):
        raise TypeError(
            f"pick() needs a ViewCache, a View or a mapping of EndpointViews, "
            f"got {type(view).__name__}"
        )
    if model is not None and not isinstance(model, str):
        raise TypeError(
            f"model must be a model name (str) or None, got {type(model).__name__}: "
            "candidate ids go in candidates=[...]"
        )
    if candidates is not None and (
        isinstance(candidates, str | bytes) or not isinstance(candidates, Iterable)
    ):
        raise TypeError(
            f"candidates must be an iterable of endpoint ids (a list, a set), "
            f"got {type(candidates).__name__} {candidates!r:.60}"
        )
    if local is not None and not isinstance(local, LocalLoad):
        raise TypeError(f"local must be a LocalLoad or None, got {type(local).__name__}")
