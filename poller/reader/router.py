"""The Router: the one object a gateway replica holds.

    async with StatsReader.from_url(url) as reader, reader.router() as router:
        ticket = router.pick(model, prompt=prompt)     # None: no endpoint may take it now
        if ticket is not None:
            with ticket:                               # in flight until the block ends
                ...  # send the request to ticket.url

It owns the replica's gateway state: the cached view (``cache``), this replica's
requests in flight (``local``) and the fleet's (``fleet``), the prefix placements
(``placements``), the exchange with the other replicas (``exchange``, run by the reader
that opened the Router) and the routing rules (``options``). A pick reads (the index,
the load model, prefix affinity: poller/reader/routing/) and then makes one record: the
ticket that counts the request, and the prompt's placement. Picks never touch Redis;
threads and tasks may share one Router (a pick holds its lock for a few microseconds).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import NamedTuple

from poller.reader.exchange.exchange import Exchange
from poller.reader.exchange.wire import LOST_AFTER_MS
from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import LocalLoad
from poller.reader.prefix.blocks import block_ids
from poller.reader.prefix.placements import Found, Placements
from poller.reader.routing.affinity import prefer
from poller.reader.routing.indexer import Found as Indexed
from poller.reader.routing.indexer import Indexer
from poller.reader.routing.models import FleetLoadModel, LoadModel, LocalLoadModel
from poller.reader.routing.options import RoutingOptions
from poller.reader.routing.pick import Pick
from poller.reader.ticket import Ticket
from poller.reader.view.cache import ViewCache
from poller.reader.view.records import EndpointView
from poller.reader.view.snapshot import View

__all__ = ["Refusal", "Router"]

_LOST_AFTER_S = LOST_AFTER_MS / 1000


#: How long an explanation stands for the same request on the same view (seconds): the
#: freshness it judged may change with time alone, not much within this.
EXPLAINED_S = 0.25


class Refusal(NamedTuple):
    """Why no endpoint may take a request now (``Router.explain``). ``reason``:

    - ``not_ready``: no view to route on (Redis never reached or lost for longer than
      ``stale_grace_s``, a namespace nothing wrote, another schema version);
    - ``no_endpoint``: no registered endpoint (among the candidates) serves the model;
    - ``not_fresh``: some serve it, but none has fresh numbers now (stale, failing,
      asleep, never scraped);
    - ``saturated``: every one that may take it is saturated, and
      ``when_saturated="none"`` sheds the request;
    - ``""``: nothing refuses it (a pick now would choose one).
    """

    reason: str
    detail: str


class Router:
    """Routes one gateway replica's requests (module doc). Open it with
    ``reader.router(options)``; built by hand on a ``ViewCache`` it shares nothing."""

    def __init__(
        self,
        cache: ViewCache,
        options: RoutingOptions | None = None,
        *,
        local: LocalLoad | None = None,
        fleet: FleetLoad | None = None,
        placements: Placements | None = None,
        exchange: Exchange | None = None,
        rng: random.Random | None = None,
    ) -> None:
        options = RoutingOptions() if options is None else options
        if not isinstance(options, RoutingOptions):
            raise TypeError(f"options must be a RoutingOptions, got {type(options).__name__}")
        self.cache = cache
        self.options = options
        self.local = local if local is not None else LocalLoad()
        #: The fleet's shared counts (None: ``options.share`` is off).
        self.fleet = fleet if fleet is not None or not options.share else FleetLoad()
        self.placements = placements if placements is not None else Placements()
        self.exchange = exchange
        self.rng = rng if rng is not None else random.Random()
        if self.fleet is not None:
            self.fleet.attach(self.local)
        self._indexer = Indexer(
            options.max_waiting, options.max_kv_cache_usage, options.stale_grace_s
        )
        # The last explanation: (model, candidates, the view's version, when), refusal.
        self._explained: tuple[tuple[object, ...], float, Refusal] | None = None
        self._model: LoadModel
        if self.fleet is not None:
            self._model = FleetLoadModel(
                self.local,
                self.fleet,
                _LOST_AFTER_S,
                use_latency=options.use_latency,
                max_waiting=options.max_waiting,
            )
        else:
            self._model = LocalLoadModel(
                self.local, scale_local=options.scale_local, use_latency=options.use_latency
            )

    # --- picking ------------------------------------------------------------------------

    def pick(
        self,
        model: str | None = None,
        *,
        prompt: str | None = None,
        candidates: Iterable[str] | None = None,
        fallbacks: int = 0,
    ) -> Ticket | None:
        """A ticket for one request, or None when no endpoint may take it now
        (``explain`` says why). ``model``: only an endpoint that serves it;
        ``prompt``: the text the engine will prefill (``prompt_of(messages)`` for a
        chat request), for prefix affinity; ``candidates``: only one of those ids;
        ``fallbacks``: up to that many other endpoints, best first, in
        ``ticket.fallbacks``. A wrong type is a ``TypeError``."""
        if (model is not None and type(model) is not str) or type(fallbacks) is not int:
            check_pick(model, candidates, fallbacks)  # raises (a str subclass passes it)
        if fallbacks < 0:
            check_pick(model, candidates, fallbacks)
        wanted = None
        if candidates is not None:
            check_pick(model, candidates, fallbacks)
            wanted = list(candidates)
        ids = None if prompt is None else block_ids(prompt, model)  # outside the lock
        with self._indexer.lock:
            found = self._indexer.of_cache(self.cache)
            if found is None:
                return None
            pick = self._pick(found, model, wanted)
            chosen = pick.choose()
            if chosen is None:
                return None
            held = None
            if ids is not None:
                chosen, held = self._prefer(pick, found, ids, chosen)
            others = tuple(pick.ranked(chosen, fallbacks)) if fallbacks else ()
        if held is not None:
            self._place(pick, chosen, ids, held)  # type: ignore[arg-type]
        return Ticket(self.cache, self.local, chosen, others)

    def track(self, endpoint_id: str) -> Ticket:
        """A ticket for a request sent to ``endpoint_id`` without a pick (a gateway's
        own retry or fallback): counted as a picked one is."""
        if not isinstance(endpoint_id, str):
            raise TypeError(f"endpoint_id must be a str, got {type(endpoint_id).__name__}")
        return Ticket(self.cache, self.local, endpoint_id)

    def _pick(self, found: Indexed, model: str | None, candidates: list[str] | None) -> Pick:
        index, judge_ms, offset_ms = found
        score = self._model.scorer(index, offset_ms)
        options = self.options
        return Pick(
            index, model, judge_ms, self._model, score, self.rng, options.when_saturated, candidates
        )

    def _prefer(self, pick: Pick, found: Indexed, ids: list[int], chosen: str) -> tuple[str, Found]:
        """Prefix affinity after the load-only choice (routing/affinity.py)."""
        table = self.placements
        held = table.lookup(ids)
        if any(held[0]):  # something holds a block of it (a placement's value is never 0)
            options = self.options
            bound = pick.score
            if options.use_latency:  # the bound compares counts, not speed (docs/reader.md)
                bound = self._model.scorer(found[0], found[2], bound=True)
            chosen = prefer(
                pick,
                table,
                ids,
                held,
                chosen,
                bound,
                factor=options.prefix_load_factor,
                slack=options.prefix_load_slack,
                agree=self._agree(),
            )
        return chosen, held

    def _place(self, pick: Pick, chosen: str, ids: list[int], held: Found) -> None:
        """The record of a pick with a prompt: the prompt's blocks went to ``chosen``."""
        table = self.placements
        slot = pick.index.slots.get(chosen)
        if slot is not None:
            table.observe(chosen, slot.prefix_queries, slot.prefix_hits, slot.scraped_at_ms)
        capacity = None if slot is None else slot.capacity  # unknown: as every replica takes it
        table.record(chosen, ids, capacity, held)

    def _agree(self) -> bool:
        """Whether a prefix pick agrees with the other replicas by the hash: the
        placements not shared, and this replica not known to be alone (the fleet's
        counts current, no other replica with a request in flight: none to agree with)."""
        if self.placements_shared:
            return False
        fleet = self.fleet
        return not (fleet is not None and self._load_shared() and not fleet.peers)

    # --- asking -------------------------------------------------------------------------

    def eligible(self, endpoint_id: str, model: str | None = None) -> bool:
        """Whether ``endpoint_id`` may take a request for ``model`` now, by the rules a
        pick applies: a pick among it alone would choose it (a saturated endpoint may,
        unless ``when_saturated="none"``)."""
        with self._indexer.lock:
            found = self._indexer.of_cache(self.cache)
            if found is None:
                return False
            return self._pick(found, model, [endpoint_id]).choose() is not None

    def saturated(self, endpoint_id: str) -> bool:
        """Whether the load model takes ``endpoint_id`` as saturated now (False when it
        has no fresh numbers: it is not eligible then either)."""
        with self._indexer.lock:
            found = self._indexer.of_cache(self.cache)
            slot = None if found is None else found[0].slots.get(endpoint_id)
            return slot is not None and self._model.judge(found[0])(slot)  # type: ignore[index]

    def explain(
        self, model: str | None = None, *, candidates: Iterable[str] | None = None
    ) -> Refusal:
        """Why ``pick(model, candidates=...)`` answers None now (``Refusal``). Linear in
        the view; asked again for the same request on the same view within
        ``EXPLAINED_S``, the answer is the one worked out then (a gateway that refuses
        every request, all engines stale, asks once per request)."""
        check_pick(model, candidates, 0)
        cache = self.cache
        wanted = None if candidates is None else list(dict.fromkeys(candidates))
        key = (model, None if wanted is None else tuple(wanted), cache.version, cache.loaded)
        now = cache.clock()
        explained = self._explained
        if explained is not None and explained[0] == key and now - explained[1] < EXPLAINED_S:
            return explained[2]
        refusal = self._explain(model, cache.ids() if wanted is None else wanted)
        self._explained = (key, now, refusal)
        return refusal

    def _explain(self, model: str | None, ids: list[str]) -> Refusal:
        cache = self.cache
        with self._indexer.lock:
            found = self._indexer.of_cache(cache)
            if found is None:
                return Refusal("not_ready", self._not_ready())
            pick = self._pick(found, model, ids)
            if pick.choose() is not None:
                return Refusal("", "")
            usable = pick.usable(ids)
        asked = "" if model is None else f" for model {model!r}"
        if usable:  # fresh and serving it, yet not chosen: saturated, and shed
            return Refusal("saturated", f"every endpoint{asked} is saturated")
        serving = [e for e in map(cache.get, ids) if e is not None and _serves(e, model)]
        if serving:
            states = sorted({_state(e) for e in serving})
            return Refusal("not_fresh", f"no endpoint{asked} is fresh now ({', '.join(states)})")
        return Refusal("no_endpoint", f"no registered endpoint serves{asked or ' requests'}")

    def _not_ready(self) -> str:
        cache = self.cache
        if cache.schema_missing:
            return f"namespace {cache.namespace} has no schema key: nothing ever wrote it"
        if not cache.loaded:
            return "no view read from Redis yet"
        return f"Redis lost for longer than stale_grace_s ({self.options.stale_grace_s:g} s)"

    # --- the state of the replica -------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Picks may route: a view was read and Redis answered within ``stale_grace_s``
        (so a pick judges freshness on numbers it may use)."""
        with self._indexer.lock:
            return self._indexer.of_cache(self.cache) is not None

    @property
    def healthy(self) -> bool:
        """Redis answers and the namespace has a schema key (``ViewCache.healthy``)."""
        return self.cache.healthy

    @property
    def load_shared(self) -> bool:
        """The other replicas' requests in flight are current (exchanged within the
        last second). False: not shared, Redis lost, or the ACL user lacks the right."""
        return self._load_shared()

    def _load_shared(self) -> bool:
        fleet = self.fleet
        return fleet is not None and fleet.answered_within(_LOST_AFTER_S)

    @property
    def placements_shared(self) -> bool:
        """The other replicas' prefix placements are current (exchanged within the last
        second). False: this replica's own only."""
        return self.placements.answered_within(_LOST_AFTER_S)

    @property
    def replica_id(self) -> str | None:
        """This replica's id in the shared counts (None: not shared)."""
        return None if self.fleet is None else self.fleet.replica_id

    def view(self) -> View:
        """Every endpoint as of now (linear in the fleet: not per request)."""
        return self.cache.view()

    def get(self, endpoint_id: str) -> EndpointView | None:
        """One endpoint as of now (a dict lookup)."""
        return self.cache.get(endpoint_id)

    def __repr__(self) -> str:
        return (
            f"Router({self.replica_id!r}, {len(self.cache.ids())} endpoints, "
            f"ready={self.ready}, load_shared={self.load_shared})"
        )


def check_pick(model: object, candidates: object, fallbacks: object) -> None:
    """``TypeError`` for an argument ``pick`` cannot mean: the call is wrong, and a None
    would read as "no endpoint may take it"."""
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
    if isinstance(fallbacks, bool) or not isinstance(fallbacks, int) or fallbacks < 0:
        raise TypeError(f"fallbacks must be an integer >= 0, got {fallbacks!r}")


def _serves(endpoint: EndpointView, model: str | None) -> bool:
    """The endpoint's numbers, or its registry entry, name ``model`` (None: any)."""
    if model is None:
        return True
    stats = endpoint.stats
    if stats is not None:
        return model in stats.models or model in stats.lora_running or model in stats.lora_waiting
    entry = endpoint.entry
    return entry is None or not entry.models or model in entry.models


def _state(endpoint: EndpointView) -> str:
    stats = endpoint.stats
    if endpoint.state == "fresh" and stats is not None and stats.sleeping:
        return "asleep"
    return endpoint.state
