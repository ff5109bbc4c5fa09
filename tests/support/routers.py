"""A Router on hand-built endpoints, for tests of the routing rules without Redis."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterable, Mapping

from poller.reader.exchange.wire import LOST_AFTER_MS
from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import LocalLoad
from poller.reader.prefix.placements import Placements
from poller.reader.router import Router
from poller.reader.routing.index import Index
from poller.reader.routing.indexer import timed
from poller.reader.routing.models import FleetLoadModel, Score
from poller.reader.routing.options import RoutingOptions
from poller.reader.ticket import Ticket
from poller.reader.view.cache import ViewCache
from poller.reader.view.records import EndpointView, Timing
from poller.reader.view.snapshot import View

#: The freshness bound the endpoints get here (an hour): a test's picks never depend on
#: how long the machine takes between loading the cache and picking.
BOUND_MS = 3_600_000


def lasting(endpoint: EndpointView) -> EndpointView:
    """``endpoint`` fresh for ``BOUND_MS`` after its scrape (a failing one stays so)."""
    timing = endpoint.timing
    if timing is None:
        return endpoint
    longer = Timing(timing.scraped_at_ms, BOUND_MS, timing.failure_at_ms, timing.failing)
    state, age = longer.state_at(timing.scraped_at_ms or 0)
    return EndpointView(
        endpoint.id,
        state=state,
        age_ms=age,
        owner=endpoint.owner,
        token=endpoint.token,
        raw=endpoint.raw,
        timing=longer,
    )


def cache_on(view: View | Mapping[str, EndpointView] | Iterable[EndpointView]) -> ViewCache:
    """A healthy cache loaded with ``view``'s endpoints, each fresh for ``BOUND_MS``."""
    if isinstance(view, View):
        now_ms, endpoints = view.now_ms, list(view.endpoints.values())
    else:
        endpoints = list(view.values() if isinstance(view, Mapping) else view)
        now_ms = max((e.timing.scraped_at_ms or 0 for e in endpoints if e.timing), default=0)
    cache = ViewCache()
    cache.load(View(now_ms, 1, {e.id: lasting(e) for e in endpoints}))
    cache.healthy = True
    return cache


def router_on(
    view: View | Mapping[str, EndpointView] | Iterable[EndpointView] | ViewCache,
    options: RoutingOptions | None = None,
    *,
    local: LocalLoad | None = None,
    fleet: FleetLoad | None = None,
    placements: Placements | None = None,
    seed: int = 1,
) -> Router:
    """A Router on ``view`` (a cache as it is), sharing nothing through Redis."""
    cache = view if isinstance(view, ViewCache) else cache_on(view)
    return Router(
        cache,
        options,
        local=local,
        fleet=fleet,
        placements=placements,
        rng=random.Random(seed),
    )


def picked(router: Router, n: int, *args: object, **kwargs: object) -> list[Ticket | None]:
    """``n`` picks, each left in flight."""
    return [router.pick(*args, **kwargs) for _ in range(n)]  # type: ignore[arg-type]


def ids(tickets: Iterable[Ticket | None]) -> list[str | None]:
    return [None if t is None else t.id for t in tickets]


def counted(router: Router, n: int, *args: object, **kwargs: object) -> Counter[str | None]:
    """Where ``n`` picks go, each ended at once (nothing left in flight)."""
    out: Counter[str | None] = Counter()
    for _ in range(n):
        ticket = router.pick(*args, **kwargs)  # type: ignore[arg-type]
        if ticket is not None:
            ticket.done()
        out[None if ticket is None else ticket.id] += 1
    return out


def fleet_score(local: LocalLoad, fleet: FleetLoad, **kwargs: bool) -> Score:
    """The fleet load model's score for a pick now (``bound=True``: prefix affinity's)."""
    model = FleetLoadModel(local, fleet, LOST_AFTER_MS / 1000)
    return model.scorer(Index([], timed, 5, 0.8), None, **kwargs)


_numbers = itertools.count(1)


def read_others(
    fleet: FleetLoad,
    pages: Mapping[str, tuple[int, int]],
    others: Mapping[str, int],
    *,
    now_ms: float = 0.0,
    live: int = 1,
    offset_ms: float = 0.0,
    changed: set[str] | None = None,
) -> None:
    """An exchange call answered: the share script's totals (every one) say the ``live``
    other replicas have ``others`` in flight, this replica's as last written besides."""
    written = fleet.written
    fields: list[object] = []
    for e in sorted(others.keys() | written.keys()):
        fields += [e, str(others.get(e, 0) + written.get(e, 0))]
    fleet.read(next(_numbers), live, fields, pages, offset_ms, now_ms, full=True, changed=changed)
